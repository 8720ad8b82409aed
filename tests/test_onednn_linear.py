"""oneDNN's bf16 GEMM for the larger row counts of a widened bfloat16 model
(CPUs with native bf16; this file forces it on any CPU, where oneDNN emulates
bf16: slower there, but the same arithmetic)."""

from __future__ import annotations

import pytest
import torch

from executor_svc import layer_ops, onednn_linear, packed_linear
from executor_svc.packed_linear import PackedWeight, linear, pack_bf16, route

pytestmark = [
    pytest.mark.skipif(packed_linear.kernel() is None, reason="needs x86 AVX-512 and a C compiler"),
    pytest.mark.skipif(not onednn_linear.available(), reason="this torch has no oneDNN packed linear"),
]


def bf16_weight(out_features: int, in_features: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(out_features, in_features, generator=gen) / in_features**0.5).to(torch.bfloat16)


def test_route_sends_the_measured_rows_to_onednn():
    w = bf16_weight(96, 64, 0)
    plain = PackedWeight(None, pack_bf16(w))
    hybrid = PackedWeight(None, pack_bf16(w), onednn_linear.pack(w), bf16_routes=((1, "blocks"), (16, "onednn")))
    assert [route(rows, hybrid) for rows in (1, 15, 16, 600)] == ["blocks", "blocks", "onednn", "onednn"]
    assert [route(rows, plain) for rows in (1, 16, packed_linear.BF16_MAX_ROWS + 1)] == ["blocks", "blocks", "torch"]


@pytest.mark.parametrize("rows", [16, 64, 300])
def test_onednn_rows_match_float64_within_bf16_activation_rounding(rows):
    """The products are of bfloat16 activations, each x off by at most 2^-9
    relative, summed in float32, and oneDNN returns the sum rounded to
    bfloat16 (2^-9 relative again): |error| <= 2^-9 * (sum_k |x_k w_k| + |y|)."""
    w = bf16_weight(200, 128, 1)
    bias = torch.randn(200)
    packed = PackedWeight(None, pack_bf16(w), onednn_linear.pack(w), bf16_routes=((1, "onednn"),))
    x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(rows))
    got = linear(x, w, bias, packed)
    assert got.dtype == torch.float32 and got.shape == (rows, 200)
    exact = x.double() @ w.double().T + bias.double()
    bound = 2.0**-9 * 1.01 * (x.double().abs() @ w.double().abs().T + (exact - bias.double()).abs()) + 1e-5
    assert ((got.double() - exact).abs() <= bound).all()
    # The float32 kernel over the same bfloat16 weights is closer still: oneDNN
    # rounds the activations, so the two differ, by no more than the bound.
    blocks = linear(x, w, bias, PackedWeight(None, pack_bf16(w)))
    assert ((got.double() - blocks.double()).abs() <= 2 * bound).all()


@pytest.mark.parametrize(("gate_up_routes", "rows"), [(((1, "onednn"),), 40), (((1, "blocks"), (32, "onednn")), 16)])
def test_an_mlp_whose_gemms_both_take_onednn_keeps_its_gate_up_bf16_with_the_same_result(
    gate_up_routes, rows, monkeypatch
):
    """layer_ops.mlp: where both routes are oneDNN's, the bf16 chain (gate/up
    product unwidened, SwiGLU rounding for the down GEMM) gives the float32
    path's numbers bit for bit; elsewhere (16 rows below the gate/up's oneDNN
    route) it is the float32 path itself."""
    hidden, inter = 96, 160
    w_gu, w_down = bf16_weight(2 * inter, hidden, 3), bf16_weight(hidden, inter, 4)
    gate_up = PackedWeight(None, pack_bf16(w_gu), onednn_linear.pack(w_gu), bf16_routes=gate_up_routes)
    down = PackedWeight(None, pack_bf16(w_down), onednn_linear.pack(w_down), bf16_routes=((1, "onednn"),))
    x = torch.randn(rows, hidden, generator=torch.Generator().manual_seed(5)) * 2
    chained = []
    bf16_swiglu = layer_ops.fused_ops.silu_mul_bf16_io
    monkeypatch.setattr(layer_ops.fused_ops, "silu_mul_bf16_io", lambda gu: chained.append(1) or bf16_swiglu(gu))
    got = layer_ops.mlp(x, w_gu, w_down, gate_up, down)
    assert len(chained) == (rows == 40)  # the chain where both routes are oneDNN's, only there
    plain = linear(layer_ops.swiglu(linear(x, w_gu, None, gate_up)), w_down, None, down)
    assert got.dtype == torch.float32 and torch.equal(got, plain)
    # The chain (or not) is the one its routes say: a chain-free kernel set gives the same.
    assert torch.equal(layer_ops.mlp(x, w_gu, w_down, gate_up, down, lambda *a: linear(*a)), plain)
