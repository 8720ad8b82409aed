"""Loads the native paged-attention kernels (built by executor_svc.native_build)
via ctypes: native/paged_decode.c and native/paged_prefill.c.

`load()` and `load_prefill()` return None when a kernel cannot be built
here, and the CPU backend then falls back to plain torch. Their signatures
are declared once, in executor_svc/native_signatures.py.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from functools import lru_cache

from executor_svc.native_build import load_library

SOURCE = os.path.join(os.path.dirname(__file__), "native", "paged_decode.c")
PREFILL_SOURCE = os.path.join(os.path.dirname(__file__), "native", "paged_prefill.c")


@lru_cache(maxsize=2)
def load(portable: bool = False):
    """The compiled kernel's function, or None if it cannot be built here.

    `portable` builds the plain-C kernel even where AVX-512 is available
    (tests check both paths on one machine)."""
    lib = load_library(SOURCE, ("-DPAGED_DECODE_GENERIC",) if portable else ())
    if lib is None:
        return None
    return lib.paged_decode_attention  # typed from native_signatures.py


@lru_cache(maxsize=1)
def dot_native() -> bool:
    """Whether the decode kernel's VDPBF16PS path (decode_dot.h) runs on this
    CPU: built with gcc for AVX-512BW, and the CPU has AVX512-BF16."""
    lib = load_library(SOURCE)
    return lib is not None and lib.paged_decode_dot_native() == 1


def dot_supported(num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Whether the decode kernel has bf16 dot instances (native or emulated)
    for this attention shape: built (AVX-512BW), and one of its fast path's."""
    group = num_heads // num_kv_heads
    return _dot_built() and 1 <= group <= 8 and head_dim in (64, 128)


@lru_cache(maxsize=1)
def _dot_built() -> bool:
    lib = load_library(SOURCE)
    return lib is not None and lib.paged_decode_dot_built() == 1


@dataclass(frozen=True)
class PrefillKernel:
    attend: ctypes._CFuncPtr  # paged_prefill_attention(...), signature in native_signatures.py
    tokens_per_item: int  # the most query tokens one work item may carry


@lru_cache(maxsize=1)
def load_prefill() -> PrefillKernel | None:
    """The compiled prefill kernel, or None if it cannot be built here.
    It returns -1 for shapes (or CPUs) it has no path for."""
    lib = load_library(PREFILL_SOURCE)
    if lib is None:
        return None
    return PrefillKernel(lib.paged_prefill_attention, lib.paged_prefill_tokens_per_item())
