"""Builds and loads native/paged_decode.c with the system C compiler, via ctypes.

Compiled once per source version and CPU (-march=native) into a cache folder
and reused; ctypes releases the GIL for the call. `load()` returns None when
no compiler is available, and the CPU backend then falls back to plain torch.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from functools import lru_cache

import structlog

log = structlog.get_logger(__name__)
SOURCE = os.path.join(os.path.dirname(__file__), "native", "paged_decode.c")
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11"]

_i64, _i32, _f32, _p = ctypes.c_int64, ctypes.c_int, ctypes.c_float, ctypes.c_void_p
_ARGTYPES = [
    _p, _i64, _i64,  # out, strides
    _p, _i64, _i64,  # q, strides
    _p, _p, _i32,  # k_cache, v_cache, cache_bf16
    _p, _i64,  # block_tables, stride
    _p, _p, _p, _p, _i32,  # seq_lens, tokens, out_rows, seq_index, num_decodes
    _i32, _i32, _i32, _i32, _i32,  # num_heads, num_kv_heads, head_dim, block_size, max_seq_len
    _f32, _i32,  # scale, num_threads
]


def _cpu_signature() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        flags = ""
    return platform.machine() + flags


def _build_dir() -> str:
    here = os.path.join(os.path.dirname(__file__), "native", "build")
    try:
        os.makedirs(here, exist_ok=True)
        if os.access(here, os.W_OK):
            return here
    except OSError:
        pass
    return os.path.join(tempfile.gettempdir(), "pagedserve-native")


@lru_cache(maxsize=2)
def load(portable: bool = False):
    """The compiled kernel's function, or None if it cannot be built here.

    `portable` builds the plain-C kernel even where AVX-512 is available
    (tests check both paths on one machine)."""
    flags = FLAGS + ["-DPAGED_DECODE_GENERIC"] if portable else FLAGS
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.warning("native_kernel_unavailable", reason="no C compiler on PATH")
        return None
    with open(SOURCE, "rb") as f:
        source = f.read()
    key = hashlib.sha256(source + " ".join(flags).encode() + _cpu_signature().encode()).hexdigest()[:16]
    folder = _build_dir()
    os.makedirs(folder, exist_ok=True)
    lib_path = os.path.join(folder, f"paged_decode-{key}.so")
    if not os.path.exists(lib_path):
        tmp = f"{lib_path}.{os.getpid()}.tmp"
        done = subprocess.run([compiler, *flags, SOURCE, "-o", tmp, "-lm"], capture_output=True, text=True)
        if done.returncode != 0:
            log.warning("native_kernel_unavailable", reason="compile failed", stderr=done.stderr[-2000:])
            return None
        os.replace(tmp, lib_path)  # atomic: concurrent builders never load a half-written file
    fn = ctypes.CDLL(lib_path).paged_decode_attention
    fn.argtypes = _ARGTYPES
    fn.restype = ctypes.c_int
    return fn
