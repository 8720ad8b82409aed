"""The fused native RMSNorm and rotary embedding (executor_svc/fused_ops.py)
against the model's plain-torch versions, computed in float64."""
from __future__ import annotations

import pytest
import torch

from executor_svc import fused_ops

pytestmark = pytest.mark.skipif(not fused_ops.available(torch.empty(0)), reason="needs a C compiler")


def reference_rms_norm(x, w, eps):
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.double()


def reference_rope(x, cos, sin_signed):
    half = x.shape[-1] // 2
    x = x.double()
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    return x * cos.double().unsqueeze(1) + swapped * sin_signed.double().unsqueeze(1)


@pytest.mark.parametrize("rows", [1, 3, 17, 300])
@pytest.mark.parametrize("dim", [64, 576, 1000])
def test_rms_norm_matches_reference(rows, dim):
    gen = torch.Generator().manual_seed(rows + dim)
    x, w = torch.randn(rows, dim, generator=gen) * 3, torch.randn(dim, generator=gen)
    got = fused_ops.rms_norm(x, w, 1e-5)
    torch.testing.assert_close(got.double(), reference_rms_norm(x, w, 1e-5), rtol=1e-5, atol=1e-5)


def test_rms_norm_reads_row_strided_input():
    gen = torch.Generator().manual_seed(0)
    wide, w = torch.randn(9, 80, generator=gen), torch.randn(64, generator=gen)
    torch.testing.assert_close(fused_ops.rms_norm(wide[:, :64], w, 1e-6).double(),
                               reference_rms_norm(wide[:, :64], w, 1e-6), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tokens,heads,dim", [(1, 1, 64), (7, 12, 64), (40, 3, 128), (5, 2, 10)])
def test_rope_in_place_on_a_fused_qkv_view(tokens, heads, dim):
    """Rotates only the q/k heads of a [q | k | v] row, in place; v stays untouched."""
    gen = torch.Generator().manual_seed(tokens * heads)
    qkv = torch.randn(tokens, heads + 2, dim, generator=gen)
    before = qkv.clone()
    angles = torch.rand(tokens, dim // 2, generator=gen) * 6
    cos = torch.cat((angles.cos(), angles.cos()), dim=-1)
    sin_signed = torch.cat((-angles.sin(), angles.sin()), dim=-1)
    out = fused_ops.rope_(qkv[:, :heads], cos, sin_signed)
    assert out.data_ptr() == qkv.data_ptr()
    torch.testing.assert_close(qkv[:, :heads].double(), reference_rope(before[:, :heads], cos, sin_signed),
                               rtol=1e-6, atol=1e-6)
    assert torch.equal(qkv[:, heads:], before[:, heads:])


def test_available_only_for_float32_cpu():
    assert fused_ops.available(torch.zeros(2))
    assert not fused_ops.available(torch.zeros(2, dtype=torch.bfloat16))
