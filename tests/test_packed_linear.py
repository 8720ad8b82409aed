"""The native packed GEMM (executor_svc/packed_linear.py) against a float64 reference,
and its GGUF block path against its float32 path, bit for bit."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from executor_svc import onednn_linear, packed_linear
from executor_svc.packed_linear import (
    BLOCK_FORMATS,
    BLOCKS_MAX_ROWS,
    PACKED_MAX_ROWS,
    PACKED_MIN_ROWS,
    PackedWeight,
    linear,
    pack,
    pack_bf16,
    pack_blocks,
    route,
)

pytestmark = pytest.mark.skipif(packed_linear.kernel() is None, reason="needs x86 AVX-512 and a C compiler")

# (out, in): a single partial panel, a partial last panel, SmolLM2's qkv, a long odd K.
SHAPES = [(5, 1), (50, 64), (960, 576), (1000, 1537)]


def reference(x, w, bias):
    out = x.double() @ w.double().t()
    return out if bias is None else out + bias.double()


def assert_close(got: torch.Tensor, want: torch.Tensor, k: int) -> None:
    # float32 sums of k products of N(0,1) values: errors grow like sqrt(k).
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=0, atol=2e-5 * k**0.5 * 4)


@pytest.mark.parametrize("rows", [2, 7, 8, 9, 64, 100, PACKED_MAX_ROWS - 1, PACKED_MAX_ROWS])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_kernel_matches_reference(rows, shape, with_bias):
    gen = torch.Generator().manual_seed(rows * 7 + shape[0])
    n, k = shape
    w, x = torch.randn(n, k, generator=gen), torch.randn(rows, k, generator=gen)
    bias = torch.randn(n, generator=gen) if with_bias else None
    assert_close(linear(x, w, bias, PackedWeight(pack(w))), reference(x, w, bias), k)


@pytest.mark.parametrize("n,k,m,ldc", [(50, 64, 11, 53), (1000, 64, 1100, 1003)])
def test_kernel_writes_exactly_its_outputs(n, k, m, ldc):
    """Into a poisoned output with a wider row stride: every [M, N] element is
    written, nothing past N is (the last panel's masked stores); the second
    shape's C (4.4 MB) is past PREFETCH_OUT_MIN_BYTES, where tiles also
    prefetch their next output lines."""
    gen = torch.Generator().manual_seed(0)
    w, x, bias = torch.randn(n, k, generator=gen), torch.randn(m, k, generator=gen), torch.randn(n, generator=gen)
    out = torch.full((m, ldc), float("nan"))
    kern, panels = packed_linear.kernel(), pack(w)  # held: a temporary's data_ptr() dangles once it is freed
    assert kern.gemm(out.data_ptr(), ldc, x.data_ptr(), k, panels.data_ptr(), bias.data_ptr(), m, n, k, 2) == 0
    assert_close(out[:, :n], reference(x, w, bias), k)
    assert out[:, n:].isnan().all()


def test_kernel_over_several_row_chunks():
    """Called directly past linear()'s range: 600 rows are three 256-row chunks
    (the last partial), shared out between the threads with the panels."""
    n, k, m = 200, 96, 600
    gen = torch.Generator().manual_seed(2)
    w, x = torch.randn(n, k, generator=gen), torch.randn(m, k, generator=gen)
    out, panels = torch.full((m, n), float("nan")), pack(w)
    assert packed_linear.kernel().gemm(out.data_ptr(), n, x.data_ptr(), k, panels.data_ptr(), None, m, n, k, 2) == 0
    assert_close(out, reference(x, w, None), k)


def test_strided_inputs():
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(96, 40, generator=gen)
    wide = torch.randn(16, 47, generator=gen)
    rows_strided = wide[:, :40]  # row stride 47: passed to the kernel as its lda
    cols_strided = torch.randn(16, 80, generator=gen)[:, ::2]  # copied first
    for x in (rows_strided, cols_strided):
        assert_close(linear(x, w, None, PackedWeight(pack(w))), reference(x, w, None), 40)


def test_packed_layout():
    w = torch.arange(50 * 3, dtype=torch.float32).view(50, 3)
    panels = pack(w)
    width = packed_linear.kernel().panel_width
    assert panels.shape == (-(-50 // width), 3, width) and panels.is_contiguous()
    assert panels[0, 2, 5] == w[5, 2] and panels[1, 1, 50 - width - 1] == w[49, 1]
    assert (panels[1, :, 50 - width :] == 0).all()


@pytest.mark.parametrize("rows", [0, 1, PACKED_MAX_ROWS + 1, 300])
def test_rows_outside_the_packed_range_go_to_torch(rows):
    """One row and large batches are as fast or faster through MKL: same result as F.linear, bit for bit."""
    w, x = torch.randn(60, 32), torch.randn(rows, 32)
    assert PACKED_MIN_ROWS == 2
    assert torch.equal(linear(x, w, None, PackedWeight(pack(w))), F.linear(x, w))


def test_empty_panels_mean_plain_linear():
    w, x, b = torch.randn(8, 4), torch.randn(5, 4), torch.randn(8)
    assert torch.equal(linear(x, w, b), F.linear(x, w, b))


def test_cpu_gemm_setting_resolves(monkeypatch):
    from executor_svc import machine
    from executor_svc.config import parse_config
    from executor_svc.machine import use_packed_gemm

    cpu = torch.device("cpu")
    assert use_packed_gemm("auto", cpu, torch.float32) and use_packed_gemm("native", cpu, torch.float32)
    assert not use_packed_gemm("torch", cpu, torch.float32)
    assert not use_packed_gemm("auto", torch.device("cuda"), torch.float32)
    # bfloat16: the kernel's float32 arithmetic on every CPU; where the CPU has
    # bf16 of its own, auto also measures which GEMM takes each row count.
    for fast in (False, True):
        monkeypatch.setattr(machine, "cpu_has_fast_bf16", lambda fast=fast: fast)
        assert use_packed_gemm("auto", cpu, torch.bfloat16)
        assert use_packed_gemm("native", cpu, torch.bfloat16) and not use_packed_gemm("torch", cpu, torch.bfloat16)
        bf16_gemm = packed_linear.kernel().bf16_dot_native or onednn_linear.available()
        assert machine.measure_bf16_routes("auto", True, torch.bfloat16) is (fast and bf16_gemm)
        assert not machine.measure_bf16_routes("native", True, torch.bfloat16)
        assert not machine.measure_bf16_routes("auto", True, torch.float32)
        assert not machine.measure_bf16_routes("auto", True, torch.bfloat16, deterministic=True)
    monkeypatch.setattr(packed_linear, "kernel", lambda: None)
    assert not use_packed_gemm("auto", cpu, torch.float32)
    with pytest.raises(ValueError, match="--cpu-gemm native needs an x86 CPU with AVX-512"):
        use_packed_gemm("native", cpu, torch.float32)
    monkeypatch.undo()
    assert parse_config(["--cpu-gemm", "torch"], environ={}).cpu_gemm == "torch"
    with pytest.raises(SystemExit):
        parse_config(["--cpu-gemm", "blas"], environ={})


# --- GGUF block panels -------------------------------------------------------


def quantized(kind: str, n: int, k: int, seed: int):
    """(float32 weight as the loader dequantizes it, its GGUF rows [n, k/32, block bytes])."""
    w = np.random.default_rng(seed).standard_normal((n, k), dtype=np.float32)
    qtype = gguf.GGMLQuantizationType[kind]
    raw = gguf.quants.quantize(w, qtype)
    weight = torch.from_numpy(np.array(gguf.quants.dequantize(raw, qtype)))
    return weight, torch.from_numpy(raw.reshape(n, k // 32, BLOCK_FORMATS[kind][1]).copy())


def float32_panels(x, weight, bias):
    """The float32 panel kernel at any row count (linear() would send 1 row to MKL)."""
    n, k = weight.shape
    out, panels = torch.empty(x.shape[0], n), pack(weight)  # held until the call returns
    assert (
        packed_linear.kernel().gemm(
            out.data_ptr(),
            n,
            x.data_ptr(),
            k,
            panels.data_ptr(),
            None if bias is None else bias.data_ptr(),
            x.shape[0],
            n,
            k,
            2,
        )
        == 0
    )
    return out


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
@pytest.mark.parametrize("shape", [(5, 32), (50, 64), (960, 576), (100, 1536)])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 7, 8, 9, BLOCKS_MAX_ROWS])
def test_block_panels_give_the_float32_result_bit_for_bit(kind, shape, rows):
    """The kernel expands each block to exactly the loader's float32 weights
    and keeps the float32 path's order of FMAs (partial sums stored and
    reloaded between slices of k), so the two agree in every bit."""
    n, k = shape
    weight, raw = quantized(kind, n, k, seed=rows + n)
    gen = torch.Generator().manual_seed(n * rows)
    x, bias = torch.randn(rows, k, generator=gen), torch.randn(n, generator=gen)
    packed = PackedWeight(pack(weight), pack_blocks(kind, raw))
    assert route(rows, packed) == "blocks"
    for b in (None, bias):
        got = linear(x, weight, b, packed)
        assert torch.equal(got, float32_panels(x, weight, b))
        assert_close(got, reference(x, weight, b), k)


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
def test_block_kernel_writes_exactly_its_outputs_over_several_chunks(kind):
    """Called directly: 600 rows are three row chunks; C has a wider row
    stride than N, poisoned, and only the [M, N] part may be written."""
    n, k, m, ldc = 53, 96, 600, 61
    weight, raw = quantized(kind, n, k, seed=3)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(4))
    out = torch.full((m, ldc), float("nan"))
    blocks = pack_blocks(kind, raw)
    assert (
        packed_linear.kernel().gemm_blocks(
            out.data_ptr(), ldc, x.data_ptr(), k, blocks.data.data_ptr(), BLOCK_FORMATS[kind][0], None, m, n, k, 2
        )
        == 0
    )
    assert torch.equal(out[:, :n], float32_panels(x, weight, None))
    assert out[:, n:].isnan().all()


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0", "BF16"])
@pytest.mark.parametrize("rows", range(1, 9))
def test_few_row_block_kernel_gives_the_float32_result_bit_for_bit(kind, rows):
    """1..FUSED_MAX_ROWS rows (fused_blocks.h) widen each block in registers,
    more rows through the float32 buffer: both must be the float32 panels'
    FMA chain bit for bit (the BF16 pair's even k first, Q4_1's low nibbles
    before the high ones). N = 100 ends in a partial panel; K = 160 is five
    blocks over three KC slices; A and C have row strides wider than K and N,
    and C's padding must stay untouched."""
    n, k, lda, ldc = 100, 160, 167, 103
    gen = torch.Generator().manual_seed(rows)
    if kind == "BF16":
        bf16 = torch.randn(n, k, generator=gen).to(torch.bfloat16)
        weight, blocks = bf16.float(), pack_bf16(bf16)
    else:
        weight, raw = quantized(kind, n, k, seed=rows)
        blocks = pack_blocks(kind, raw)
    x_wide, bias = torch.randn(rows, lda, generator=gen), torch.randn(n, generator=gen)
    x = x_wide[:, :k]
    for b in (None, bias):
        out = torch.full((rows, ldc), float("nan"))
        assert (
            packed_linear.kernel().gemm_blocks(
                out.data_ptr(),
                ldc,
                x_wide.data_ptr(),
                lda,
                blocks.data.data_ptr(),
                BLOCK_FORMATS[kind][0],
                None if b is None else b.data_ptr(),
                rows,
                n,
                k,
                2,
            )
            == 0
        )
        assert torch.equal(out[:, :n], float32_panels(x.contiguous(), weight, b))
        assert out[:, n:].isnan().all()


def test_block_kernel_rejects_what_it_cannot_read():
    out, x, data = torch.empty(1, 48), torch.empty(1, 40), torch.zeros(1, 2, 960, dtype=torch.uint8)
    kern = packed_linear.kernel()
    assert (
        kern.gemm_blocks(out.data_ptr(), 48, x.data_ptr(), 40, data.data_ptr(), 1, None, 1, 48, 40, 2) == -3
    )  # K % 32
    assert (
        kern.gemm_blocks(out.data_ptr(), 48, x.data_ptr(), 64, data.data_ptr(), 7, None, 1, 48, 64, 2) == -3
    )  # format
    assert kern.gemm_blocks(out.data_ptr(), 48, x.data_ptr(), 64, data.data_ptr(), 1, None, 1, 48, 0, 2) == -3  # K == 0


def test_block_panel_layout():
    """One block of one panel: the 48 columns' scales, then (Q4_1) minimums,
    then the codes in groups of 4 bytes per column; columns past `out` are zero."""
    _, raw = quantized("Q4_1", 50, 64, seed=0)
    blocks = pack_blocks("Q4_1", raw)
    width = packed_linear.kernel().panel_width
    assert blocks.data.shape == (2, 2, 960) and (blocks.out_features, blocks.in_features) == (50, 64)
    row, block = 49, 1  # the last real column: panel 1, column 1
    cell = blocks.data[row // width, block]
    col = row % width
    assert bytes(cell[2 * col : 2 * col + 2]) == bytes(raw[row, block, 0:2])  # d
    assert bytes(cell[96 + 2 * col : 96 + 2 * col + 2]) == bytes(raw[row, block, 2:4])  # m
    # byte j = 4g + i of the column's codes (k = j and j + 16) at group g, lane `col`, byte i
    assert [int(cell[192 + (j // 4) * 4 * width + 4 * col + j % 4]) for j in range(16)] == raw[row, block, 4:].tolist()
    assert (cell[192 + 4 * 2 : 192 + 4 * width] == 0).all()  # group 0, columns 2.. of panel 1 do not exist


def test_routes_by_row_count():
    w = torch.randn(48, 32)
    both = PackedWeight(pack(w), pack_blocks("Q8_0", quantized("Q8_0", 48, 32, seed=1)[1]))
    floats = PackedWeight(pack(w))
    assert [
        route(r, both) for r in (0, 1, BLOCKS_MAX_ROWS, BLOCKS_MAX_ROWS + 1, PACKED_MAX_ROWS, PACKED_MAX_ROWS + 1)
    ] == ["torch", "blocks", "blocks", "panels", "panels", "torch"]
    assert [route(r, floats) for r in (1, 2, BLOCKS_MAX_ROWS)] == ["torch", "panels", "panels"]
    assert route(5, None) == "torch"


def test_gguf_blocks_setting():
    from executor_svc.config import parse_config

    assert parse_config([], environ={}).gguf_blocks == "auto"
    assert parse_config(["--gguf-blocks", "off"], environ={}).gguf_blocks == "off"
    with pytest.raises(SystemExit):
        parse_config(["--gguf-blocks", "sometimes"], environ={})


@pytest.mark.parametrize("rows", [1, 4, 8])
def test_q8_0_blocks_with_tiny_scales_give_the_float32_result_bit_for_bit(rows):
    """Q8_0 codes come out of their lanes as code << 24 and are scaled by
    d * 2^-24 (packed_gemm.c, Q8_UNSHIFT): still d * code exactly, for
    float16-subnormal scales too (weights ~1e-7, d ~1e-9)."""
    weight, raw = quantized("Q8_0", 100, 96, seed=rows)
    raw = raw.clone()
    tiny = (raw[:, :, 0:2].contiguous().view(torch.float16) * 1e-5).view(torch.uint8)
    raw[:, :, 0:2] = tiny
    assert (tiny.view(torch.float16).abs() < 6.1e-5).all()  # below float16's smallest normal
    d = raw[:, :, 0:2].contiguous().view(torch.float16).float()
    weight = (d * raw[:, :, 2:].view(torch.int8).float()).reshape(100, 96)
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows))
    got = linear(x, weight, None, PackedWeight(pack(weight), pack_blocks("Q8_0", raw)))
    assert torch.equal(got, float32_panels(x, weight, None))
