"""Loads the native paged-attention kernels (built by executor_svc.native_build)
via ctypes: native/paged_decode.c and native/paged_prefill.c.

`load()` and `load_prefill()` return None when a kernel cannot be built
here, and the CPU backend then falls back to plain torch.
"""
from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from functools import lru_cache

from executor_svc.native_build import load_library

SOURCE = os.path.join(os.path.dirname(__file__), "native", "paged_decode.c")
PREFILL_SOURCE = os.path.join(os.path.dirname(__file__), "native", "paged_prefill.c")

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


@lru_cache(maxsize=2)
def load(portable: bool = False):
    """The compiled kernel's function, or None if it cannot be built here.

    `portable` builds the plain-C kernel even where AVX-512 is available
    (tests check both paths on one machine)."""
    lib = load_library(SOURCE, ("-DPAGED_DECODE_GENERIC",) if portable else ())
    if lib is None:
        return None
    fn = lib.paged_decode_attention
    fn.argtypes = _ARGTYPES
    fn.restype = ctypes.c_int
    return fn


_PREFILL_ARGTYPES = [
    _p, _i64, _i64,  # out, strides
    _p, _i64, _i64,  # q, strides
    _p, _p, _i32,  # k_cache, v_cache, cache_bf16
    _p, _i64,  # block_tables, stride
    _p, _p, _p, _p, _i32,  # item_token, item_count, item_pos, item_seq, num_items
    _i32, _i32, _i32, _i32,  # num_heads, num_kv_heads, head_dim, block_size
    _f32, _i32,  # scale, num_threads
]


@dataclass(frozen=True)
class PrefillKernel:
    attend: ctypes._CFuncPtr  # paged_prefill_attention(...), argument order in _PREFILL_ARGTYPES
    tokens_per_item: int  # the most query tokens one work item may carry


@lru_cache(maxsize=1)
def load_prefill() -> PrefillKernel | None:
    """The compiled prefill kernel, or None if it cannot be built here.
    It returns -1 for shapes (or CPUs) it has no path for."""
    lib = load_library(PREFILL_SOURCE)
    if lib is None:
        return None
    fn = lib.paged_prefill_attention
    fn.argtypes = _PREFILL_ARGTYPES
    fn.restype = ctypes.c_int
    return PrefillKernel(fn, lib.paged_prefill_tokens_per_item())
