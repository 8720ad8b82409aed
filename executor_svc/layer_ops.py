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

from executor_svc import fused_ops
from executor_svc.packed_linear import linear


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
