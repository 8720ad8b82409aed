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


def test_route_sends_rows_from_the_crossover_to_onednn():
    w = bf16_weight(96, 64, 0)
    plain = PackedWeight(None, pack_bf16(w))
    hybrid = PackedWeight(None, pack_bf16(w), onednn_linear.pack(w), 16)
    assert [route(rows, hybrid) for rows in (1, 15, 16, 600)] == ["blocks", "blocks", "onednn", "onednn"]
    assert [route(rows, plain) for rows in (1, 16, packed_linear.BF16_MAX_ROWS + 1)] == ["blocks", "blocks", "torch"]


@pytest.mark.parametrize("rows", [16, 64, 300])
def test_onednn_rows_match_float64_within_bf16_activation_rounding(rows):
    """The products are of bfloat16 activations, each x off by at most 2^-9
    relative, summed in float32, and oneDNN returns the sum rounded to
    bfloat16 (2^-9 relative again): |error| <= 2^-9 * (sum_k |x_k w_k| + |y|)."""
    w = bf16_weight(200, 128, 1)
    bias = torch.randn(200)
    packed = PackedWeight(None, pack_bf16(w), onednn_linear.pack(w), 16)
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


class FakeClock:
    """perf_counter for calibrate(): each stand-in kernel advances it by its cost,
    so the test does not depend on how busy the machine is."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


def test_calibrate_picks_the_smallest_row_count_from_which_onednn_always_wins(monkeypatch):
    """A stand-in kernel slower than oneDNN from 64 rows on, except at 32
    rows (where it wins again): the crossover is 64, not 8."""
    clock = FakeClock()
    monkeypatch.setattr(onednn_linear, "time", clock)

    def fake_onednn(x, packed, bias):
        clock.now += 2.0

    def blocks_for(weight):
        def run(x):
            rows = x.shape[0]
            clock.now += 1.0 if rows in (8, 32) else 4.0 if rows >= 64 else 3.0

        return run

    monkeypatch.setattr(onednn_linear, "linear", fake_onednn)
    crossover, times = onednn_linear.calibrate(48, 64, blocks_for, reps=3)
    assert crossover == 64
    assert times[64] == (4e6, 2e6) and times[32] == (1e6, 2e6)
    assert set(times) == set(onednn_linear.CALIBRATION_ROWS)

    def slow_onednn(x, packed, bias):
        clock.now += 10.0

    monkeypatch.setattr(onednn_linear, "linear", slow_onednn)
    assert onednn_linear.calibrate(48, 64, blocks_for, reps=1)[0] is None


def test_worker_on_a_fast_bf16_cpu_widens_and_adds_onednn(tmp_path, monkeypatch):
    """--dtype auto on a CPU reporting native bf16 (forced): a widened model
    whose linears also hold oneDNN weights from the calibrated row count, and
    whose prefill logits agree with the widened model without them."""
    from model_utils import PagedEngine, save_tiny_hf_model
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    from executor_svc import worker as worker_mod
    from executor_svc.config import ExecutorConfig

    save_tiny_hf_model("llama_tied", str(tmp_path))
    Tokenizer(WordLevel({"<unk>": 0}, unk_token="<unk>")).save(str(tmp_path / "tokenizer.json"))
    monkeypatch.setattr(worker_mod, "cpu_has_fast_bf16", lambda: True)
    monkeypatch.setattr(onednn_linear, "calibrate", lambda *a, **k: (8, {}))
    hybrid = worker_mod.Worker(ExecutorConfig(model=str(tmp_path), kv_cache_gib=0.01))
    assert hybrid.dtype == torch.bfloat16 and hybrid.packed_gemm
    assert hybrid.model.compute_dtype == torch.float32
    packed = hybrid.model.layers[0].packed["gate_up"]
    assert packed.onednn is not None and packed.onednn_min_rows == 8
    plain = worker_mod.Worker(ExecutorConfig(model=str(tmp_path), kv_cache_gib=0.01, cpu_gemm="native"))
    assert plain.model.layers[0].packed["gate_up"].onednn is None

    prompt = list(range(3, 40))
    logits = []
    for w in (hybrid, plain):
        engine = PagedEngine(w.model, num_blocks=16, block_size=16)
        logits.append(engine.step([(engine.add(prompt), len(prompt))])[0])
    assert not torch.equal(logits[0], logits[1]), "the prefill should have gone through oneDNN"
    torch.testing.assert_close(logits[0], logits[1], rtol=0, atol=0.05 * logits[1].abs().max().item())
