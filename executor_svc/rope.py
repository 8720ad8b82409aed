"""Rotary position embedding (RoPE) as transformers' Llama computes it, with its
linear and Llama 3.1 frequency scaling.

The tables are computed once per model in float32 and cast to the model's
dtype; the rotation uses the "rotate_half" layout, natively in place on CPU
(fused_ops.rope_) and as a torch expression elsewhere, rounding alike.
"""

from __future__ import annotations

import math

import torch

from executor_svc import fused_ops
from executor_svc.model_config import ModelConfig


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Per-pair inverse frequencies [head_dim // 2], float32, as transformers computes them."""
    dim = config.head_dim
    exponent = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
    inv_freq = 1.0 / (config.rope_theta**exponent)
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling["rope_type"] == "linear":
        return inv_freq / scaling["factor"]
    assert scaling["rope_type"] == "llama3", f"ModelConfig let through rope type {scaling['rope_type']!r}"
    # Llama 3.1: keep high frequencies, divide low ones by `factor`, blend in between.
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
    return torch.where(is_medium, blended, scaled)


def rope_cache(config: ModelConfig, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed sin tables [max_position_embeddings, head_dim].

    With x = [x1 | x2] (halves), rotate_half(x) = [-x2 | x1]. We store
    sin_signed = [-sin | sin] so rope is x * cos + swap_halves(x) * sin_signed,
    which rounds exactly like HF's x * cos + rotate_half(x) * sin.
    """
    inv_freq = rope_inv_freq(config)
    positions = torch.arange(config.max_position_embeddings, dtype=torch.int64).to(torch.float32)
    freqs = positions[:, None] * inv_freq[None, :]
    cos, sin = freqs.cos(), freqs.sin()
    cos_full = torch.cat((cos, cos), dim=-1)
    sin_signed = torch.cat((-sin, sin), dim=-1)
    return cos_full.to(device=device, dtype=dtype), sin_signed.to(device=device, dtype=dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] (may be a strided view); cos/sin_signed [T, D].

    On float32 or bfloat16 CPU tensors x is rotated in place (one native
    pass) and returned; elsewhere a rotated copy is returned."""
    if fused_ops.available(x, cos, sin_signed):
        return fused_ops.rope_(x, cos, sin_signed)
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    return x * cos.unsqueeze(1) + swapped * sin_signed.unsqueeze(1)
