"""Compiles a native C source with the system compiler and loads it via ctypes.

Each library is built once per version of its source and the local headers
it includes, flags and CPU (-march=native) and reused; ctypes releases the GIL
for every call. `load_library` returns None when there is no compiler, the
build fails or the cache is not private, and the caller falls back to plain
torch.

The cache is this user's own: $XDG_CACHE_HOME/pagedserve/native (by default
~/.cache/pagedserve/native), created 0700 and refused when it is owned by
someone else or open to group or others (shared/private_dir.py). A shared
library is code this process runs: a directory another user can write to, a
predictable /tmp path above all, would let them plant one.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import re
import shutil
import subprocess

import structlog

from shared.private_dir import ensure_private_dir

log = structlog.get_logger(__name__)
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11")


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        line = ""
    return frozenset(line.partition(":")[2].split())


def _cpu_signature() -> str:
    return platform.machine() + " ".join(sorted(cpu_flags()))


def cache_dir() -> str:
    """Where compiled kernels live (not yet checked: see load_library). Read at
    each call, like the temp dir it replaces: kernels load lazily, deep below
    any configuration."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "pagedserve", "native")


def _source_and_headers(source: str) -> bytes:
    """The source's bytes followed by those of every local header it includes
    (`#include "..."`, recursively), so editing a header changes the build key."""
    seen: set[str] = set()

    def read(path: str) -> bytes:
        path = os.path.normpath(path)
        if path in seen:
            return b""
        seen.add(path)
        try:
            with open(path, "rb") as f:
                code = f.read()
        except OSError:  # not beside its includer (found through -I, or in a dead #if): key on the name
            return path.encode()
        headers = re.findall(rb'^\s*#\s*include\s+"([^"]+)"', code, flags=re.MULTILINE)
        return code + b"".join(read(os.path.join(os.path.dirname(path), h.decode())) for h in headers)

    return read(source)


def load_library(source: str, extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """The compiled `source` as a loaded library, or None if it cannot be built here."""
    flags = [*FLAGS, *extra_flags]
    stem = os.path.splitext(os.path.basename(source))[0]
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.warning("native_build_unavailable", source=stem, reason="no C compiler on PATH")
        return None
    code = _source_and_headers(source)
    key = hashlib.sha256(code + " ".join(flags).encode() + _cpu_signature().encode()).hexdigest()[:16]
    try:
        folder = ensure_private_dir(cache_dir())
    except OSError as e:  # NotPrivateError is one: owned by another user, or open to others
        log.warning("native_build_unavailable", source=stem, reason=f"kernel cache refused: {e}")
        return None
    lib_path = os.path.join(folder, f"{stem}-{key}.so")
    if not os.path.exists(lib_path):
        tmp = f"{lib_path}.{os.getpid()}.tmp"
        done = subprocess.run([compiler, *flags, source, "-o", tmp, "-lm"], capture_output=True, text=True)
        if done.returncode != 0:
            log.warning("native_build_unavailable", source=stem, reason="compile failed", stderr=done.stderr[-2000:])
            return None
        os.replace(tmp, lib_path)  # atomic: concurrent builders never load a half-written file
    return ctypes.CDLL(lib_path)
