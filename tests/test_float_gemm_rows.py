"""Up to how many rows the native kernel's float32 arithmetic takes prefill
chunks from MKL (float_gemm_rows.py): the choice from timings (a fake clock,
so the machine's load cannot decide), the route it sets, both candidates'
products, and a Worker that measured it serving through it."""

from __future__ import annotations

import pytest
import torch

from executor_svc import bf16_gemm_routes, float_gemm_rows, machine, packed_linear
from executor_svc.float_gemm_rows import NATIVE_MARGIN, UNBOUNDED, calibrate, candidates, native_max_rows
from executor_svc.packed_linear import BF16_MAX_ROWS, PACKED_MAX_ROWS, PackedWeight, pack, pack_bf16, route

pytestmark = pytest.mark.skipif(packed_linear.kernel() is None, reason="needs x86 AVX-512 and a C compiler")


def test_the_kernel_keeps_rows_up_to_the_first_count_where_mkl_is_as_fast():
    def times(*pairs):
        return {rows: {"native": n, "torch": t} for rows, (n, t) in zip((512, 1024, 2048), pairs)}

    assert native_max_rows(times((1.0, 2.0), (2.0, 4.0), (4.0, 8.0))) == UNBOUNDED
    assert native_max_rows(times((1.0, 2.0), (2.0, 4.0), (4.0, 4.0))) == 1024
    assert native_max_rows(times((2.0, 1.0), (1.0, 4.0), (1.0, 8.0))) == 0  # loses first: the default stays
    # Inside the margin is a tie, and a tie keeps MKL.
    assert native_max_rows(times((1.0, NATIVE_MARGIN * 0.999), (1.0, 2.0), (1.0, 2.0))) == 0
    assert native_max_rows(times((1.0, NATIVE_MARGIN * 1.001), (1.0, 2.0), (1.0, 2.0))) == UNBOUNDED
    assert native_max_rows({}) == 0


def test_calibrate_times_both_alternated_and_reports_medians():
    now = [0.0]
    calls = []

    def gemm(name, cost):
        def run(x):
            calls.append(name)
            now[0] += cost(x.shape[0])
            return x

        return run

    gemms = {"native": gemm("native", lambda r: r / 2), "torch": gemm("torch", lambda r: r if r < 2048 else r / 4)}
    rows, times = calibrate(gemms, 8, rows=(512, 1024, 2048), reps=3, clock=lambda: now[0])
    assert rows == 1024
    assert times[512] == {"native": 256e6, "torch": 512e6} and times[2048] == {"native": 1024e6, "torch": 512e6}
    assert calls[:4] == ["native", "torch", "native", "torch"] and len(calls) == 3 * 2 * 4  # one warm-up each


@pytest.mark.parametrize("kind", float_gemm_rows.KINDS)
def test_both_candidates_compute_the_same_product(kind, monkeypatch):
    calls = []

    class MklSpy:  # packed_linear's F: records which candidate reached F.linear (MKL)
        def linear(self, *args):
            calls.append(len(calls))
            return torch.nn.functional.linear(*args)

    monkeypatch.setattr(packed_linear, "F", MklSpy())
    gemms = candidates(48, 64, kind)
    x = torch.randn(600, 64)  # past both fixed defaults
    native = gemms["native"](x)
    assert calls == [], "the native candidate went to MKL"
    mkl = gemms["torch"](x)
    assert calls == [0]
    assert native.shape == (600, 48) and native.dtype == torch.float32
    torch.testing.assert_close(native, mkl, rtol=1e-5, atol=1e-5)


def test_route_follows_native_max_rows():
    w = torch.randn(32, 64)
    assert route(PACKED_MAX_ROWS + 1, PackedWeight(pack(w))) == "torch"
    assert route(PACKED_MAX_ROWS + 1, PackedWeight(pack(w), native_max_rows=1024)) == "panels"
    assert route(1024, PackedWeight(pack(w), native_max_rows=1024)) == "panels"
    assert route(1025, PackedWeight(pack(w), native_max_rows=1024)) == "torch"
    assert route(1, PackedWeight(pack(w), native_max_rows=UNBOUNDED)) == "torch"  # one row: MKL, as before
    blocks = pack_bf16(w.to(torch.bfloat16))
    assert route(BF16_MAX_ROWS + 1, PackedWeight(None, blocks)) == "torch"
    assert route(BF16_MAX_ROWS + 1, PackedWeight(None, blocks, native_max_rows=UNBOUNDED)) == "blocks"
    assert route(4096, PackedWeight(None, blocks, native_max_rows=2048)) == "torch"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_worker_measures_it_and_prefills_through_the_kernel(tmp_path, monkeypatch, dtype):
    """A tiny model's worker with the measurement forced to UNBOUNDED: its
    linears keep a 600-row prefill on the kernel, and the logits match a
    worker whose prefill went to MKL (--cpu-gemm native measures nothing)."""
    from model_utils import PagedEngine, save_tiny_hf_model
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    from executor_svc import machine
    from executor_svc.config import ExecutorConfig
    from executor_svc.worker import Worker

    save_tiny_hf_model("llama_tied", str(tmp_path), max_position_embeddings=1024)
    Tokenizer(WordLevel({"<unk>": 0}, unk_token="<unk>")).save(str(tmp_path / "tokenizer.json"))
    monkeypatch.setattr(machine, "cpu_has_fast_bf16", lambda: False)  # no bf16 routes: the float32 loops only
    asked = []

    def forced(gemms, in_features):
        asked.append(sorted(gemms))
        return UNBOUNDED, {}

    monkeypatch.setattr(float_gemm_rows, "calibrate", forced)
    # A forced result must not be stored where a real start would find it.
    monkeypatch.setattr(bf16_gemm_routes, "stored_or_measured", lambda key, measure: (*measure(), "measured"))
    measured = Worker(ExecutorConfig(model=str(tmp_path), dtype=dtype, kv_cache_gib=0.01))
    plain = Worker(ExecutorConfig(model=str(tmp_path), dtype=dtype, kv_cache_gib=0.01, cpu_gemm="native"))
    assert asked == [["native", "torch"]], "measured once per start and kind"
    packed = measured.model.layers[0].packed["gate_up"]
    assert packed.native_max_rows == UNBOUNDED and plain.model.layers[0].packed["gate_up"].native_max_rows == 0
    rows = 600  # past both fixed defaults
    assert (
        route(rows, packed) in ("panels", "blocks") and route(rows, plain.model.layers[0].packed["gate_up"]) == "torch"
    )
    prompt = [3 + i % 50 for i in range(rows)]
    logits = []
    for w in (measured, plain):
        engine = PagedEngine(w.model, num_blocks=48, block_size=16)
        logits.append(engine.step([(engine.add(prompt), len(prompt))])[0])
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-4, atol=1e-4)


def test_measured_only_under_auto_and_outside_deterministic():
    assert machine.measure_native_rows("auto", True)
    assert not machine.measure_native_rows("native", True)
    assert not machine.measure_native_rows("torch", False)
    assert not machine.measure_native_rows("auto", False)  # no kernel
    assert not machine.measure_native_rows("auto", True, deterministic=True)


def test_a_bf16_model_whose_hidden_width_is_not_whole_blocks_times_its_down_shape(tmp_path, monkeypatch):
    """hidden_size 48: gate/up's input is not whole BF16 blocks, so the bf16
    timing takes down's shape (input 160), the only weight kept in blocks."""
    from model_utils import save_tiny_hf_model
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    from executor_svc.config import ExecutorConfig
    from executor_svc.worker import Worker

    save_tiny_hf_model("llama_tied", str(tmp_path), hidden_size=48)
    Tokenizer(WordLevel({"<unk>": 0}, unk_token="<unk>")).save(str(tmp_path / "tokenizer.json"))
    monkeypatch.setattr(machine, "cpu_has_fast_bf16", lambda: False)
    shapes = []

    def forced(out_features, in_features, kind, seed=0):
        shapes.append((out_features, in_features, kind))
        return {"native": None, "torch": None}

    monkeypatch.setattr(float_gemm_rows, "candidates", forced)
    monkeypatch.setattr(float_gemm_rows, "calibrate", lambda gemms, in_features: (UNBOUNDED, {}))
    monkeypatch.setattr(bf16_gemm_routes, "stored_or_measured", lambda key, measure: (*measure(), "measured"))
    worker = Worker(ExecutorConfig(model=str(tmp_path), dtype="bfloat16", kv_cache_gib=0.01))
    assert shapes == [(48, 160, "bf16")]
    assert all(layer.packed["down"].native_max_rows == UNBOUNDED for layer in worker.model.layers)
