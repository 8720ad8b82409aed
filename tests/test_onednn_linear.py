"""oneDNN's bf16 GEMM for the larger row counts of a widened bfloat16 model
(CPUs with native bf16; this file forces it on any CPU, where oneDNN emulates
bf16: slower there, but the same arithmetic)."""

from __future__ import annotations

import pytest
import torch

from executor_svc import onednn_linear, packed_linear
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
