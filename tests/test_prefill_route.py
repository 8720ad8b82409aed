"""Prefill attention over a bfloat16 KV cache through SDPA in bf16 (route
"sdpa") or the native kernel, and the start-up measurement that picks one on
CPUs with native bf16 (executor_svc/attention/prefill_route.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from executor_svc.attention import native_kernel, prefill_route
from executor_svc.attention.cpu_backend import PREFILL_ROUTES, CpuAttentionBackend
from executor_svc.attention.reference import make_batch
from executor_svc.attention.torch_backend import TorchAttentionBackend
from executor_svc.config import ExecutorConfig

pytestmark = pytest.mark.skipif(
    native_kernel.load() is None or native_kernel.load_prefill() is None, reason="needs the native attention kernels"
)
# Two prompts, a chunk continuing a cached one, and decodes beside them.
SHAPES = [(0, 37), (0, 70), (40, 29), (55, 1), (130, 1)]


def backend(route: str, batch_invariant: bool = False) -> CpuAttentionBackend:
    return CpuAttentionBackend(
        native_kernel.load(), native_kernel.load_prefill(), batch_invariant=batch_invariant, prefill_route=route
    )


def run(route: str, dtype: torch.dtype):
    batch = make_batch(SHAPES, block_size=16, num_kv_heads=2, group=3, head_dim=64, dtype=dtype, seed=3)
    # float32 queries, as a widened bf16 model's are (make_batch's are bf16-valued)
    query = torch.randn(batch.query.shape, generator=torch.Generator().manual_seed(4))
    batch = dataclasses.replace(batch, query=query)
    b, meta = backend(route), dataclasses.replace(batch.meta, extra={})
    b.write_kv(batch.new_key, batch.new_value, batch.k_cache, batch.v_cache, meta)
    b.prepare(meta)
    return batch, b.forward(batch.query, batch.k_cache, batch.v_cache, meta, batch.scale)


def test_sdpa_route_on_a_bf16_cache_is_attention_within_bf16_rounding():
    """Against float64 attention over the cache's values: the prefills differ
    from the native kernel's (queries rounded to bf16), within that rounding;
    the decodes take the decode kernel either way, bit for bit."""
    batch, sdpa = run("sdpa", torch.bfloat16)
    _, native = run("native", torch.bfloat16)
    exact = batch.expected(torch.float64)
    prefill_rows = torch.cat([torch.arange(0, 37), torch.arange(37, 107), torch.arange(107, 136)])
    decode_rows = torch.tensor([136, 137])
    err = (sdpa.double() - exact).abs()[prefill_rows].max().item()
    assert 1e-4 < err < 0.05, f"{err}: bf16 arithmetic should show, within its rounding"
    assert (native.double() - exact).abs()[prefill_rows].max().item() < 1e-4
    assert not torch.equal(sdpa[prefill_rows], native[prefill_rows]), "the prefills should have gone through SDPA"
    assert torch.equal(sdpa[decode_rows], native[decode_rows])


def test_a_float32_cache_keeps_the_kernel_whatever_the_route():
    assert torch.equal(run("sdpa", torch.float32)[1], run("native", torch.float32)[1])


def test_routes_are_checked():
    with pytest.raises(ValueError, match="prefill route"):
        backend("flash")
    with pytest.raises(ValueError, match="batch-invariant"):
        backend("sdpa", batch_invariant=True)
    with pytest.raises(ValueError, match="prefill-attention sdpa"):
        ExecutorConfig(deterministic=True, prefill_attention="sdpa")
    # An explicit route chooses within the cpu backend only.
    for elsewhere in ({"attention_backend": "torch"}, {"attention_backend": "triton"}, {"device": "cuda"}):
        for route in PREFILL_ROUTES:
            with pytest.raises(ValueError, match="within the cpu attention backend"):
                ExecutorConfig(prefill_attention=route, **elsewhere)
        assert ExecutorConfig(prefill_attention="auto", **elsewhere).prefill_attention == "auto"
    field = next(f for f in dataclasses.fields(ExecutorConfig) if f.name == "prefill_attention")
    from shared.config_fields import _KEY

    assert tuple(field.metadata[_KEY].choices) == ("auto", *PREFILL_ROUTES)


class FakeBackend:
    """Costs `cost` seconds of a shared fake clock per forward."""

    def __init__(self, cost: float, now: list[float]):
        self.cost, self.now, self.calls = cost, now, 0

    def write_kv(self, *args):
        pass

    def prepare(self, meta):
        pass

    def forward(self, *args):
        self.calls += 1
        self.now[0] += self.cost


@pytest.mark.parametrize(("sdpa_cost", "expected"), [(0.90, "sdpa"), (0.97, "native"), (1.20, "native")])
def test_sdpa_must_win_by_the_margin(sdpa_cost, expected):
    now = [0.0]
    fakes = {"native": FakeBackend(1.0, now), "sdpa": FakeBackend(sdpa_cost, now)}
    route, times = prefill_route.calibrate(fakes, 6, 2, 64, reps=3, clock=lambda: now[0])
    assert route == expected
    assert times == {"native": 1e6, "sdpa": round(sdpa_cost * 1e6, 1)}
    assert fakes["native"].calls == fakes["sdpa"].calls == 4  # a warm-up, then 3 timed


def test_the_real_candidates_time_and_name_a_route():
    backends = {name: backend(name) for name in PREFILL_ROUTES}
    route, times = prefill_route.calibrate(backends, 6, 2, 64, reps=1)
    assert route in PREFILL_ROUTES and set(times) == set(PREFILL_ROUTES) and min(times.values()) > 0


def test_auto_measures_only_where_bf16_is_native(monkeypatch):
    """And start-up says which route is in force, and why, on every CPU backend."""
    from structlog.testing import capture_logs

    measured = []
    monkeypatch.setattr(prefill_route, "measure", lambda *shape: measured.append(shape) or "sdpa")

    def apply(option, kv_dtype=torch.bfloat16, fast_bf16=True, target=None):
        target = target if target is not None else backend("native")
        with capture_logs() as logs:
            prefill_route.apply(option, target, kv_dtype, fast_bf16, 6, 2, 64)
        lines = [(e["route"], e["why"]) for e in logs if e["event"] == "prefill_attention_route"]
        return getattr(target, "prefill_route", None), lines

    assert apply("auto", fast_bf16=False) == ("native", [("native", "no native bf16")])
    assert apply("auto", kv_dtype=torch.float32) == ("native", [("native", "float32 cache")])
    assert apply("sdpa", kv_dtype=torch.float32) == ("native", [("native", "float32 cache")])
    assert apply("auto", target=backend("native", batch_invariant=True)) == ("native", [("native", "deterministic")])
    assert apply("auto", target=TorchAttentionBackend()) == (None, [])
    assert measured == []
    assert apply("auto") == ("sdpa", [("sdpa", "timed")]) and measured == [(6, 2, 64)]
    assert apply("sdpa", fast_bf16=False) == ("sdpa", [("sdpa", "option")])
    assert apply("native") == ("native", [("native", "option")]) and len(measured) == 1


def test_measure_is_stored_and_reused(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    calls = []
    monkeypatch.setattr(prefill_route, "calibrate", lambda *a, **k: calls.append(a) or ("sdpa", {"sdpa": 1.0}))
    assert prefill_route.measure(6, 2, 64) == "sdpa" and len(calls) == 1
    assert prefill_route.measure(6, 2, 64) == "sdpa" and len(calls) == 1  # read back, not timed
    monkeypatch.setattr(prefill_route, "calibrate", lambda *a, **k: calls.append(a) or ("native", {}))
    assert prefill_route.measure(6, 1, 64) == "native" and len(calls) == 2  # another shape: timed


def test_a_bf16_worker_serves_prefills_through_the_forced_route(tmp_path):
    """--prefill-attention sdpa reaches the model's layers: the prefill's
    logits move by bf16 rounding of the queries, no more."""
    from model_utils import PagedEngine, save_tiny_hf_model
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    from executor_svc.worker import Worker

    save_tiny_hf_model("llama_tied", str(tmp_path), head_dim=64)
    Tokenizer(WordLevel({"<unk>": 0}, unk_token="<unk>")).save(str(tmp_path / "tokenizer.json"))
    logits = {}
    for route in PREFILL_ROUTES:
        w = Worker(ExecutorConfig(model=str(tmp_path), dtype="bfloat16", kv_cache_gib=0.01, prefill_attention=route))
        assert w.attn_backend.prefill_route == route
        engine = PagedEngine(w.model, num_blocks=16, block_size=16)
        prompt = list(range(3, 60))
        logits[route] = engine.step([(engine.add(prompt), len(prompt))])[0]
    assert not torch.equal(logits["sdpa"], logits["native"])
    scale = logits["native"].abs().max().item()
    torch.testing.assert_close(logits["sdpa"], logits["native"], rtol=0, atol=0.05 * scale)
