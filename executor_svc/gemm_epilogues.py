"""The bf16 dot GEMM with work done on its tiles while they are in registers
or L1, for callers that need less than its float32 product
(native/bf16_dot_gemm.h):

    swiglu_dot   the gate/up GEMM -> silu(g) * u rounded to bfloat16, the
                 down GEMM's input (layer_ops.mlp; the decoder stack calls
                 its kernel too, decoder_stack.c)
    argmax_dot   the LM head -> each row's argmax, the greedy sampler's
                 answer (LlamaForCausalLM.greedy_tokens)

Each gives what the unfused ops give over packed_linear.linear's "dot"
route, bit for bit, and None where it does not apply, so that its caller
runs those ops instead.
"""

from __future__ import annotations

import torch

from executor_svc import packed_linear
from executor_svc.packed_linear import PackedWeight


def swiglu_dot(x: torch.Tensor, packed: PackedWeight) -> torch.Tensor | None:
    """silu(g) * u rounded to bfloat16 [M, I], [g | u] = x [M, in] rounded to
    bfloat16 @ the gate/up weight's BF16 blocks: what the "dot" route's GEMM,
    swiglu and the down GEMM's rounding of its input give, bit for bit (a NaN
    stays NaN, its bit pattern aside), in one native pass that never writes
    the float32 [M, 2 I] product (bf16_dot_gemm.h); None where the kernel has
    no such pass (no AVX-512BW, or an I that is not a whole number of panels)."""
    blocks = packed.blocks
    assert blocks is not None and blocks.kind == "BF16", "swiglu_dot reads a gate/up weight's BF16 blocks"
    assert x.dim() == 2 and x.shape[1] == blocks.in_features, f"swiglu_dot: input {tuple(x.shape)}"
    k = packed_linear.kernel()
    inter = blocks.out_features // 2
    if inter % k.panel_width:  # gate panel p pairs with up panel p + inter / width: most models' sizes are not
        return None
    xb = x.to(torch.bfloat16).contiguous()
    out = torch.empty(x.shape[0], inter, dtype=torch.bfloat16)
    status = k.gemm_bf16_dot_swiglu(
        out.data_ptr(),
        out.stride(0),
        xb.data_ptr(),
        xb.stride(0),
        blocks.data.data_ptr(),
        x.shape[0],
        inter,
        blocks.in_features,
        int(k.bf16_dot_native),
        torch.get_num_threads(),
        None,  # nothing to warm (the decoder stack's spans: decoder_stack.c)
        0,
        0,
    )
    if status in (-1, -3):
        return None
    assert status == 0, f"packed_gemm_bf16_dot_swiglu returned {status} for {inter} x {blocks.in_features}"
    return out


def argmax_dot(x: torch.Tensor, bias: torch.Tensor | None, packed: PackedWeight | None) -> torch.Tensor | None:
    """int64 [M]: each row's first largest index (or first NaN's) in
    linear(x, weight, bias, packed), where that takes the "dot" route: the
    logits' argmax bit for bit, in one native pass that never writes the
    float32 [M, out] product (bf16_dot_gemm.h: argmax). None where `linear`
    would take another route, so the caller computes the logits."""
    if packed_linear.route(x.shape[0], packed) != "dot":
        return None
    blocks = packed.blocks
    assert blocks is not None and blocks.kind == "BF16", "the dot route reads BF16 blocks"
    assert x.dim() == 2 and x.shape[1] == blocks.in_features, f"argmax_dot: input {tuple(x.shape)}"
    assert bias is None or (
        bias.is_contiguous() and bias.dtype == torch.float32 and bias.shape == (blocks.out_features,)
    )
    k = packed_linear.kernel()
    xb = x.to(torch.bfloat16).contiguous()
    out = torch.empty(x.shape[0], dtype=torch.int64)
    status = k.gemm_bf16_dot_argmax(
        out.data_ptr(),
        xb.data_ptr(),
        xb.stride(0),
        blocks.data.data_ptr(),
        None if bias is None else bias.data_ptr(),
        x.shape[0],
        blocks.out_features,
        blocks.in_features,
        int(k.bf16_dot_native),
        torch.get_num_threads(),
    )
    if status == -5:
        raise MemoryError(f"packed_gemm_bf16_dot_argmax could not allocate its threads' bests for {x.shape[0]} rows")
    assert status == 0, f"packed_gemm_bf16_dot_argmax returned {status} for {blocks.out_features}x{blocks.in_features}"
    return out
