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

from executor_svc.native_build import cpu_flags, load_library

SOURCE = os.path.join(os.path.dirname(__file__), "native", "paged_decode.c")
PREFILL_SOURCE = os.path.join(os.path.dirname(__file__), "native", "paged_prefill.c")
# The decode kernel's build with its bf16 dot-product instances (decode_dot.h).
DOT_FLAGS = ("-DPAGED_DECODE_DOT",)


@lru_cache(maxsize=4)
def load(portable: bool = False, dot: bool = False):
    """The compiled kernel's function, or None if it cannot be built here.

    `portable` builds the plain-C kernel even where AVX-512 is available
    (tests check both paths on one machine). `dot` builds the kernel with its
    bf16 dot-product instances too (decode_dot.h: VDPBF16PS and its
    emulation), which double its compile time: only the "dot" decode route
    and its start-up timing load it."""
    flags = ("-DPAGED_DECODE_GENERIC",) if portable else ()
    lib = load_library(SOURCE, flags + (DOT_FLAGS if dot else ()))
    if lib is None:
        return None
    return lib.paged_decode_attention  # typed from native_signatures.py


@lru_cache(maxsize=1)
def _dot_library():
    return load_library(SOURCE, DOT_FLAGS)


@lru_cache(maxsize=1)
def dot_native() -> bool:
    """Whether the decode kernel's VDPBF16PS path runs here: the CPU has
    AVX512-BF16 (checked first, so other CPUs never build the dot kernel),
    and the dot build has the instruction's path (gcc, AVX-512BW)."""
    if "avx512_bf16" not in cpu_flags():
        return False
    lib = _dot_library()
    return lib is not None and lib.paged_decode_dot_native() == 1


def dot_supported(num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Whether the dot build has bf16 dot instances (native or emulated) for
    this attention shape: built (AVX-512BW), and one of its fast path's."""
    group = num_heads // num_kv_heads
    if not (1 <= group <= 8 and head_dim in (64, 128)):
        return False
    lib = _dot_library()
    return lib is not None and lib.paged_decode_dot_built() == 1


@dataclass(frozen=True)
class PrefillKernel:
    attend: ctypes._CFuncPtr  # paged_prefill_attention(...), signature in native_signatures.py
    tokens_per_item: int  # the most query tokens one work item may carry
    dot_built: bool  # the bf16 dot-product items (prefill_dot.h) are in this build
    dot_native: bool  # and their VDPBF16PS instance runs on this CPU


@lru_cache(maxsize=1)
def load_prefill() -> PrefillKernel | None:
    """The compiled prefill kernel, or None if it cannot be built here.
    It returns -1 for shapes (or CPUs) it has no path for."""
    lib = load_library(PREFILL_SOURCE)
    if lib is None:
        return None
    return PrefillKernel(
        lib.paged_prefill_attention,
        lib.paged_prefill_tokens_per_item(),
        lib.paged_prefill_dot_built() == 1,
        lib.paged_prefill_dot_native() == 1,
    )


def prefill_dot_supported(num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Whether the prefill kernel has bf16 dot items (native or emulated) for
    this attention shape: built (AVX-512BW), and one of its float32 ones."""
    kernel = load_prefill()
    group = num_heads // num_kv_heads
    return kernel is not None and kernel.dot_built and 1 <= group <= 8 and head_dim in (64, 128)
