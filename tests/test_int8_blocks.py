"""The int8-activation GEMM over GGUF blocks (native/int8_blocks.h,
--gguf-activations int8): its quantiser against llama.cpp's rule, the kernel
against a float64 product of the same int8 activations and the dequantised
weights, and where packed_linear routes to it."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from executor_svc import packed_linear
from executor_svc.packed_linear import (
    BLOCK_FORMATS,
    INT8_MAX_ROWS,
    PackedWeight,
    linear,
    pack,
    pack_bf16,
    pack_blocks,
    quantize_int8,
    route,
)
from tests.test_packed_linear import quantized

pytestmark = pytest.mark.skipif(
    packed_linear.kernel() is None or not packed_linear.kernel().int8_native, reason="needs AVX512-VNNI"
)

EPS32 = 2.0**-24


def quantize_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """llama.cpp's Q8_1 rule in float32: d = amax / 127, q = rne(x * (127 / amax)), s = d * sum(q)."""
    blocks = x.reshape(x.shape[0], -1, 32)
    amax = blocks.abs().amax(dim=2, keepdim=True)
    inv = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros(()))
    q = torch.round(blocks * inv)  # torch.round: half to even
    d = (amax / torch.tensor(127.0)).squeeze(2)
    return q.to(torch.int8).reshape(x.shape), d, d * q.sum(dim=2)


def test_quantiser_rounds_to_nearest_even_and_keeps_zero_blocks():
    # Block 0: amax 127, so x * 127 / amax is x itself: halves round to even.
    halves = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, -126.5] + [0.0] * 23 + [127.0])
    zero = torch.zeros(32)
    extreme = torch.full((32,), -3.0e38)  # every value the block's max magnitude
    x = torch.stack([torch.cat([halves, zero, extreme])])
    q, d, s = quantize_int8(x)
    assert q[0, :8].tolist() == [0, 2, 2, 0, -2, -2, 126, -126] and q[0, 31] == 127
    assert (q[0, 32:64] == 0).all() and d[0, 1] == 0 and s[0, 1] == 0
    assert (q[0, 64:] == -127).all() and d[0, 2] == torch.tensor(3.0e38) / 127 and s[0, 2] == d[0, 2] * -127 * 32
    for got, want in zip((q, d, s), quantize_reference(x)):
        assert torch.equal(got, want)


def test_quantiser_matches_the_reference_on_random_rows():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 160, generator=gen) * torch.logspace(-3, 3, 160)
    for got, want in zip(quantize_int8(x), quantize_reference(x)):
        assert torch.equal(got, want)


def int8_reference(kind: str, x: torch.Tensor, raw: torch.Tensor, bias: torch.Tensor | None):
    """(float64 product of the kernel's int8 activations and the exactly
    dequantised weights, a bound on the kernel's float32 rounding of it)."""
    q, d, _ = quantize_int8(x)
    xs = (q.double().reshape(x.shape[0], -1, 32) * d.double().unsqueeze(2)).reshape(x.shape)
    n, nb, _ = raw.shape
    scales = raw[:, :, 0:4].contiguous().view(torch.float16).double()  # [n, nb, 2]: d, m (Q4_1)
    if kind == "Q4_1":
        packed_codes = raw[:, :, 4:].long()
        codes = torch.cat([packed_codes & 15, packed_codes >> 4], dim=2).double()
        w = scales[:, :, :1] * codes + scales[:, :, 1:2]
    else:
        w = scales[:, :, :1] * raw[:, :, 2:].view(torch.int8).double()
    w = w.reshape(n, nb * 32)
    out = xs @ w.t()
    # Per block and column: |terms| of the float32 sum, each rounded a few times.
    magnitude = torch.einsum("rbk,nbk->rn", xs.abs().reshape(x.shape[0], nb, 32), w.abs().reshape(n, nb, 32))
    if bias is not None:
        out, magnitude = out + bias.double(), magnitude + bias.double().abs()
    return out, (nb + 4) * 2 * EPS32 * magnitude


def run_int8(kind, x, raw, bias, threads=2, ldc=None):
    n, nb, _ = raw.shape
    blocks = pack_blocks(kind, raw)
    ldc = ldc or n
    out = torch.full((x.shape[0], ldc), float("nan"))
    status = packed_linear.kernel().gemm_int8(
        out.data_ptr(),
        ldc,
        x.data_ptr(),
        x.stride(0),
        blocks.data.data_ptr(),
        BLOCK_FORMATS[kind][0],
        None if bias is None else bias.data_ptr(),
        x.shape[0],
        n,
        nb * 32,
        threads,
    )
    assert status == 0
    return out


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
@pytest.mark.parametrize(
    "shape,rows",
    [
        *(
            (shape, rows)
            for shape in [(5, 32), (50, 96), (960, 576), (100, 1536)]
            for rows in [1, 2, 3, 4, 5, 8, 13, 16]
        ),
        ((100, 96), 37),
        ((960, 576), 301),  # a prefill's worth of row tiles
        ((100, 1536), 301),  # two chunks of rows (ROW_CHUNK_BYTES / K = 170), 3 panels: split by item
        ((960, 1536), 301),  # two chunks, 20 panels: split by panel
    ],
)
def test_kernel_is_the_float64_product_of_the_same_int8_activations(kind, shape, rows):
    """Partial panels (5, 50, 100 columns), K a multiple of 32 but not of 64
    (32, 96), bias and none, 1..16 rows (tiles of 4 and a remainder) and
    prefill-sized counts; C has a wider row stride than N and nothing past N
    is written."""
    n, k = shape
    _, raw = quantized(kind, n, k, seed=rows + n)
    gen = torch.Generator().manual_seed(n * rows)
    x_wide, bias = torch.randn(rows, k + 3, generator=gen), torch.randn(n, generator=gen)
    x = x_wide[:, :k]
    for b in (None, bias):
        out = run_int8(kind, x_wide, raw, b, ldc=n + 5)
        want, bound = int8_reference(kind, x.contiguous(), raw, b)
        err = (out[:, :n].double() - want).abs()
        assert (err <= bound).all(), f"max error {err.max()} over bound {bound[err > bound].min()}"
        assert out[:, n:].isnan().all()


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
def test_threads_do_not_change_a_bit(kind):
    _, raw = quantized(kind, 500, 320, seed=7)
    x = torch.randn(6, 320, generator=torch.Generator().manual_seed(8))
    one = run_int8(kind, x, raw, None, threads=1)
    for threads in (2, 3, 5):
        assert torch.equal(run_int8(kind, x, raw, None, threads=threads), one)


def test_kernel_rejects_what_it_cannot_read():
    out, x, data = torch.empty(1, 48), torch.empty(1, 64), torch.zeros(1, 2, 1632, dtype=torch.uint8)
    gemm = packed_linear.kernel().gemm_int8
    for fmt, k in ((BLOCK_FORMATS["BF16"][0], 64), (BLOCK_FORMATS["Q8_0"][0], 40), (BLOCK_FORMATS["Q8_0"][0], 0)):
        assert gemm(out.data_ptr(), 48, x.data_ptr(), 64, data.data_ptr(), fmt, None, 1, 48, k, 1) == -3


def test_route_takes_int8_only_where_the_weight_allows_it():
    """int8 for 1..int8_rows rows of Q4_1/Q8_0 blocks, whatever float route
    those rows would take (blocks, panels, MKL, BF16 blocks), never past
    them, never where the weight was not given int8_rows (option off, no VNNI
    or --deterministic: weight_packing decides), never without GGUF blocks."""
    w, raw = quantized("Q4_1", 48, 64, seed=1)
    on = PackedWeight(pack(w), pack_blocks("Q4_1", raw), int8_rows=INT8_MAX_ROWS)
    off = PackedWeight(pack(w), pack_blocks("Q4_1", raw))
    rows = (1, 32, 33, 300, 2048)
    assert [route(r, off) for r in rows] == ["blocks", "blocks", "panels", "torch", "torch"]
    assert [route(r, on) for r in (0, *rows, INT8_MAX_ROWS)] == ["torch"] + ["int8"] * 6
    limited = PackedWeight(pack(w), pack_blocks("Q4_1", raw), int8_rows=40)
    assert [route(r, limited) for r in (40, 41)] == ["int8", "panels"]
    bf16 = PackedWeight(None, pack_bf16(w.bfloat16()), gguf=pack_blocks("Q4_1", raw), int8_rows=INT8_MAX_ROWS)
    bf16_off = PackedWeight(None, pack_bf16(w.bfloat16()), gguf=pack_blocks("Q4_1", raw))
    assert [route(r, bf16_off) for r in (1, 33, 2048)] == ["gguf", "blocks", "torch"]
    assert [route(r, bf16) for r in (1, 33, 2048)] == ["int8"] * 3
    with pytest.raises(AssertionError):
        PackedWeight(pack(w), pack_blocks("Q4_1", raw), batch_invariant=True, int8_rows=4)
    with pytest.raises(AssertionError):
        PackedWeight(pack(w), int8_rows=4)
    with pytest.raises(AssertionError):
        PackedWeight(None, pack_bf16(w.bfloat16()), int8_rows=4)
    # Panels may be left out only where int8 takes every row count.
    assert route(1000, PackedWeight(torch.empty(0), pack_blocks("Q4_1", raw), int8_rows=INT8_MAX_ROWS)) == "int8"
    with pytest.raises(AssertionError, match="panels are left out only"):
        PackedWeight(torch.empty(0), pack_blocks("Q4_1", raw), int8_rows=40)


@pytest.mark.parametrize("rows", [3, 300])
def test_linear_through_the_int8_route_is_the_kernel(rows):
    """A decode batch and a prefill-sized one (which MKL would take in float32)."""
    w, raw = quantized("Q8_0", 96, 64, seed=2)
    x, bias = torch.randn(rows, 64), torch.randn(96)
    packed = PackedWeight(pack(w), pack_blocks("Q8_0", raw), int8_rows=INT8_MAX_ROWS)
    assert torch.equal(linear(x, w, bias, packed), run_int8("Q8_0", x, raw, bias))


def test_int8_rows_only_with_the_option_vnni_blocks_and_no_determinism(monkeypatch):
    from executor_svc.machine import gguf_int8_rows

    assert gguf_int8_rows("int8", True, "auto") == INT8_MAX_ROWS
    assert gguf_int8_rows("float", True, "auto") == 0
    assert gguf_int8_rows("int8", False, "auto") == 0  # no native GEMM
    assert gguf_int8_rows("int8", True, "off") == 0  # no GGUF blocks kept
    assert gguf_int8_rows("int8", True, "auto", deterministic=True) == 0
    no_vnni = dataclasses.replace(packed_linear.kernel(), int8_native=False)
    monkeypatch.setattr(packed_linear, "kernel", lambda: no_vnni)
    assert gguf_int8_rows("int8", True, "auto") == 0


def test_gguf_activations_setting(capsys):
    from executor_svc.config import parse_config

    assert parse_config([], environ={}).gguf_activations == "float"
    assert parse_config(["--gguf-activations", "int8"], environ={}).gguf_activations == "int8"
    with pytest.raises(SystemExit):
        parse_config(["--gguf-activations", "int4"], environ={})
    with pytest.raises(SystemExit):
        parse_config(["--gguf-activations", "int8", "--deterministic"], environ={})
    assert "--deterministic: --gguf-activations int8" in capsys.readouterr().err


@pytest.fixture(scope="module")
def smollm2_logits(one_torch_thread):
    """The embedded SmolLM2 served as `--dtype float32 --gguf-activations int8`
    (a Worker: config, loader and packing as in serving) and its teacher-forced
    logits over real text, 8 tokens a step, with int8 activations, then with
    float ones (int8_rows set to 0 on the same weights):
    (float, int8, the int8 model's packed weights as loaded, the start-up
    log, the model (float packed weights now), the token ids)."""
    from structlog.testing import capture_logs
    from tokenizers import Tokenizer

    from bench.bf16_quant_quality import logits_by_position, texts
    from executor_svc.config import ExecutorConfig
    from executor_svc.worker import Worker

    with capture_logs() as logs:
        worker = Worker(ExecutorConfig(dtype="float32", gguf_activations="int8", kv_cache_gib=0.01, num_threads=1))
    model, tokenizer = worker.model, Tokenizer.from_str(worker.tokenizer.tokenizer_json)
    ids = [tokenizer.encode(t, add_special_tokens=False).ids[:41] for t in texts()[:3]]
    loaded = ([dict(layer.packed) for layer in model.layers], model._head_packed)
    int8 = torch.cat([logits_by_position(model, i, 8, torch.float32) for i in ids])
    # The float run needs the float32 panels the int8 model leaves out.
    for layer in model.layers:
        layer.packed = {
            name: dataclasses.replace(p, panels=pack(getattr(layer, f"{name}_weight")), int8_rows=0)
            for name, p in layer.packed.items()
        }
    head = model.embed_tokens if model.lm_head is None else model.lm_head
    model._head_packed = dataclasses.replace(model._head_packed, panels=pack(head), int8_rows=0)
    floats = torch.cat([logits_by_position(model, i, 8, torch.float32) for i in ids])
    return floats, int8, loaded, logs, model, ids


def test_smollm2_prefill_with_int8_activations_on_two_threads(smollm2_logits):
    """The three texts as one sequence, prefilled at once (GEMMs of 122 rows,
    quantised by both threads) and then in steps of 8: the same logits, since
    a row's int8 result depends on nothing else in the call."""
    from bench.bf16_quant_quality import logits_by_position

    _, int8, (layers, head), _, model, ids = smollm2_logits
    floats = [dict(layer.packed) for layer in model.layers], model._head_packed
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for layer, packed in zip(model.layers, layers):
            layer.packed = packed
        model._head_packed = head
        text = [t for i in ids for t in i]
        prefill = logits_by_position(model, text, 1000, torch.float32)
        steps = logits_by_position(model, text, 8, torch.float32)
    finally:
        torch.set_num_threads(threads)
        for layer, packed in zip(model.layers, floats[0]):
            layer.packed = packed
        model._head_packed = floats[1]
    assert prefill.shape[0] == len(text) - 1 >= 64
    assert torch.equal(prefill, steps)
    assert torch.equal(steps[: len(ids[0]) - 1], int8[: len(ids[0]) - 1])  # the fixture's first text, one thread


def test_smollm2_with_int8_activations_stays_close_to_float(smollm2_logits):
    """With the option, every GGUF linear (30 layers' four, the Q8_0 head)
    takes the int8 route at every row count, start-up says so, and the
    logits move, but little: bench.bf16_quant_quality measured 96% argmax
    agreement and top-5 |logprob difference| mean 0.08, max 1.4 over 1,815
    positions; the bounds here leave room for these 120."""
    from bench.bf16_quant_quality import compare

    floats, int8, (layers, head), logs, _, _ = smollm2_logits
    packed = [p for layer in layers for p in layer.values()] + [head]
    assert len(packed) == 121 and all(route(r, p) == "int8" for p in packed for r in (1, 64, 2048))
    assert all(p.panels.numel() == 0 for p in packed)  # no float32 panels: no route would read them
    [line] = [e for e in logs if e["event"] == "gguf_linear_route"]
    assert line["weights_in_blocks"] == 121 and line["activations"] == "int8"
    assert not torch.equal(floats, int8)
    r = compare(int8, floats)
    assert r["agree"] >= 0.9 and r["mean"] <= 0.2 and r["max"] <= 3.0, r
