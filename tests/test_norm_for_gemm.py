"""RMSNorm rounding its output to bfloat16 as it writes it, for a GEMM on the
BF16 dot route (fused_ops.add_rms_norm_bf16_out, layer_ops.norm_for_gemm):
the float32 norm's values rounded as torch rounds them, bit for bit, the
residual add in place as before; taken only where the consuming GEMM is on
that route and the layer runs the default kernels."""

from __future__ import annotations

import pytest
import torch

from executor_svc import fused_ops, layer_ops, packed_linear
from executor_svc.layer_ops import Kernels, norm_for_gemm
from executor_svc.packed_linear import PackedWeight, pack_bf16

pytestmark = pytest.mark.skipif(
    packed_linear.kernel() is None or fused_ops._lib() is None, reason="needs x86 AVX-512 and a C compiler"
)


def bits(x: torch.Tensor) -> torch.Tensor:
    """bf16 bits with every NaN as one pattern (bf16.h writes 0x7FC0, torch its own)."""
    return x.nan_to_num(nan=7.0).view(torch.int16)


@pytest.mark.parametrize("rows,dim", [(1, 576), (7, 100), (64, 576), (300, 960), (3, 17), (9, 2048)])
@pytest.mark.parametrize("with_delta", [False, True], ids=["norm", "add-norm"])
def test_the_bf16_out_norm_is_the_float32_norm_rounded(rows, dim, with_delta):
    gen = torch.Generator().manual_seed(rows * dim)
    h = torch.randn(rows, dim, generator=gen) * 3
    h[0, :5] = torch.tensor([1e30, -1e-30, 0.0, -0.0, 65504.0])[: min(5, dim)]
    if rows > 2:
        h[2, 1] = float("nan")
    delta = torch.randn(rows, dim, generator=gen) if with_delta else None
    w = torch.randn(dim, generator=gen)
    h_ref, h_got = h.clone(), h.clone()
    if delta is None:
        want = fused_ops.rms_norm(h_ref, w, 1e-5).to(torch.bfloat16)
    else:
        want = fused_ops.add_rms_norm(h_ref, delta, w, 1e-5).to(torch.bfloat16)
    got = fused_ops.add_rms_norm_bf16_out(h_got, delta, w, 1e-5)
    assert got.dtype == torch.bfloat16 and torch.equal(bits(got), bits(want))
    assert torch.equal(h_got.nan_to_num(), h_ref.nan_to_num()), "the residual add must be the same, in place"
    assert rows <= 2 or got[2].isnan().all()


@pytest.mark.parametrize("routes,rounded", [(((1, "dot"),), True), (((1, "blocks"),), False), (None, False)])
def test_only_a_dot_routed_gemm_gets_rounded_rows(routes, rounded):
    dim = 64
    gemm = (
        None
        if routes is None
        else PackedWeight(None, pack_bf16(torch.randn(96, dim).to(torch.bfloat16)), bf16_routes=routes)
    )
    h, delta, w = torch.randn(40, dim), torch.randn(40, dim), torch.randn(dim)
    want = layer_ops.add_rms_norm(h.clone(), delta, w, 1e-6)
    x = norm_for_gemm(Kernels(), h, delta, w, 1e-6, gemm)
    assert (x.dtype == torch.bfloat16) == rounded
    assert torch.equal(x, want.to(x.dtype))


def test_swapped_kernels_keep_their_own_norm():
    """A layer whose kernels were swapped (tensor parallelism, tests) runs them, float32 out."""
    dim = 64
    gemm = PackedWeight(None, pack_bf16(torch.randn(96, dim).to(torch.bfloat16)), bf16_routes=((1, "dot"),))
    calls = []
    ops = Kernels(add_rms_norm=lambda *a: calls.append(1) or layer_ops.add_rms_norm(*a))
    x = norm_for_gemm(ops, torch.randn(40, dim), None, torch.randn(dim), 1e-6, gemm)
    assert calls == [1] and x.dtype == torch.float32
