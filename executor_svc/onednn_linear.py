"""bfloat16 linear layers through oneDNN, for the larger row counts on CPUs
with native bf16 arithmetic (AVX512-BF16 or AMX).

On such CPUs a bfloat16 model still runs in float32 arithmetic over its
bfloat16 weights (weight_packing.widen_bf16: the native fused ops and attention
kernels, and the packed kernel reading bfloat16 blocks, which is bound by the
weight read at decode sizes). Past some number of rows the GEMM turns
compute-bound, and there the CPU's bf16 FMA/AMX units beat float32 FMAs by
about 2.4x (the issue-18 machine: 408 vs 172 GFLOP/s measured ceilings). So
each weight is also reordered once, at load, into oneDNN's blocked layout
(what vLLM's CPU back end does), and the row counts measured faster go there:
activations rounded to bfloat16, products summed in float32 by oneDNN, the
sum rounded to bfloat16 (oneDNN's output takes the input's dtype, and CPU
torch has no bf16 x bf16 -> float32 GEMM; torch's own bf16 models round every
activation so) and widened back to float32.

Which row counts go here depends on the CPU (AVX512-BF16 or AMX, cores,
caches), so it is measured at start-up (bf16_gemm_routes.py) rather than
written down here. CPUs that emulate bf16 never use it.
"""

from __future__ import annotations

import torch


def available() -> bool:
    """oneDNN's packed linear is built into this torch and takes bfloat16."""
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


def pack(weight: torch.Tensor) -> torch.Tensor:
    """A bfloat16 CPU [out, in] weight in oneDNN's blocked layout (an opaque
    mkldnn tensor holding as many bytes as the weight)."""
    assert weight.dtype == torch.bfloat16 and weight.device.type == "cpu", (
        f"oneDNN packing takes bfloat16 CPU weights, got {weight.dtype} on {weight.device}"
    )
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, widen: bool = True) -> torch.Tensor:
    """x [M, in] (float32, or bfloat16 already rounded) @ W.T (+ float32 bias)
    -> float32 [M, out], the products in bfloat16 with float32 sums; with
    `widen` False (no bias) the bfloat16 [M, out] oneDNN returns, the same
    values before their exact widening."""
    out = torch.ops.mkldnn._linear_pointwise(x.to(torch.bfloat16), packed, None, "none", [], "")
    if not widen:
        assert bias is None, "a bias is added in float32, after widening"
        return out
    out = out.float()
    if bias is not None:
        out += bias
    return out
