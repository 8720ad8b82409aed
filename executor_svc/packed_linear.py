"""Linear layers on CPU through the native packed GEMM (native/packed_gemm.c).

`pack(weight)` copies an [out, in] float32 weight once, at load, into the
panel order the kernel reads; `linear(x, weight, bias, panels)` multiplies
through the kernel for 2-256 rows (decode batches, short prefill chunks)
and through F.linear (MKL) otherwise, so the model keeps both copies: the packed one costs as much
memory as the linear weights themselves. The model packs only where the
kernel was built (x86 with AVX-512) and the weights are float32 on CPU.
"""
from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.nn.functional as F

from executor_svc.native_build import load_library

SOURCE = os.path.join(os.path.dirname(__file__), "native", "packed_gemm.c")
_i64, _i32, _p = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p


@dataclass(frozen=True)
class _Kernel:
    gemm: ctypes._CFuncPtr
    panel_width: int  # output columns per packed panel


@lru_cache(maxsize=1)
def kernel() -> _Kernel | None:
    """The compiled kernel, or None where it cannot run (no compiler, no AVX-512)."""
    lib = load_library(SOURCE)
    if lib is None or lib.packed_gemm_panel_width() == 0:
        return None
    gemm = lib.packed_gemm
    gemm.argtypes = [_p, _i64, _p, _i64, _p, _p, _i32, _i32, _i32, _i32]
    gemm.restype = _i32
    return _Kernel(gemm, lib.packed_gemm_panel_width())


# In this range of rows the packed kernel beats MKL over cold weights (1.2-1.5x
# at 8-256 rows, the linears of 30 layers); at one row both read the weights at
# full bandwidth, and past one row chunk (MC = 256 in packed_gemm.c) MKL is as
# fast or faster (docs/benchmarks.md, optimization log).
PACKED_MIN_ROWS, PACKED_MAX_ROWS = 2, 256


def pack(weight: torch.Tensor) -> torch.Tensor:
    """A float32 CPU [out, in] weight in panel order:
    panels[p, k, c] = weight[p * width + c, k], zero past `out`. The kernel must be available."""
    k = kernel()
    assert k is not None, "pack() called where the packed GEMM kernel is unavailable"
    assert weight.dtype == torch.float32 and weight.device.type == "cpu", (
        f"packed GEMM takes float32 CPU weights, got {weight.dtype} on {weight.device}"
    )
    out_features, in_features = weight.shape
    width = k.panel_width
    num_panels = -(-out_features // width)
    padded = weight.new_zeros(num_panels * width, in_features)
    padded[:out_features] = weight
    return padded.view(num_panels, width, in_features).transpose(1, 2).contiguous()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           panels: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, in] @ weight.T (+ bias) -> [M, out]: through the packed kernel
    when `panels` (= pack(weight)) is given and M is small, else F.linear."""
    if panels is None or not PACKED_MIN_ROWS <= x.shape[0] <= PACKED_MAX_ROWS:
        return F.linear(x, weight, bias)
    out_features, in_features = weight.shape
    assert x.dim() == 2 and x.shape[1] == in_features and x.dtype == torch.float32, (
        f"packed linear: input {tuple(x.shape)} {x.dtype} vs weight {tuple(weight.shape)}"
    )
    assert panels.shape[1] == in_features and panels.shape[0] * panels.shape[2] >= out_features, (
        f"panels {tuple(panels.shape)} do not pack a {tuple(weight.shape)} weight"
    )
    if x.stride(1) != 1:
        x = x.contiguous()
    if bias is not None:
        assert bias.is_contiguous() and bias.shape == (out_features,), f"bias shape {tuple(bias.shape)}"
    out = torch.empty(x.shape[0], out_features, dtype=torch.float32)
    if x.shape[0] == 0:
        return out
    kernel().gemm(out.data_ptr(), out.stride(0), x.data_ptr(), x.stride(0), panels.data_ptr(),
                  None if bias is None else bias.data_ptr(), x.shape[0], out_features, in_features,
                  torch.get_num_threads())
    return out
