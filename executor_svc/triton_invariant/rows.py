"""The sampler's row reductions as batch-invariant Triton kernels: log-softmax,
logsumexp and cumsum over the last dimension of a float32 [rows, V] tensor.

Why torch's are not enough on CUDA: logsumexp runs torch's generic reduction
kernel, which splits a row over more blocks when there are fewer rows; cumsum
of a single row goes to CUB's device-wide scan, of several rows to torch's
own per-row scan, another order. (log_softmax happens to launch one block per
row sized by V alone, but nothing promises that across torch versions.)

Here one program reduces one row, in an order fixed by V and BLOCK alone:
lane j of a BLOCK-wide accumulator takes the elements j, j + BLOCK, ... in
turn (an online max-and-sum for the exponentials), then tl.max / tl.sum fold
the lanes in one fixed tree; the scan carries the running total from one
BLOCK to the next. Inputs are finite or -inf (masked tokens); a row of -inf
only gives lse = -inf.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from executor_svc.triton_invariant.launch import check_tensors

BLOCK = 1024  # lanes per program; a constant, never chosen from the row count


@triton.jit
def _logsumexp_kernel(
    x_ptr, lse_ptr, out_ptr, stride_x, stride_out, V, WRITE_LOG_SOFTMAX: tl.constexpr, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    m = tl.full([BLOCK], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK], tl.float32)
    for v0 in range(0, V, BLOCK):
        v = v0 + tl.arange(0, BLOCK)
        x = tl.load(x_row + v, mask=v < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, x)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # lanes that saw only -inf stay s = 0
        s = s * tl.exp(m - m_safe) + tl.exp(x - m_safe)
        m = m_new
    m_row = tl.max(m, axis=0)
    m_row_safe = tl.where(m_row == float("-inf"), 0.0, m_row)
    log_s = tl.log(tl.sum(s * tl.exp(m - m_row_safe), axis=0))
    tl.store(lse_ptr + row, m_row_safe + log_s)
    if WRITE_LOG_SOFTMAX:
        for v0 in range(0, V, BLOCK):
            v = v0 + tl.arange(0, BLOCK)
            x = tl.load(x_row + v, mask=v < V, other=0.0).to(tl.float32)
            tl.store(out_ptr + row * stride_out + v, (x - m_row_safe) - log_s, mask=v < V)


@triton.jit
def _cumsum_kernel(x_ptr, out_ptr, stride_x, stride_out, V, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    lanes = tl.arange(0, BLOCK)
    carry = tl.zeros([1], tl.float32)
    for v0 in range(0, V, BLOCK):
        v = v0 + lanes
        x = tl.load(x_ptr + row * stride_x + v, mask=v < V, other=0.0).to(tl.float32)
        c = tl.cumsum(x, axis=0) + carry
        tl.store(out_ptr + row * stride_out + v, c, mask=v < V)
        # The block's last running total (masked lanes add 0): one nonzero in a sum, exact.
        carry = tl.sum(tl.where(lanes == BLOCK - 1, c, 0.0), axis=0, keep_dims=True)


def _check(x: torch.Tensor) -> None:
    if x.dim() != 2 or x.dtype != torch.float32 or x.stride(1) != 1:
        raise ValueError(f"row reductions take float32 [rows, V] with unit stride, got {x.dtype} {x.stride()}")
    check_tensors(x)


def _lse(x: torch.Tensor, log_softmax: bool, block: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    _check(x)
    rows, v = x.shape
    lse = torch.empty(rows, dtype=torch.float32, device=x.device)
    out = torch.empty_like(x) if log_softmax else None
    if rows:
        _logsumexp_kernel[(rows,)](
            x, lse, lse if out is None else out, x.stride(0), 0 if out is None else out.stride(0), v,
            WRITE_LOG_SOFTMAX=log_softmax, BLOCK=block,
        )  # fmt: skip
    return lse, out


def logsumexp(x: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """[rows, V] -> [rows, 1]: x.logsumexp(dim=-1, keepdim=True), batch-invariant."""
    return _lse(x, False, block)[0][:, None]


def log_softmax(x: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """[rows, V] -> [rows, V]: x.log_softmax(dim=-1), batch-invariant."""
    return _lse(x, True, block)[1]


def cumsum(x: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """[rows, V] -> [rows, V]: x.cumsum(dim=-1), batch-invariant."""
    _check(x)
    out = torch.empty_like(x)
    if x.shape[0]:
        _cumsum_kernel[(x.shape[0],)](x, out, x.stride(0), out.stride(0), x.shape[1], BLOCK=block)
    return out
