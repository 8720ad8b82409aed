"""RMSNorm, with the residual add fused in front, as a batch-invariant Triton kernel.

torch's RMSNorm on CUDA reduces mean(x^2) with its generic reduction kernel,
which splits a row over more or fewer threads and blocks depending on how
many rows there are. Here one program normalises one row, and the row's
sum of squares runs in a fixed order that depends on the row's width and
BLOCK_D alone: lane j of a BLOCK_D-wide float32 accumulator sums the
elements j, j + BLOCK_D, ... in turn, then tl.sum folds the lanes in one
fixed tree.

The rounding steps are layer_ops.rms_norm's (transformers' Llama): in float32
and rounded to the model dtype before the weight multiply, whose product is
rounded again (on a GPU Triton's sqrt and division may be the fast
approximate instructions, so the values can differ from torch's in the last
bits; the order, hence the invariance, does not depend on that); with `delta`, h + delta is rounded to h's dtype, written back into h
(the residual stream, in place) and normalised as rounded.

Two passes over the row: the first sums squares, the second recomputes
h + delta, stores it and the output. Nothing is read after being written in
the same program, so no barrier is needed between threads.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from executor_svc.triton_invariant.launch import check_tensors

MAX_BLOCK_D = 4096  # wider rows loop; the order then depends on the width only


@triton.jit
def _residual(x_row, delta_row, d, mask, HAS_DELTA: tl.constexpr):
    """h (+ delta, rounded to h's dtype as the model's residual add rounds) at columns d."""
    x = tl.load(x_row + d, mask=mask, other=0.0)
    if HAS_DELTA:
        x = (x.to(tl.float32) + tl.load(delta_row + d, mask=mask, other=0.0).to(tl.float32)).to(x.dtype)
    return x


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    delta_ptr,
    w_ptr,
    out_ptr,
    stride_x,
    stride_delta,
    stride_out,
    D,
    eps,
    HAS_DELTA: tl.constexpr,
    ROUND_BEFORE_WEIGHT: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    delta_row = delta_ptr + row * stride_delta
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        mask = d < D
        x = _residual(x_row, delta_row, d, mask, HAS_DELTA).to(tl.float32)
        acc += x * x
    rstd = 1.0 / tl.sqrt(tl.sum(acc, axis=0) / D + eps)
    for d0 in range(0, D, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        mask = d < D
        x = _residual(x_row, delta_row, d, mask, HAS_DELTA)
        if HAS_DELTA:
            tl.store(x_row + d, x, mask=mask)
        y = x.to(tl.float32) * rstd
        if ROUND_BEFORE_WEIGHT:
            y = y.to(out_ptr.dtype.element_ty).to(tl.float32)
        w = tl.load(w_ptr + d, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * stride_out + d, (y * w).to(out_ptr.dtype.element_ty), mask=mask)


def add_rms_norm(
    h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float, block_d: int | None = None
) -> torch.Tensor:
    """layer_ops.add_rms_norm's contract: h += delta in place (nothing when delta is
    None), then returns rms_norm(h) as a new tensor; batch-invariant.
    `block_d` overrides the lane count (tests use it to loop in the interpreter)."""
    if h.dim() != 2 or h.stride(1) != 1 or weight.shape != h.shape[1:] or weight.dtype != h.dtype:
        raise ValueError(f"rms_norm: h {tuple(h.shape)} {h.stride()} {h.dtype}, weight {tuple(weight.shape)}")
    if delta is not None and (delta.shape != h.shape or delta.dtype != h.dtype or delta.stride(1) != 1):
        raise ValueError(f"rms_norm: delta {tuple(delta.shape)} {delta.dtype} for h {tuple(h.shape)} {h.dtype}")
    check_tensors(h, weight, *(() if delta is None else (delta,)))
    weight = weight.contiguous()
    rows, dim = h.shape
    out = torch.empty(rows, dim, dtype=h.dtype, device=h.device)
    if rows == 0:
        return out
    block_d = block_d or min(triton.next_power_of_2(dim), MAX_BLOCK_D)
    _rms_norm_kernel[(rows,)](
        h,
        h if delta is None else delta,  # a placeholder pointer, never read without HAS_DELTA
        weight,
        out,
        h.stride(0),
        0 if delta is None else delta.stride(0),
        out.stride(0),
        dim,
        eps,
        HAS_DELTA=delta is not None,
        ROUND_BEFORE_WEIGHT=h.dtype != torch.float32,
        BLOCK_D=block_d,
        num_warps=4 if block_d <= 1024 else 8,
    )
    return out
