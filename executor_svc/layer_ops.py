"""The decoder layer's norm and activation ops, and the `Kernels` set a forward runs its linears and norms through.

Each op runs the native fused kernel (fused_ops.py) where it applies and
falls back to torch's reference formula, which it matches: RMSNorm normalises
in float32 and rounds before the weight multiply, as transformers does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from executor_svc import fused_ops, onednn_linear
from executor_svc.gemm_epilogues import swiglu_dot
from executor_svc.packed_linear import PackedWeight, linear, route


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if fused_ops.available(x, weight):
        return fused_ops.rms_norm(x, weight, eps)  # one pass instead of five (bf16: eight) kernels
    if x.dtype == torch.float32:
        # The fused kernel matches the reference formula bit for bit in float32.
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    # Reduced precision: normalise in float32, round, then scale, as HF does.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The residual add, in place (h += delta; nothing when delta is None), then rms_norm(h)."""
    if delta is None:
        return rms_norm(h, weight, eps)
    if fused_ops.available(h, delta, weight) and h.is_contiguous():
        return fused_ops.add_rms_norm(h, delta, weight, eps)  # one pass over h and delta
    h += delta
    return rms_norm(h, weight, eps)


def norm_for_gemm(
    ops: Kernels,
    h: torch.Tensor,
    delta: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    gemm: PackedWeight | None,
) -> torch.Tensor:
    """ops.add_rms_norm(h, delta, weight, eps), the input of the GEMM over `gemm`.
    Where that GEMM takes the BF16 dot route, which rounds its rows to
    bfloat16 first, the norm rounds them as it writes them: the same numbers
    without a float32 [rows, hidden] written and read back by a rounding pass
    (twice a layer: ~2% of a 2,048-token prefill step's time, by the
    thirty-fourth session's arithmetic)."""
    if (
        ops.add_rms_norm is add_rms_norm
        and ops.linear is linear
        and route(h.shape[0], gemm) == "dot"
        and fused_ops.available(h, weight)
        and h.is_contiguous()
        and (delta is None or fused_ops.available(delta))
        and (x := fused_ops.add_rms_norm_bf16_out(h, delta, weight, eps)) is not None
    ):
        return x
    return ops.add_rms_norm(h, delta, weight, eps)


@dataclass(frozen=True)
class Kernels:
    """The two ops of a forward whose sums run across a row: the linear layers
    and the LM head (packed_linear.linear's signature), and RMSNorm with its
    residual add (add_rms_norm's). Attention is the backend's."""

    linear: Callable = linear
    add_rms_norm: Callable = add_rms_norm


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2 * inter] ([gate | up]) -> silu(gate) * up."""
    if fused_ops.available(gate_up) and gate_up.dim() == 2:
        out = fused_ops.silu_mul(gate_up)  # one pass instead of two kernels; None without AVX-512
        if out is not None:
            return out
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def mlp(
    x: torch.Tensor,
    gate_up_weight: torch.Tensor,
    down_weight: torch.Tensor,
    gate_up_packed: PackedWeight | None,
    down_packed: PackedWeight | None,
    linear_fn: Callable = linear,
) -> torch.Tensor:
    """down(swiglu(gate_up(x))) through `linear_fn` (Kernels.linear).

    Where both GEMMs take oneDNN's route at this row count (a widened bfloat16
    model's prefill chunks, on CPUs where it measured fastest), the gate/up
    product stays the bfloat16 oneDNN returns and SwiGLU writes the bfloat16
    the down GEMM would round its input to: the same numbers as the float32
    path, without widening 2 x inter values a row and rounding inter of them
    back. A 2,048-row MLP of the embedded model, in process on an AMD EPYC
    (Zen 5): 16.1 -> 14.0 ms (docs/optimization_log.md). Where both take the
    BF16 dot route, SwiGLU runs on the gate/up GEMM's tiles and hands the down
    GEMM bf16 rows (gemm_epilogues.swiglu_dot): the three ops' numbers, 1.09x
    at 2,048 rows there."""
    rows = x.shape[0]
    # Both GEMMs' routes at this row count, where the packed kernels run them.
    routes = (route(rows, gate_up_packed), route(rows, down_packed)) if linear_fn is linear else None
    if routes == ("onednn", "onednn") and fused_ops.available(x):
        gate_up = onednn_linear.linear(x, gate_up_packed.onednn, None, widen=False)
        act = fused_ops.silu_mul_bf16_io(gate_up)
        if act is not None:
            return onednn_linear.linear(act, down_packed.onednn, None)
        return onednn_linear.linear(swiglu(gate_up.float()), down_packed.onednn, None)
    if routes == ("dot", "dot") and (act := swiglu_dot(x, gate_up_packed)) is not None:
        # The dot route's GEMMs read bfloat16 rows: SwiGLU on the gate/up
        # product's tiles hands the down GEMM its input already rounded.
        return linear(act, down_weight, None, down_packed)
    return linear_fn(swiglu(linear_fn(x, gate_up_weight, None, gate_up_packed)), down_weight, None, down_packed)
