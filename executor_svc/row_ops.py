"""The sampler's row reductions, swappable for batch invariance (--deterministic, docs/determinism.md).

The only sums over a row the sampler computes are log_softmax, logsumexp and
cumsum. torch's are per row on CPU; on CUDA they are not (logsumexp's
reduction and a single row's cumsum split differently by the row count), so
--deterministic there uses `RowOps.triton()`, whose kernels sum each row in one
fixed order, and reports the top logprobs by a stable sort (equal logprobs by
token id) instead of topk, whose order among ties depends on its algorithm.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from executor_svc import fused_ops


def _logsumexp(x: torch.Tensor) -> torch.Tensor:
    """[rows, 1]: natively for float32 on CPU (fused_ops.logsumexp_rows, per row and
    in one order, so as batch-invariant as torch's), else torch's."""
    if x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2:
        out = fused_ops.logsumexp_rows(x)
        if out is not None:
            return out
    return x.logsumexp(dim=-1, keepdim=True)


def top_k_rows(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, ids) [rows, k]: each row's k largest, in descending order. For
    float32 on CPU natively (fused_ops.topk_rows: torch.topk's values exactly,
    equal values in id order, per row), 3-4x faster than torch's topk over a
    49,152-token vocabulary; else, and for rows with a NaN or +inf, torch's."""
    if x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2 and 1 <= k <= x.shape[1]:
        out = fused_ops.topk_rows(x, k)
        if out is not None:
            return out
    return _top_by_topk(x, k)


def _top_by_topk(x: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    top = x.topk(n, dim=-1)
    return top.values, top.indices


def _top_by_stable_sort(x: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The n largest per row, equal values in token-id order: one answer, whatever the algorithm."""
    values, indices = x.sort(dim=-1, descending=True, stable=True)
    return values[:, :n], indices[:, :n]


@dataclass(frozen=True)
class RowOps:
    """The sampler's reductions over each row of a float32 [rows, V] tensor."""

    log_softmax: Callable[[torch.Tensor], torch.Tensor] = lambda x: x.log_softmax(dim=-1)
    logsumexp: Callable[[torch.Tensor], torch.Tensor] = _logsumexp  # [rows, 1]
    cumsum: Callable[[torch.Tensor], torch.Tensor] = lambda x: x.cumsum(dim=-1)
    # (values, ids) [rows, n]: the top logprobs. Natively on CPU (top_k_rows) too: at 64 rows of
    # 49,152, torch's topk(5) took 2.2 ms against 0.5 ms (AMD EPYC Zen 5, 2 threads).
    top: Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]] = top_k_rows
    # Each row's k largest, sorted (values, ids): the sampler's leading tokens and top-p's tiers.
    leading: Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]] = top_k_rows

    @staticmethod
    def torch_only() -> RowOps:
        """torch's own logsumexp and topk on CPU too: the baseline that
        bench/sampler_cpu.py --against-torch times the native ones against."""
        return RowOps(logsumexp=lambda x: x.logsumexp(dim=-1, keepdim=True), top=_top_by_topk, leading=_top_by_topk)

    @staticmethod
    def triton() -> RowOps:
        """Batch-invariant on CUDA (triton_invariant/rows.py); imports triton."""
        from executor_svc.triton_invariant import rows

        return RowOps(rows.log_softmax, rows.logsumexp, rows.cumsum, _top_by_stable_sort)
