"""The packed kernel's bf16 dot-product GEMM (native/bf16_dot_gemm.h) over
BF16 block panels: activations rounded to bfloat16, pairs of k multiplied as
VDPBF16PS does. Its emulated build runs on every AVX-512 CPU and is checked
here bit for bit against that definition; the VDPBF16PS build only where
the CPU has AVX512-BF16."""

from __future__ import annotations

import ctypes
import dataclasses

import pytest
import torch

from executor_svc import gemm_epilogues, layer_ops, packed_linear
from executor_svc.packed_linear import BF16_MAX_ROWS, PackedWeight, linear, pack_bf16, route

pytestmark = pytest.mark.skipif(packed_linear.kernel() is None, reason="needs x86 AVX-512 and a C compiler")

DOT = ((1, "dot"),)


def bf16_weight(out_features: int, in_features: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(out_features, in_features, generator=gen) / in_features**0.5).to(torch.bfloat16)


def vdpbf16ps_reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Intel's definition, column by column in float32: acc += x[2s+1] w[2s+1],
    then acc += x[2s] w[2s], from the bias. A product of two bfloat16 values
    is exact in float32, so each step rounds once, as the instruction's FMA does."""
    xs, ws = x.to(torch.bfloat16).float(), w.float()
    acc = torch.zeros(x.shape[0], w.shape[0]) if bias is None else bias.expand(x.shape[0], -1).clone()
    for s in range(w.shape[1] // 2):
        for k in (2 * s + 1, 2 * s):
            acc = acc + xs[:, k : k + 1] * ws[:, k]
    return acc


def emulated(x, w, bias=None):
    """The dot route through the emulated loop, whatever this CPU has."""
    k = packed_linear.kernel()
    blocks = pack_bf16(w)
    xb = x.to(torch.bfloat16).contiguous()
    out = torch.full((x.shape[0], w.shape[0]), float("nan"))
    status = k.gemm_bf16_dot(
        out.data_ptr(), out.stride(0), xb.data_ptr(), xb.stride(0), blocks.data.data_ptr(),
        None if bias is None else bias.data_ptr(), x.shape[0], w.shape[0], w.shape[1], 0, 2,
    )  # fmt: skip
    assert status == 0
    return out


@pytest.mark.parametrize(
    "rows,out_features,in_features",
    [
        (1, 48, 32),
        (3, 70, 64),
        (8, 96, 96),
        (9, 100, 128),
        (17, 17, 64),
        (300, 49, 96),
        (520, 100, 64),
        (2050, 49, 64),
        (64, 1536, 576),
        (1100, 1000, 64),  # C past PREFETCH_OUT_MIN_BYTES (4.4 MB): tiles prefetch their next output lines
    ],
)
@pytest.mark.parametrize("with_bias", [False, True])
def test_emulated_dot_is_the_instructions_arithmetic_bit_for_bit(rows, out_features, in_features, with_bias):
    """Tiles of 1..8 rows, two to nine row chunks of equal size (300, 520 and
    2,050 rows: a last chunk and tile shorter than the others), partial last
    panels and vectors, an output large enough for the output prefetch; the
    whole k order is the one the reference spells out."""
    w = bf16_weight(out_features, in_features, seed=rows)
    gen = torch.Generator().manual_seed(out_features)
    x = torch.randn(rows, in_features, generator=gen)
    bias = torch.randn(out_features, generator=gen) if with_bias else None
    assert torch.equal(emulated(x, w, bias), vdpbf16ps_reference(x, w, bias))


def test_dot_route_is_within_float32_summation_error_of_float64():
    """Through packed_linear.linear (VDPBF16PS where the CPU has it): against
    float64 over the bfloat16-rounded activations, the only error is float32
    summation, |error| <= K 2^-24 sum_k |x_k w_k|; against the float32
    activations, bf16 rounding of x adds up to 2^-8 relative per product."""
    w = bf16_weight(200, 256, 1)
    gen = torch.Generator().manual_seed(2)
    x, bias = torch.randn(40, 256, generator=gen), torch.randn(200, generator=gen)
    packed = PackedWeight(None, pack_bf16(w), bf16_routes=DOT)
    assert route(40, packed) == "dot"
    got = linear(x, w, bias, packed).double()
    xr = x.to(torch.bfloat16).double()
    mags = xr.abs() @ w.double().abs().T + bias.double().abs()
    assert ((got - (xr @ w.double().T + bias.double())).abs() <= 256 * 2.0**-24 * mags).all()
    exact = x.double() @ w.double().T + bias.double()
    assert ((got - exact).abs() <= 2.0**-8 * mags).all()
    assert not torch.equal(got, exact), "activations rounded to bfloat16 should show"


def test_dot_route_takes_rows_past_the_bf16_mkl_limit_and_refuses_bad_widths():
    w = bf16_weight(50, 64, 3)
    packed = PackedWeight(None, pack_bf16(w), bf16_routes=DOT)
    assert route(BF16_MAX_ROWS + 1, packed) == "dot"
    x = torch.randn(BF16_MAX_ROWS + 1, 64)
    torch.testing.assert_close(linear(x, w, None, packed), vdpbf16ps_reference(x, w, None), rtol=0, atol=1e-5)
    k = packed_linear.kernel()
    out, xb = torch.empty(1, 50), torch.zeros(1, 48, dtype=torch.bfloat16)
    blocks = pack_bf16(w)
    # K not a multiple of 32: refused before any read.
    assert k.gemm_bf16_dot(out.data_ptr(), 50, xb.data_ptr(), 48, blocks.data.data_ptr(), None, 1, 50, 48, 0, 1) == -3
    if not k.bf16_dot_native:  # VDPBF16PS asked for where the CPU lacks it
        args = (out.data_ptr(), 50, xb.data_ptr(), 64, blocks.data.data_ptr(), None, 1, 50, 64, 1, 1)
        assert k.gemm_bf16_dot(*args) == -2


@pytest.mark.skipif(
    packed_linear.kernel() is None or not packed_linear.kernel().bf16_dot_native, reason="needs AVX512-BF16"
)
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_vdpbf16ps_agrees_with_its_emulation(rows):
    """Same inputs, the instruction against its emulated arithmetic: they may
    differ only where the instruction flushes denormals or orders a pair's
    two products otherwise, within float32 summation error."""
    w = bf16_weight(130, 192, rows)
    x = torch.randn(rows, 192, generator=torch.Generator().manual_seed(rows))
    native = linear(x, w, None, PackedWeight(None, pack_bf16(w), bf16_routes=DOT)).double()
    emul = emulated(x, w).double()
    mags = x.to(torch.bfloat16).double().abs() @ w.double().abs().T
    assert ((native - emul).abs() <= 2 * 192 * 2.0**-24 * mags).all()


@pytest.mark.parametrize("rows,spans,span_bytes", [(1, 3, 6144), (64, 40, 6144), (9, 500, 3264), (64, 1, 100)])
def test_warming_changes_no_output_and_refuses_a_missing_span_list(rows, spans, span_bytes):
    """packed_gemm_bf16_dot_warm prefetches `spans` while it computes: the
    product is the plain call's bit for bit, whether there are fewer spans
    than tiles or many more, span lengths a whole number of lines or not."""
    k = packed_linear.kernel()
    w = bf16_weight(200, 192, rows)
    blocks = pack_bf16(w)
    xb = torch.randn(rows, 192, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
    arena = torch.zeros(spans * span_bytes + 64, dtype=torch.uint8)
    table = (ctypes.c_void_p * spans)(*[arena.data_ptr() + i * span_bytes for i in range(spans)])
    native = int(k.bf16_dot_native)
    outs = []
    for warm in ((None, 0, 0), (table, spans, span_bytes)):
        out = torch.full((rows, 200), float("nan"))
        args = (out.data_ptr(), 200, xb.data_ptr(), 192, blocks.data.data_ptr(), None, rows, 200, 192, native, 2)
        assert k.gemm_bf16_dot_warm(*args, *warm) == 0
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(outs[0], linear(xb.float(), w, None, PackedWeight(None, blocks, bf16_routes=DOT)))
    untouched = torch.full((rows, 200), float("nan"))
    args = (untouched.data_ptr(), 200, xb.data_ptr(), 192, blocks.data.data_ptr(), None, rows, 200, 192, native, 2)
    assert k.gemm_bf16_dot_warm(*args, None, 3, span_bytes) == -4
    assert k.gemm_bf16_dot_warm(*args, table, spans, 0) == -4
    assert untouched.isnan().all()


def unfused_swiglu(x: torch.Tensor, gate_up: PackedWeight, down: PackedWeight, gw, dw) -> torch.Tensor:
    """The dot route's MLP one op at a time: the gate/up GEMM's float32 product,
    SwiGLU over it, and the down GEMM, which rounds its input to bfloat16."""
    return linear(layer_ops.swiglu(linear(x, gw, None, gate_up)), dw, None, down)


@pytest.mark.parametrize("rows", [1, 7, 8, 9, 64, 257, 600])
@pytest.mark.parametrize("native", [False, True], ids=["emulated", "vdpbf16ps"])
def test_swiglu_on_the_gate_up_tiles_is_the_unfused_mlp_bit_for_bit(rows, native, monkeypatch):
    """mlp() over two dot-routed weights takes packed_gemm_bf16_dot_swiglu,
    which never writes the float32 gate/up product: its activations and output
    must be the three-op path's exactly (a NaN's bit pattern aside), for row counts
    within one tile, across tiles and across 256-row chunks, with a row of huge
    activations (silu's exp overflowing to inf, g / inf = 0) and one NaN row
    (NaN out, as torch)."""
    if native and not packed_linear.kernel().bf16_dot_native:
        pytest.skip("needs AVX512-BF16")
    inter, hidden = 96, 64  # two panel pairs
    gw, dw = bf16_weight(2 * inter, hidden, rows), bf16_weight(hidden, inter, rows + 1)
    gate_up = PackedWeight(None, pack_bf16(gw), bf16_routes=DOT)
    down = PackedWeight(None, pack_bf16(dw), bf16_routes=DOT)
    x = torch.randn(rows, hidden, generator=torch.Generator().manual_seed(rows)) * 4
    if rows > 2:
        x[1] *= 1e4
        x[2, 5] = float("nan")
    k = dataclasses.replace(packed_linear.kernel(), bf16_dot_native=native)
    monkeypatch.setattr(packed_linear, "kernel", lambda: k)  # every dot GEMM below, fused or not
    calls = []
    monkeypatch.setattr(layer_ops, "swiglu_dot", lambda *a: calls.append(gemm_epilogues.swiglu_dot(*a)) or calls[-1])
    fused = layer_ops.mlp(x, gw, dw, gate_up, down)
    act = gemm_epilogues.swiglu_dot(x, gate_up)
    act_want = layer_ops.swiglu(linear(x, gw, None, gate_up)).to(torch.bfloat16)
    want = unfused_swiglu(x, gate_up, down, gw, dw)
    assert len(calls) == 1 and calls[0] is not None, "mlp() did not run the fused pass"
    assert act is not None and act.dtype == torch.bfloat16 and act.shape == (rows, inter)
    # NaN as NaN (bf16.h writes 0x7FC0, torch's vector conversion a pattern of its own), the rest bit for bit.
    assert torch.equal(act.isnan(), act_want.isnan())
    assert torch.equal(act.nan_to_num().view(torch.int16), act_want.nan_to_num().view(torch.int16))
    assert torch.equal(fused.isnan(), want.isnan()) and (rows <= 2 or want[2].isnan().all())
    assert torch.equal(fused.nan_to_num(), want.nan_to_num())


def test_swiglu_dot_refuses_an_intermediate_size_of_partial_panels():
    """Gate panel p pairs with up panel p + I/48 only when I is whole panels:
    otherwise the fused pass declines (None) and mlp() runs the three ops."""
    inter, hidden = 64, 64  # 64 = 1 1/3 panels
    gw, dw = bf16_weight(2 * inter, hidden, 5), bf16_weight(hidden, inter, 6)
    gate_up = PackedWeight(None, pack_bf16(gw), bf16_routes=DOT)
    down = PackedWeight(None, pack_bf16(dw), bf16_routes=DOT)
    x = torch.randn(33, hidden)
    assert gemm_epilogues.swiglu_dot(x, gate_up) is None
    assert torch.equal(layer_ops.mlp(x, gw, dw, gate_up, down), unfused_swiglu(x, gate_up, down, gw, dw))


@pytest.mark.parametrize("rows", [9, 64, 300])
def test_swiglu_dot_gives_the_same_bits_on_any_thread_count(rows):
    """With few row chunks for the threads, the fused pass cuts the rows into
    smaller chunks; every output is still one tile's, so 1, 3 and 8 threads
    give the same bits."""
    gw = bf16_weight(2 * 96, 64, rows)
    gate_up = PackedWeight(None, pack_bf16(gw), bf16_routes=DOT)
    x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows))
    before = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 3, 8):
            torch.set_num_threads(threads)
            outs.append(gemm_epilogues.swiglu_dot(x, gate_up))
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(outs[0].view(torch.int16), o.view(torch.int16)) for o in outs[1:])


@pytest.mark.parametrize("rows,spans,span_bytes", [(1, 3, 6144), (64, 40, 6144), (9, 500, 3264)])
def test_swiglu_warming_changes_no_output_and_refuses_a_missing_span_list(rows, spans, span_bytes):
    """The SwiGLU pass warms the decoder stack's spans as the plain GEMM does:
    its bf16 output is the same bit for bit with spans or without, and a span
    count without a list (or spans of no bytes) is refused before any write."""
    k = packed_linear.kernel()
    gate_up = pack_bf16(bf16_weight(2 * 96, 64, rows))
    xb = torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
    arena = torch.zeros(spans * span_bytes + 64, dtype=torch.uint8)
    table = (ctypes.c_void_p * spans)(*[arena.data_ptr() + i * span_bytes for i in range(spans)])
    native = int(k.bf16_dot_native)
    outs = []
    for warm in ((None, 0, 0), (table, spans, span_bytes), (None, 3, span_bytes), (table, spans, 0)):
        out = torch.full((rows, 96), -1, dtype=torch.int16)
        status = k.gemm_bf16_dot_swiglu(
            out.data_ptr(), 96, xb.data_ptr(), 64, gate_up.data.data_ptr(), rows, 96, 64, native, 2, *warm
        )
        outs.append((status, out))
    (plain, first), (warmed, second) = outs[:2]
    assert plain == warmed == 0 and torch.equal(first, second)
    assert torch.equal(first.view(torch.bfloat16), gemm_epilogues.swiglu_dot(xb.float(), PackedWeight(None, gate_up)))
    assert all(status == -4 and (out == -1).all() for status, out in outs[2:])
