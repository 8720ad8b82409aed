"""The bfloat16 fused ops (native/fused_ops_bf16.c through executor_svc/fused_ops.py):
against a float64 reference of the same bfloat16 inputs, with tolerances of
bfloat16's rounding, and against the bits torch's bf16 ops give (the model's
plain-torch path: model.py with the bf16 kernels switched off)."""

from __future__ import annotations

import contextlib
import types

import pytest
import torch
import torch.nn.functional as F

from executor_svc import fused_ops, layer_ops, rope
from executor_svc.native_build import cpu_flags

BF16 = torch.bfloat16
# Two roundings to bfloat16 (8 significant bits: rounding errs by up to
# 2^-8 relative) plus float32's error, far smaller.
RTOL = 2**-7

# Decided by the CPU, not by asking the kernels, so a build that wrongly
# reported "no vector path" fails these tests instead of skipping them.
pytestmark = pytest.mark.skipif(
    "avx512f" not in cpu_flags() or not fused_ops.available(torch.empty(0)),
    reason="the bf16 kernels need AVX-512 and a C compiler",
)


@contextlib.contextmanager
def torch_path():
    """The model's ops as before these kernels: bf16 through plain torch."""
    kernels = fused_ops._LIBRARIES[BF16]
    fused_ops._LIBRARIES[BF16] = lambda: None
    try:
        yield
    finally:
        fused_ops._LIBRARIES[BF16] = kernels


def bf16_randn(*shape, seed: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(BF16)


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int16)


def ulps_apart(a: torch.Tensor, b: torch.Tensor) -> int:
    """The largest distance in bfloat16 steps between same-signed finite values."""
    assert torch.equal(torch.signbit(a) | (a == 0), torch.signbit(b) | (b == 0)) or (a == b).all()
    return int((bits(a).int() - bits(b).int()).abs().max())


def test_available_for_float32_and_bfloat16_cpu_tensors_of_one_dtype():
    assert fused_ops.available(torch.zeros(2)) and fused_ops.available(torch.zeros(2, dtype=BF16))
    assert not fused_ops.available(torch.zeros(2, dtype=BF16), torch.zeros(2))
    assert not fused_ops.available(torch.zeros(2, dtype=torch.float16))


@pytest.mark.parametrize("rows,dim", [(1, 576), (3, 37), (17, 64), (70, 1000)])
def test_add_rms_norm_is_torchs_bf16_result_and_within_rounding_of_float64(rows, dim):
    """h becomes torch's bf16 h + delta bit for bit; the output is within two
    bf16 roundings of float64 over those values, and at most one bf16 step from
    the torch path's (the sum of squares is summed in another order)."""
    h0, w = bf16_randn(rows, dim, seed=dim, scale=3), bf16_randn(dim, seed=dim + 1)
    delta = bf16_randn(rows, dim + 5, seed=rows)[:, :dim]  # row-strided
    h = h0.clone()
    got = layer_ops.add_rms_norm(h, delta, w, 1e-5)
    assert torch.equal(bits(h), bits(h0 + delta))
    s = (h0 + delta).double()
    ref = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-5) * w.double()
    torch.testing.assert_close(got.double(), ref, rtol=RTOL, atol=1e-30)
    with torch_path():
        h_torch = h0.clone()
        want = layer_ops.add_rms_norm(h_torch, delta, w, 1e-5)
    assert torch.equal(bits(h_torch), bits(h)) and ulps_apart(got, want) <= 1


def test_rms_norm_reads_non_contiguous_rows():
    wide, w = bf16_randn(9, 160, seed=3), bf16_randn(80, seed=4)
    x = wide[:, ::2]  # no unit stride: taken as a copy
    got = fused_ops.rms_norm(x, w, 1e-6)
    assert torch.equal(bits(got), bits(fused_ops.rms_norm(x.contiguous(), w, 1e-6)))
    xd = x.double()
    ref = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
    torch.testing.assert_close(got.double(), ref, rtol=RTOL, atol=1e-30)


def test_the_residual_add_rounds_every_bit_pattern_as_torch():
    """Ties to even, subnormals, overflow to infinity, signed zeros: h + delta
    over random bit patterns (all of bf16's classes) equals torch's bits; a
    NaN stays a NaN (torch's own scalar and vector paths give different NaN
    bits)."""
    gen = torch.Generator().manual_seed(0)
    h0, delta = (torch.randint(-(2**15), 2**15, (64, 1000), dtype=torch.int16, generator=gen) for _ in range(2))
    h0, delta = h0.view(BF16), delta.view(BF16)
    ties = torch.tensor([1.0, 1.0 + 2**-7, -(1.0 + 2**-7), 2.0**-130, 3.3895e38, -0.0], dtype=BF16)
    steps = torch.tensor([2**-8, 2**-8, -(2**-8), 2.0**-131, 3.3895e38, -0.0], dtype=BF16)
    h0[0, : len(ties)], delta[0, : len(ties)] = ties, steps
    h = h0.clone()
    fused_ops.add_rms_norm(h, delta, torch.ones(1000, dtype=BF16), 1e-5)
    want = h0 + delta
    assert h[0, :6].tolist() == [1.0, 1.0 + 2**-6, -(1.0 + 2**-6), want[0, 3].item(), float("inf"), -0.0]
    nan = want.isnan()
    assert torch.equal(h.isnan(), nan)
    assert torch.equal(bits(h)[~nan], bits(want)[~nan])


@pytest.mark.parametrize("tokens,heads,dim", [(1, 1, 64), (7, 12, 64), (40, 3, 128), (5, 2, 10), (3, 4, 40)])
def test_rope_in_place_is_torchs_bf16_result_on_a_fused_qkv_view(tokens, heads, dim):
    """Head dims whose half is and is not a multiple of 16; v stays untouched."""
    qkv = bf16_randn(tokens, heads + 2, dim, seed=tokens * heads, scale=2)
    angles = torch.rand(tokens, dim // 2, generator=torch.Generator().manual_seed(dim)) * 6
    cos = torch.cat((angles.cos(), angles.cos()), dim=-1).to(BF16)
    sin_signed = torch.cat((-angles.sin(), angles.sin()), dim=-1).to(BF16)
    before = qkv.clone()
    with torch_path():
        want = rope.apply_rope(before[:, :heads], cos, sin_signed)  # a rotated copy
    out = fused_ops.rope_(qkv[:, :heads], cos, sin_signed)
    assert out.data_ptr() == qkv.data_ptr()
    assert torch.equal(bits(qkv[:, :heads]), bits(want))
    assert torch.equal(bits(qkv[:, heads:]), bits(before[:, heads:]))
    # Three roundings (2^-8 each), one after a possibly cancelling add: bounded by the terms' size.
    x = before[:, :heads].double()
    half = dim // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    ref = x * cos.double().unsqueeze(1) + swapped * sin_signed.double().unsqueeze(1)
    bound = 2**-7 * (x.abs() * cos.double().abs().unsqueeze(1) + swapped.abs() * sin_signed.double().abs().unsqueeze(1))
    assert ((qkv[:, :heads].double() - ref).abs() <= bound).all()


def reference_silu_mul(gate_up):
    gate, up = gate_up.double().chunk(2, dim=-1)
    return gate * torch.sigmoid(gate) * up


@pytest.mark.parametrize("rows", [1, 5, 64])
@pytest.mark.parametrize("inter", [16, 37, 1536])
def test_silu_mul_within_rounding_of_float64_and_a_step_of_torch(rows, inter):
    """Widths that are and are not multiples of the 16-lane vector (the tail)."""
    gate_up = bf16_randn(rows, 2 * inter, seed=rows * inter, scale=4)
    got = layer_ops.swiglu(gate_up)
    assert got.dtype == BF16 and got.shape == (rows, inter)
    torch.testing.assert_close(got.double(), reference_silu_mul(gate_up), rtol=RTOL, atol=1e-30)
    gate, up = gate_up.chunk(2, dim=-1)
    assert ulps_apart(got, F.silu(gate) * up) <= 1  # silu's exp differs from torch's by a few float32 ulps


def test_silu_mul_saturates_and_reads_row_strided_input():
    gate_up = torch.tensor([[-1000.0, -100.0, -88.0, 0.0, 88.0, 100.0, 1000.0, 3.0e38] + [1.0] * 8], dtype=BF16)
    got = fused_ops.silu_mul(gate_up)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), reference_silu_mul(gate_up), rtol=RTOL, atol=1e-30)
    wide = bf16_randn(6, 100, seed=1)
    torch.testing.assert_close(
        fused_ops.silu_mul(wide[:, :64]).double(), reference_silu_mul(wide[:, :64]), rtol=RTOL, atol=1e-30
    )


def test_a_row_is_the_same_alone_or_in_a_batch_at_any_thread_count():
    """One row per thread: --deterministic relies on it."""
    h0, delta, w = bf16_randn(300, 576, seed=5), bf16_randn(300, 576, seed=6), bf16_randn(576, seed=7)
    gate_up = bf16_randn(300, 2 * 100, seed=8)
    qk = bf16_randn(300, 4, 64, seed=9)
    cos, sin_signed = bf16_randn(300, 64, seed=10), bf16_randn(300, 64, seed=11)
    threads = torch.get_num_threads()
    try:
        results = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            h = h0.clone()
            rotated = fused_ops.rope_(qk.clone(), cos, sin_signed)
            results.append((fused_ops.add_rms_norm(h, delta, w, 1e-5), h, fused_ops.silu_mul(gate_up), rotated))
        h = h0[7:8].clone()
        alone = (
            fused_ops.add_rms_norm(h, delta[7:8], w, 1e-5),
            h,
            fused_ops.silu_mul(gate_up[7:8]),
            fused_ops.rope_(qk[7:8].clone(), cos[7:8], sin_signed[7:8]),
        )
    finally:
        torch.set_num_threads(threads)
    for batch in results:
        for got, first, one in zip(batch, results[0], alone):
            assert torch.equal(bits(got), bits(first)) and torch.equal(bits(got[7:8]), bits(one))


@pytest.mark.parametrize("source", [BF16, torch.float32], ids=["bf16", "float32"])
def test_kv_write_stores_the_rows_torchs_index_copy_stores(source, monkeypatch):
    """Through the CPU backend, from the k and v heads of a fused qkv row
    (bfloat16, or float32 rounded on the way: ties, a head_dim of 40 with its
    8-lane tail) into scattered slots of a bfloat16 cache, bit for bit as the
    torch backend's write; a slot outside the cache raises before anything is
    written."""
    from executor_svc.attention import get_backend

    native = fused_ops.write_kv
    calls = []
    monkeypatch.setattr(fused_ops, "write_kv", lambda *args: calls.append(args) or native(*args))
    qkv = torch.randn(5, 9 + 2 * 3, 40, generator=torch.Generator().manual_seed(12)).to(source)
    qkv[0, 9, :4] = torch.tensor([1 + 2**-8, 1 + 2**-7 + 2**-8, -(1 + 2**-8), 2**-130])  # ties, a subnormal
    key, value = qkv[:, 9:12], qkv[:, 12:]  # 9 q heads, 3 k heads, 3 v heads
    slots = torch.tensor([17, 3, 40, 41, 0])
    caches = [torch.full((4, 16, 3, 40), float("nan"), dtype=BF16) for _ in range(4)]
    meta = types.SimpleNamespace(slot_mapping=slots)  # all write_kv reads of the step's metadata
    get_backend("cpu").write_kv(key, value, caches[0], caches[1], meta)
    assert len(calls) == 1
    with torch_path():
        get_backend("torch").write_kv(key, value, caches[2], caches[3], meta)
    assert torch.equal(bits(caches[0]), bits(caches[2])) and torch.equal(bits(caches[1]), bits(caches[3]))
    assert torch.equal(bits(caches[0].view(-1, 3, 40)[40]), bits(key[2].to(BF16)))
    assert caches[0].view(-1, 3, 40)[17, 0, :2].tolist() == [1.0, 1 + 2**-6]  # ties to even
    before = caches[0].clone()
    with pytest.raises(IndexError):
        native(key, value, caches[0], caches[1], torch.tensor([1, 2, 3, 4, 64]))
    assert torch.equal(bits(caches[0]), bits(before))


def test_a_bf16_model_on_the_cpu_backend_decodes_as_the_torch_path(tmp_path):
    """A tiny bf16 model (not widened: bf16 activations), every layer's norms,
    rope (head_dim 16: a tail-only half), gate (width 160) and KV writes
    native, against the same model with the bf16 kernels off: the same greedy
    tokens, logits within a few bf16 steps (where a sum of squares or an exp
    lands across a rounding boundary)."""
    from model_utils import PagedEngine, load_hf_folder, make_backend, save_tiny_hf_model

    save_tiny_hf_model("llama3", str(tmp_path))
    bf16_model = load_hf_folder(str(tmp_path), make_backend("cpu"), BF16)
    prompts = [[5, 17, 99, 3, 250, 41, 7], [8, 1, 300, 12, 60, 60, 2, 9, 111, 4, 77, 5, 19, 200, 31, 6, 42]]
    runs = []
    for kernels in (True, False):
        with contextlib.nullcontext() if kernels else torch_path():
            engine = PagedEngine(bf16_model, num_blocks=16, block_size=16)
            seqs = [engine.add(p) for p in prompts]
            logits = [engine.step([(s, len(s.token_ids)) for s in seqs])]
            for _ in range(6):
                for seq, token in zip(seqs, logits[-1].argmax(-1).tolist()):
                    seq.token_ids.append(token)
                logits.append(engine.step([(s, 1) for s in seqs]))
            runs.append(([s.token_ids for s in seqs], torch.stack(logits).float()))
    (tokens, logits), (want_tokens, want_logits) = runs
    assert tokens == want_tokens
    # (Bit-identical when measured; four bf16 steps of the largest logit allowed.)
    torch.testing.assert_close(logits, want_logits, rtol=0, atol=2**-5 * float(want_logits.abs().max()))
