"""The bytes a forward step must read from memory: the linear weights in the
representation the engine reads at that row count, and the KV cache.

Each linear weight of a layer multiplies the step's `tokens` rows; the LM head
only the `sampled` ones (one per decode, one per prefill request), as in
LlamaForCausalLM.compute_logits. `packed_linear.route(rows, packed)` names the
GEMM that takes them, and so what it streams:

    panels          the float32 panels (padded to whole panels, as read)
    blocks, dot     the BF16 (or GGUF, beside float32 panels) block panels
    gguf            the file's Q4_1/Q8_0 block panels kept beside BF16 ones
    int8            either's Q4_1/Q8_0 blocks, with int8 activations
    onednn          oneDNN's reordered copy: as many bytes as the bf16 weight
    torch           the weight tensor itself, in its dtype (MKL; a bfloat16
                    weight widened per call is counted once, at 2 bytes)

The embedding lookup (a few rows), the norms and biases (vectors) are left
out: SmolLM2-135M's norms are 0.03% of its linear weights.

KV: attention reads, per layer, K and V of every token of every request (its
context, the new tokens included) in the cache's dtype; a prefill's causal
attention reads the same tokens, more than once but from cache.
"""

from __future__ import annotations

from collections import Counter

import torch

from executor_svc.kv_cache import bytes_per_block
from executor_svc.model import LINEAR_PARTS, LlamaForCausalLM
from executor_svc.model_config import ModelConfig
from executor_svc.packed_linear import PackedWeight, route


def tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def representation_bytes(how: str, weight: torch.Tensor, packed: PackedWeight | None) -> int:
    """Bytes of the copy of `weight` that the GEMM `how` (a route() answer) reads."""
    if how == "panels":
        return tensor_bytes(packed.panels)
    if how in ("blocks", "dot"):
        return packed.blocks.nbytes
    if how in ("gguf", "gguf_dot"):
        return packed.gguf.nbytes
    if how == "int8":
        return packed.gguf_blocks.nbytes
    if how in ("onednn", "torch"):  # oneDNN's blocked copy holds the bf16 weight's bytes in another order
        return tensor_bytes(weight)
    raise AssertionError(f"no byte count for route {how!r}")


def linear_weights(model: LlamaForCausalLM) -> list[tuple[torch.Tensor, PackedWeight | None, bool]]:
    """(weight, its packed copies or None, whether it is the LM head) for every linear of a step."""
    out = [
        (getattr(layer, f"{name}_weight"), layer.packed.get(name), False)
        for layer in model.layers
        for name in LINEAR_PARTS
    ]
    head = model.lm_head if model.lm_head is not None else model._tied_head
    out.append((model.embed_tokens if head is None else head, model._head_packed, True))
    return out


def weight_read_bytes(model: LlamaForCausalLM, tokens: int, sampled: int) -> dict[str, int]:
    """Bytes of linear weights a step of `tokens` rows reading `sampled` logits streams, by route."""
    by_route: Counter[str] = Counter()
    for weight, packed, is_head in linear_weights(model):
        how = route(sampled if is_head else tokens, packed)
        by_route[how] += representation_bytes(how, weight, packed)
    return dict(by_route)


def kv_read_bytes(cfg: ModelConfig, kv_dtype: torch.dtype, batch: int, context: int) -> int:
    """K and V bytes of `batch` requests of `context` tokens each, over every layer."""
    return batch * context * bytes_per_block(cfg, 1, kv_dtype)
