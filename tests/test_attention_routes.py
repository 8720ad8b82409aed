"""Attention over a bfloat16 KV cache in bf16 arithmetic or float32: prefills
through SDPA in bf16 (route "sdpa") or the native kernel, decodes through the
kernel's VDPBF16PS path (route "dot") or widened, and the start-up
measurement that picks each on CPUs with native bf16
(executor_svc/attention/routes.py). The dot kernel itself:
tests/test_decode_dot.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from executor_svc.attention import native_kernel, routes
from executor_svc.attention.cpu_backend import DECODE_ROUTES, PREFILL_ROUTES, CpuAttentionBackend
from executor_svc.attention.reference import make_batch
from executor_svc.attention.torch_backend import TorchAttentionBackend
from executor_svc.config import ExecutorConfig

pytestmark = pytest.mark.skipif(
    native_kernel.load() is None or native_kernel.load_prefill() is None, reason="needs the native attention kernels"
)
# Two prompts, a chunk continuing a cached one, and decodes beside them.
SHAPES = [(0, 37), (0, 70), (40, 29), (55, 1), (130, 1)]


def backend(route: str = "native", batch_invariant: bool = False, decode: str = "widen") -> CpuAttentionBackend:
    return CpuAttentionBackend(
        native_kernel.load(),
        native_kernel.load_prefill(),
        batch_invariant=batch_invariant,
        prefill_route=route,
        decode_route=decode,
        dot_native=native_kernel.dot_native(),
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
    with pytest.raises(ValueError, match="decode route"):
        backend(decode="vnni")
    with pytest.raises(ValueError, match="batch-invariant"):
        backend(batch_invariant=True, decode="dot")
    with pytest.raises(ValueError, match="prefill-attention sdpa"):
        ExecutorConfig(deterministic=True, prefill_attention="sdpa")
    with pytest.raises(ValueError, match="decode-attention dot"):
        ExecutorConfig(deterministic=True, decode_attention="dot")
    from shared.config_fields import _KEY

    for option, choices in (("prefill_attention", PREFILL_ROUTES), ("decode_attention", DECODE_ROUTES)):
        # An explicit route chooses within the cpu backend only.
        for elsewhere in ({"attention_backend": "torch"}, {"attention_backend": "triton"}, {"device": "cuda"}):
            for route in choices:
                with pytest.raises(ValueError, match="within the cpu attention backend"):
                    ExecutorConfig(**{option: route}, **elsewhere)
            assert getattr(ExecutorConfig(**{option: "auto"}, **elsewhere), option) == "auto"
        field = next(f for f in dataclasses.fields(ExecutorConfig) if f.name == option)
        assert tuple(field.metadata[_KEY].choices) == ("auto", *choices)


class FakeBackend:
    """Costs `cost` seconds of a shared fake clock per forward, and returns
    `output` (the same for every fake unless given)."""

    def __init__(self, cost: float, now: list[float], output: torch.Tensor | None = None):
        self.cost, self.now, self.calls = cost, now, 0
        self.output = torch.ones(4, 6, 64) if output is None else output

    def write_kv(self, *args):
        pass

    def prepare(self, meta):
        pass

    def forward(self, *args):
        self.calls += 1
        self.now[0] += self.cost
        return self.output


@pytest.mark.parametrize("kind", [routes.PREFILL, routes.DECODE], ids=["prefill", "decode"])
@pytest.mark.parametrize(("bf16_cost", "wins"), [(0.90, True), (0.97, False), (1.20, False)])
def test_the_bf16_candidate_must_win_by_the_margin(kind, bf16_cost, wins):
    default, bf16 = kind.routes[:2]
    now = [0.0]
    fakes = {default: FakeBackend(1.0, now), bf16: FakeBackend(bf16_cost, now)}
    route, times = routes.calibrate(kind, fakes, 6, 2, 64, reps=3, clock=lambda: now[0])
    assert route == (bf16 if wins else default)
    assert times == {default: 1e6, bf16: round(bf16_cost * 1e6, 1)}
    assert fakes[default].calls == fakes[bf16].calls == 5  # agreement, a warm-up, then 3 timed


@pytest.mark.parametrize("kind", [routes.PREFILL, routes.DECODE], ids=["prefill", "decode"])
def test_a_candidate_whose_output_is_wrong_is_never_chosen(kind):
    """However fast: a dot path or SDPA that computes wrong (a wrong build or
    CPU) is dropped before timing, with an error in the log; one within bf16
    rounding of the default stays in the race."""
    from structlog.testing import capture_logs

    default, bf16 = kind.routes[:2]
    now = [0.0]
    good = torch.randn(4, 6, 64)
    for output, wins in (
        (good * 1.1, False),
        (good.index_fill(0, torch.tensor([2]), float("nan")), False),
        (good.bfloat16().float(), True),
    ):
        fakes = {default: FakeBackend(1.0, now, good), bf16: FakeBackend(0.5, now, output)}
        with capture_logs() as logs:
            route, times = routes.calibrate(kind, fakes, 6, 2, 64, reps=3, clock=lambda: now[0])
        assert route == (bf16 if wins else default)
        dropped = [e for e in logs if e["event"] == f"{kind.name}_attention_route_disagrees"]
        assert (not dropped) if wins else (dropped[0]["route"] == bf16 and fakes[bf16].calls == 1)


def test_the_fastest_of_several_candidates_is_kept():
    now = [0.0]
    costs = {"native": 1.0, "sdpa": 0.93, "dot": 0.8}
    fakes = {name: FakeBackend(cost, now) for name, cost in costs.items()}
    assert routes.calibrate(routes.PREFILL, fakes, 6, 2, 64, reps=3, clock=lambda: now[0])[0] == "dot"
    fakes["dot"].cost = 1.1
    assert routes.calibrate(routes.PREFILL, fakes, 6, 2, 64, reps=3, clock=lambda: now[0])[0] == "sdpa"


def test_the_real_candidates_time_and_name_a_route():
    dot = {
        routes.PREFILL: native_kernel.prefill_dot_supported(6, 2, 64),
        routes.DECODE: native_kernel.dot_supported(6, 2, 64),
    }
    for kind in (routes.PREFILL, routes.DECODE):
        names = [name for name in kind.routes if name != "dot" or dot[kind]]
        if len(names) < 2:
            continue
        backends = {name: routes._backend(kind, name) for name in names}
        route, times = routes.calibrate(kind, backends, 6, 2, 64, reps=1)
        assert route in kind.routes and set(times) == set(kind.routes) and min(times.values()) > 0


def test_auto_measures_only_where_bf16_is_native(monkeypatch):
    """And start-up says which routes are in force, and why, on every CPU backend."""
    from structlog.testing import capture_logs

    measured = []

    def fake_measure(kind, candidates, *shape):
        measured.append((kind.name, candidates, *shape))
        return candidates[-1]

    monkeypatch.setattr(routes, "measure", fake_measure)
    monkeypatch.setattr(native_kernel, "dot_native", lambda: dot_native[0])
    dot_native = [True]
    # The kernel's dot instances as on any AVX-512BW build, whatever this CPU has.
    monkeypatch.setattr(native_kernel, "dot_supported", lambda heads, kv_heads, dim: dim in (64, 128))
    monkeypatch.setattr(native_kernel, "prefill_dot_supported", lambda heads, kv_heads, dim: dim in (64, 128))
    with_dot = dataclasses.replace(native_kernel.load_prefill(), dot_native=True)  # as on a CPU with the instruction
    monkeypatch.setattr(native_kernel, "load_prefill", lambda: with_dot)

    def apply(
        prefill, decode="widen", kv_dtype=torch.bfloat16, fast_bf16=True, target=None, shape=(6, 2, 64), model=None
    ):
        target = target if target is not None else backend()
        with capture_logs() as logs:
            routes.apply(prefill, decode, target, kv_dtype, model or kv_dtype, fast_bf16, *shape)
        lines = [(e["event"].split("_")[0], e["route"], e["why"]) for e in logs if e["event"].endswith("_route")]
        return getattr(target, "prefill_route", None), getattr(target, "decode_route", None), lines

    def said(prefill, decode):
        return [("prefill", *prefill), ("decode", *decode)]

    assert apply("auto", fast_bf16=False) == (
        "native",
        "widen",
        said(("native", "no native bf16"), ("widen", "option")),
    )
    f32 = said(("native", "float32 cache"), ("widen", "float32 cache"))
    assert apply("auto", "auto", kv_dtype=torch.float32) == ("native", "widen", f32)
    assert apply("sdpa", "dot", kv_dtype=torch.float32) == ("native", "widen", f32)
    det = said(("native", "deterministic"), ("widen", "deterministic"))
    assert apply("auto", "auto", target=backend(batch_invariant=True)) == ("native", "widen", det)
    assert apply("auto", "auto", target=TorchAttentionBackend()) == (None, None, [])
    for asked in (("sdpa", "auto"), ("auto", "dot")):  # the cpu backend fell back to torch, or the device is CUDA
        with pytest.raises(ValueError, match="needs the cpu attention backend; this executor runs torch"):
            apply(*asked, target=TorchAttentionBackend())
    f32_model = said(("native", "float32 model"), ("widen", "float32 model"))
    assert apply("auto", "auto", model=torch.float32) == ("native", "widen", f32_model)
    assert apply("sdpa", "dot", model=torch.float32)[:2] == ("sdpa", "dot")  # as asked
    dot_native[0] = False
    no_dot = ("widen", "no AVX512-BF16")
    assert apply("native", "auto") == ("native", "widen", said(("native", "option"), no_dot))
    dot_native[0] = True
    no_shape = ("widen", "no bf16 dot instance for this shape")
    assert apply("native", "auto", shape=(2, 2, 32)) == ("native", "widen", said(("native", "option"), no_shape))
    assert measured == []
    timed = said(("dot", "timed"), ("dot", "timed"))
    assert apply("auto", "auto") == ("dot", "dot", timed)
    assert measured == [("prefill", ("sdpa", "dot"), 6, 2, 64), ("decode", ("dot",), 6, 2, 64)]
    assert apply("sdpa", "dot", fast_bf16=False) == ("sdpa", "dot", said(("sdpa", "option"), ("dot", "option")))
    assert apply("native", "widen") == ("native", "widen", said(("native", "option"), ("widen", "option")))
    assert len(measured) == 2
    with pytest.raises(ValueError, match="no bf16 dot path for 2 query heads over 2 KV heads of 32"):
        apply("native", "dot", shape=(2, 2, 32))


def test_auto_never_builds_the_dot_kernels_where_bf16_is_emulated(monkeypatch):
    """The decode kernel's dot build doubles its compile time: a start on a
    CPU without AVX512-BF16 and without an explicit "dot" must not pay it."""
    monkeypatch.setattr(native_kernel, "cpu_flags", lambda: frozenset({"avx512f", "avx512bw"}))
    monkeypatch.setattr(native_kernel, "_dot_library", lambda: pytest.fail("the dot build was compiled"))
    native_kernel.dot_native.cache_clear()
    try:
        for kv_dtype, model_dtype in ((torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32)):
            for fast_bf16 in (False, True):  # AMX without AVX512-BF16: SDPA may still be timed
                target = backend()
                monkeypatch.setattr(routes, "measure", lambda kind, candidates, *shape: kind.routes[0])
                routes.apply("auto", "auto", target, kv_dtype, model_dtype, fast_bf16, 9, 3, 64)
                assert (target.prefill_route, target.decode_route) == ("native", "widen")
    finally:
        native_kernel.dot_native.cache_clear()


def test_measure_is_stored_and_reused(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    calls = []
    monkeypatch.setattr(routes, "calibrate", lambda *a, **k: calls.append(a) or ("sdpa", {"sdpa": 1.0}))
    assert routes.measure(routes.PREFILL, ("sdpa",), 6, 2, 64) == "sdpa" and len(calls) == 1
    assert routes.measure(routes.PREFILL, ("sdpa",), 6, 2, 64) == "sdpa" and len(calls) == 1  # read back, not timed
    monkeypatch.setattr(routes, "calibrate", lambda *a, **k: calls.append(a) or ("native", {}))
    assert routes.measure(routes.PREFILL, ("sdpa",), 6, 1, 64) == "native" and len(calls) == 2  # another shape
    assert routes.measure(routes.PREFILL, ("sdpa", "dot"), 6, 2, 64) == "native" and len(calls) == 3  # candidates
    assert set(calls[-1][1]) == {"native", "sdpa", "dot"}  # the backends timed
    monkeypatch.setattr(routes, "calibrate", lambda *a, **k: calls.append(a) or ("dot", {}))
    assert routes.measure(routes.DECODE, ("dot",), 6, 2, 64) == "dot" and len(calls) == 4  # another kind: timed
    assert routes.measure(routes.DECODE, ("dot",), 6, 2, 64) == "dot" and len(calls) == 4


def test_a_bf16_worker_serves_prefills_through_the_forced_route(tmp_path, monkeypatch):
    """--prefill-attention sdpa and dot reach the model's layers: the
    prefill's logits move by bf16 rounding, no more."""
    from model_utils import PagedEngine, save_tiny_hf_model
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    from executor_svc.worker import Worker

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # no stored routes of the user's
    save_tiny_hf_model("llama_tied", str(tmp_path), head_dim=64)
    Tokenizer(WordLevel({"<unk>": 0}, unk_token="<unk>")).save(str(tmp_path / "tokenizer.json"))
    logits = {}
    names = [r for r in PREFILL_ROUTES if r != "dot" or native_kernel.prefill_dot_supported(4, 2, 64)]
    for route in names:
        config = ExecutorConfig(
            model=str(tmp_path), dtype="bfloat16", kv_cache_gib=0.01, prefill_attention=route, decode_attention="widen"
        )
        w = Worker(config)
        assert w.attn_backend.prefill_route == route
        engine = PagedEngine(w.model, num_blocks=16, block_size=16)
        prompt = list(range(3, 60))
        logits[route] = engine.step([(engine.add(prompt), len(prompt))])[0]
    scale = logits["native"].abs().max().item()
    for bf16_route in names[1:]:
        assert not torch.equal(logits[bf16_route], logits["native"])
        torch.testing.assert_close(logits[bf16_route], logits["native"], rtol=0, atol=0.05 * scale)


def test_a_bf16_worker_serves_decodes_through_the_forced_route(tmp_path, monkeypatch):
    """--decode-attention dot reaches the model's layers (emulated on CPUs
    without AVX512-BF16): a decode's logits move by bf16 rounding of the
    queries and probabilities, no more; the prompt's prefill is unchanged."""
    from model_utils import PagedEngine, save_tiny_hf_model
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    from executor_svc.worker import Worker

    if not native_kernel.dot_supported(4, 2, 64):
        pytest.skip("the decode kernel's dot path needs AVX-512BW")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # no stored routes of the user's
    save_tiny_hf_model("llama_tied", str(tmp_path), head_dim=64)
    Tokenizer(WordLevel({"<unk>": 0}, unk_token="<unk>")).save(str(tmp_path / "tokenizer.json"))
    logits = {}
    for route in DECODE_ROUTES:
        config = ExecutorConfig(
            model=str(tmp_path), dtype="bfloat16", kv_cache_gib=0.01, prefill_attention="native", decode_attention=route
        )
        w = Worker(config)
        assert w.attn_backend.decode_route == route
        engine = PagedEngine(w.model, num_blocks=16, block_size=16)
        prompt = list(range(3, 60))
        seq = engine.add(prompt + [7])
        logits[route] = (engine.step([(seq, len(prompt))])[0], engine.step([(seq, 1)])[0])
    assert torch.equal(logits["dot"][0], logits["widen"][0])
    assert not torch.equal(logits["dot"][1], logits["widen"][1])
    scale = logits["widen"][1].abs().max().item()
    torch.testing.assert_close(logits["dot"][1], logits["widen"][1], rtol=0, atol=0.05 * scale)


def test_the_dot_build_is_prebuilt_exactly_where_apply_loads_it(monkeypatch):
    """decode_dot_build_needed (asked before the model loads, to compile the
    decode kernel's dot build beside the others) against what apply does:
    over every option, backend, cache and model dtype, --deterministic and
    CPU, it says yes exactly where apply then loads that build."""
    import itertools
    from types import SimpleNamespace

    fake = SimpleNamespace(paged_decode_dot_native=lambda: 1, paged_decode_dot_built=lambda: 1)
    targets = {"cpu": backend(), "cpu-invariant": backend(batch_invariant=True)}
    for target in targets.values():  # record the routes instead of swapping kernels
        monkeypatch.setattr(target, "use_prefill_route", lambda route: None)
        monkeypatch.setattr(target, "use_decode_route", lambda route: None)
    monkeypatch.setattr(routes, "measure", lambda kind, candidates, *shape: kind.routes[0])
    bf16, f32 = torch.bfloat16, torch.float32
    checked = 0
    try:
        for option, name, kv, model, deterministic, flag in itertools.product(
            ("auto", "widen", "dot"), ("cpu", "torch"), (bf16, f32), (bf16, f32), (False, True), (False, True)
        ):
            if deterministic and option != "auto" or name == "torch" and option != "auto":
                continue  # refused by the config before any of this
            flags = frozenset({"avx512f", "avx512bw"} | ({"avx512_bf16"} if flag else set()))
            monkeypatch.setattr(native_kernel, "cpu_flags", lambda flags=flags: flags)
            monkeypatch.setattr(routes, "cpu_flags", lambda flags=flags: flags)
            loads = []
            monkeypatch.setattr(native_kernel, "_dot_library", lambda loads=loads: loads.append(1) or fake)
            native_kernel.dot_native.cache_clear()
            cpu = targets["cpu-invariant" if deterministic else "cpu"]
            target = TorchAttentionBackend() if name == "torch" else cpu
            routes.apply("auto", option, target, kv, model, flag, 9, 3, 64)
            predicted = routes.decode_dot_build_needed(option, name, kv, model, deterministic)
            assert predicted == bool(loads), (option, name, kv, model, deterministic, flag)
            checked += predicted
    finally:
        native_kernel.dot_native.cache_clear()
    assert checked == 5  # explicit dot over a bf16 cache (either model, either CPU), and auto's own case
