"""The packed kernel's bf16 dot-product GEMM over GGUF Q4_1 block panels
(native/q4_dot_gemm.h, route "gguf_dot"): activations rounded to bfloat16,
codes multiplied as the bfloat16 128 + q, each block's scale and offset
applied once. Checked against float64 over the same rounded activations and
the dequantised weights; the emulated build on every AVX-512 CPU, the
VDPBF16PS build where the CPU has AVX512-BF16."""

from __future__ import annotations

import pytest
import torch

from executor_svc import packed_linear
from executor_svc.bf16_gemm_routes import _random_gguf_rows
from executor_svc.packed_linear import BLOCK_FORMATS, PackedWeight, linear, pack_bf16, pack_blocks, route

pytestmark = pytest.mark.skipif(packed_linear.kernel() is None, reason="needs x86 AVX-512 and a C compiler")
NATIVE_DOT = packed_linear.kernel() is not None and packed_linear.kernel().bf16_dot_native
Q4_1 = BLOCK_FORMATS["Q4_1"][0]


def q4_1_rows(out_features: int, in_features: int, seed: int) -> torch.Tensor:
    """Random Q4_1 rows with scales and offsets that vary per block, as a
    real file's do (offsets negative, around -8 scales)."""
    gen = torch.Generator().manual_seed(seed)
    rows = _random_gguf_rows("Q4_1", out_features, in_features, gen)
    shape = rows.shape[:2]
    d = torch.rand(shape, generator=gen) * 0.02 + 1e-3
    m = -d * (6 + 4 * torch.rand(shape, generator=gen))
    for i, value in enumerate((d, m)):
        rows[..., 2 * i : 2 * i + 2] = value.half().view(torch.uint8).view(*shape, 2)
    return rows


def dequantised(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(weight [out, in], d, m [out, in / 32]) in float64, as ggml defines
    Q4_1: w = d q + m, k = j in byte j's low nibble and k = j + 16 in its high one."""
    d = rows[..., 0:2].contiguous().view(torch.float16).squeeze(-1).double()
    m = rows[..., 2:4].contiguous().view(torch.float16).squeeze(-1).double()
    q = rows[..., 4:]
    codes = torch.cat([q & 15, q >> 4], dim=-1).double()
    return (d[..., None] * codes + m[..., None]).reshape(rows.shape[0], -1), d, m


def call(x: torch.Tensor, blocks, bias=None, native: bool = False, threads: int = 2, fmt: int = Q4_1) -> tuple:
    """(status, out) of packed_gemm_quant_bf16_dot; `out` NaN where not written."""
    k = packed_linear.kernel()
    rows, n = x.shape[0], blocks.out_features
    out = torch.full((rows, n), float("nan"))
    status = k.gemm_quant_bf16_dot(
        out.data_ptr(), out.stride(0), x.data_ptr(), x.stride(0), blocks.data.data_ptr(), fmt,
        None if bias is None else bias.data_ptr(), rows, n, x.shape[1], int(native), threads,
    )  # fmt: skip
    return status, out


def error_bound(x: torch.Tensor, d: torch.Tensor, m: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """What float32 may add to the float64 product of bf16(x) and the
    dequantised weight: per block, the sum of (128 + q) x over 32 k
    (|.| <= 143 sum |x|), its scaling by d, and the offset (m - 128 d) times
    the block's sum, each a few roundings of at most 2^-24 of those
    magnitudes; then K/32 block terms added in turn."""
    blocks = x.shape[1] // 32
    xb = x.to(torch.bfloat16).double().abs().reshape(x.shape[0], blocks, 32).sum(-1)  # [M, blocks]
    per_block = xb @ (271 * d.abs() + m.abs()).T  # [M, out]
    total = per_block + (0 if bias is None else bias.double().abs())
    return (36 + blocks) * 2.0**-24 * total


@pytest.mark.parametrize(
    "rows,out_features,in_features",
    [
        (1, 48, 32),
        (2, 5, 64),
        (3, 50, 96),
        (4, 100, 576),
        (5, 960, 576),
        (9, 70, 1536),
        (17, 17, 64),
        (300, 49, 96),
        (100, 301, 1536),  # two chunks of rows (ROW_CHUNK_BYTES / (2 K) = 85), 7 panels
    ],
)
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize(
    "native", [False, pytest.param(True, marks=pytest.mark.skipif(not NATIVE_DOT, reason="needs AVX512-BF16"))]
)
def test_product_is_float64_over_rounded_activations_within_float32_error(
    rows, out_features, in_features, with_bias, native
):
    """Tiles of 1..4 rows and their remainders, one chunk of rows and two,
    partial last panels and column vectors, K from one block to 48."""
    raw = q4_1_rows(out_features, in_features, seed=rows + out_features)
    weight, d, m = dequantised(raw)
    gen = torch.Generator().manual_seed(in_features)
    x = torch.randn(rows, in_features, generator=gen)
    bias = torch.randn(out_features, generator=gen) if with_bias else None
    status, got = call(x, pack_blocks("Q4_1", raw), bias, native)
    assert status == 0
    want = x.to(torch.bfloat16).double() @ weight.T + (0 if bias is None else bias.double())
    assert ((got.double() - want).abs() <= error_bound(x, d, m, bias)).all()
    exact = x.double() @ weight.T + (0 if bias is None else bias.double())
    assert not torch.equal(got.double(), exact), "activations rounded to bfloat16 should show"


@pytest.mark.parametrize("rows", [11, 250])
def test_threads_and_row_strides_do_not_change_a_bit(rows):
    """Every output is one tile's whole sum over k: 1, 2 and 3 threads, and a
    strided view of the rows, give the same bits, in one chunk of rows or
    two (250 rows of K = 576: ROW_CHUNK_BYTES holds 227); nothing past N is
    written."""
    raw = q4_1_rows(200, 576, seed=1)
    blocks = pack_blocks("Q4_1", raw)
    wide = torch.randn(rows, 700)
    x = wide[:, :576]
    outs = [call(x.contiguous(), blocks, threads=t)[1] for t in (1, 2, 3)]
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    status, strided = call(x, blocks)
    assert status == 0 and torch.equal(strided, outs[0])
    k = packed_linear.kernel()
    out = torch.full((rows, 260), float("nan"))
    k.gemm_quant_bf16_dot(
        out.data_ptr(), 260, x.data_ptr(), x.stride(0), blocks.data.data_ptr(), Q4_1, None, rows, 200, 576, 0, 2
    )
    assert torch.equal(out[:, :200], outs[0]) and out[:, 200:].isnan().all()


def test_bad_formats_and_widths_are_refused_before_any_write():
    k = packed_linear.kernel()
    q8 = pack_blocks("Q8_0", _random_gguf_rows("Q8_0", 50, 64, torch.Generator().manual_seed(0)))
    x = torch.randn(2, 64)
    status, out = call(x, q8, fmt=BLOCK_FORMATS["Q8_0"][0])
    assert status == -3 and out.isnan().all()
    q4 = pack_blocks("Q4_1", q4_1_rows(50, 64, 0))
    out = torch.full((1, 50), float("nan"))
    # K not a multiple of 32.
    assert (
        k.gemm_quant_bf16_dot(out.data_ptr(), 50, x.data_ptr(), 48, q4.data.data_ptr(), Q4_1, None, 1, 50, 48, 0, 1)
        == -3
    )
    assert out.isnan().all()
    if not NATIVE_DOT:  # VDPBF16PS asked for where the CPU lacks it
        assert call(x, q4, native=True)[0] == -2


def test_route_reads_the_files_q4_1_blocks_and_falls_back_for_other_kinds():
    """gguf_dot takes a weight the file keeps in Q4_1 blocks; one in Q8_0 (a
    head) takes the float32 loop over its blocks, one without blocks its
    BF16 blocks. Through linear(), the Q4_1 route gives the kernel's product."""
    raw = q4_1_rows(96, 64, 2)
    weight = dequantised(raw)[0]
    bf16 = pack_bf16(weight.to(torch.bfloat16))
    routes = ((1, "gguf_dot"), (16, "dot"))
    q4 = PackedWeight(None, bf16, gguf=pack_blocks("Q4_1", raw), bf16_routes=routes)
    q8_rows = _random_gguf_rows("Q8_0", 96, 64, torch.Generator().manual_seed(3))
    q8 = PackedWeight(None, bf16, gguf=pack_blocks("Q8_0", q8_rows), bf16_routes=routes)
    none = PackedWeight(None, bf16, bf16_routes=routes)
    assert [route(r, q4) for r in (1, 15, 16)] == ["gguf_dot", "gguf_dot", "dot"]
    assert [route(r, q8) for r in (1, 15, 16)] == ["gguf", "gguf", "dot"]
    assert route(1, none) == "blocks"
    x = torch.randn(3, 64)
    got = linear(x, weight.to(torch.bfloat16), None, q4)
    assert torch.equal(got, call(x, q4.gguf, native=NATIVE_DOT)[1])
