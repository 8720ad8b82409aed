"""Which GEMM takes each row count of a widened bfloat16 model on CPUs with
native bf16 (bf16_gemm_routes.py): the choice from timings (a fake clock, so
the machine's load cannot decide), the candidates themselves, and a Worker
that measured its routes serving through them (forced: this test does not
need a bf16 CPU; oneDNN and the dot kernel then emulate bf16)."""

from __future__ import annotations

import pytest
import torch

from executor_svc import bf16_gemm_routes, machine, onednn_linear, packed_linear
from executor_svc.bf16_gemm_routes import BF16_MARGIN, calibrate, candidate_names, candidates

pytestmark = pytest.mark.skipif(packed_linear.kernel() is None, reason="needs x86 AVX-512 and a C compiler")


class FakeClock:
    """Each stand-in GEMM advances it by its cost at the row count it is given
    and returns `product(x)`: by default all stand-ins agree (zeros)."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def gemm(self, cost, product=lambda x: torch.zeros(x.shape[0], 8)):
        def run(x):
            self.now += cost(x.shape[0])
            return product(x)

        return run


def test_each_row_count_goes_to_the_fastest_and_bf16_activations_need_a_margin():
    clock = FakeClock()
    gemms = {
        "blocks": clock.gemm(lambda r: 10.0 + r),
        "gguf": clock.gemm(lambda r: 4.0 + 2 * r),  # fewer bytes: wins while the read dominates
        "dot": clock.gemm(lambda r: 10.0 + r / 2),  # twice the multiply rate
        "onednn": clock.gemm(lambda r: 30.0 + r / 4 if r != 512 else 1e9),
    }
    routes, times = calibrate(gemms, 64, rows=(1, 2, 4, 8, 16, 64, 128, 512), reps=3, clock=clock)
    # 1-4: gguf (6..12 against dot's 10.5..12); 8: dot 14 vs gguf 20 and blocks 18;
    # 64: dot 42 vs onednn 46; 128: onednn 62 vs dot 74; 512: onednn's stand-in stalls.
    assert routes == ((1, "gguf"), (8, "dot"), (128, "onednn"), (512, "dot"))
    assert times[8] == {"blocks": 18e6, "gguf": 20e6, "dot": 14e6, "onednn": 32e6}

    # A bf16-activation GEMM inside the margin loses to the float32 arithmetic.
    close = {"blocks": clock.gemm(lambda r: 100.0), "dot": clock.gemm(lambda r: 100.0 / BF16_MARGIN * 1.001)}
    assert calibrate(close, 64, rows=(1, 8), reps=1, clock=clock)[0] == ((1, "blocks"),)
    clear = {"blocks": clock.gemm(lambda r: 100.0), "dot": clock.gemm(lambda r: 100.0 / BF16_MARGIN * 0.99)}
    assert calibrate(clear, 64, rows=(1, 8), reps=1, clock=clock)[0] == ((1, "dot"),)

    # oneDNN costs a second copy of the weights: inside the margin it loses to the fastest other GEMM.
    onednn_close = {
        "blocks": clock.gemm(lambda r: 300.0),
        "dot": clock.gemm(lambda r: 100.0),
        "onednn": clock.gemm(lambda r: 100.0 / BF16_MARGIN * 1.001),
    }
    assert calibrate(onednn_close, 64, rows=(1,), reps=1, clock=clock)[0] == ((1, "dot"),)
    onednn_clear = dict(onednn_close, onednn=clock.gemm(lambda r: 100.0 / BF16_MARGIN * 0.99))
    assert calibrate(onednn_clear, 64, rows=(1,), reps=1, clock=clock)[0] == ((1, "onednn"),)


def test_weights_that_outgrow_the_cache_are_timed_cold():
    """Where the model's weights outgrow the CPU's caches, every timed
    call (warm-ups included) follows an eviction, and no eviction is itself
    timed; where they fit (or no evictor is given) nothing is evicted."""
    assert bf16_gemm_routes.weights_outgrow_cache(64 << 20, 32 << 20)
    assert not bf16_gemm_routes.weights_outgrow_cache(16 << 20, 32 << 20)
    assert bf16_gemm_routes.weights_outgrow_cache(64 << 20, None)  # unknown: UNKNOWN_CACHE_BYTES, 32 MiB

    clock, events = FakeClock(), []

    def evict():
        events.append("evict")
        clock.now += 1e6  # an eviction that leaked into a timing would show in every time

    def traced(name, cost):
        gemm = clock.gemm(cost)
        return lambda x: (events.append(name), gemm(x))[1]

    gemms = {"blocks": traced("blocks", lambda r: 10.0), "gguf": traced("gguf", lambda r: 4.0)}
    routes, times = calibrate(gemms, 64, rows=(1, 8), reps=3, clock=clock, evict=evict)
    assert routes == ((1, "gguf"),) and times[1] == {"blocks": 10e6, "gguf": 4e6}
    # The timing loop's events: two row counts x (1 + reps) rounds x (evict, gemm) for two gemms.
    assert events[-32:] == ["evict", "blocks", "evict", "gguf"] * 8
    events.clear()
    calibrate(gemms, 64, rows=(1,), reps=1, clock=clock)
    assert "evict" not in events

    evictor = bf16_gemm_routes.cache_evictor(1 << 20)
    evictor()
    evictor()
    buffer = evictor.__closure__[0].cell_contents
    assert buffer.numel() * buffer.element_size() == 2 << 20 and bool((buffer == 2).all())


def test_cache_bytes_counts_each_l2_and_l3_instance_once(tmp_path):
    """Two CPUs with their own L1d and L2 sharing one L3, and sizes in each form sysfs uses."""
    layout = {
        0: [("1", "48K", "0"), ("2", "2048K", "0"), ("3", "32M", "0-1")],
        1: [("1", "48K", "1"), ("2", "2097152", "1"), ("3", "32M", "0-1")],
    }
    for cpu, caches in layout.items():
        for i, (level, size, shared) in enumerate(caches):
            d = tmp_path / f"cpu{cpu}" / "cache" / f"index{i}"
            d.mkdir(parents=True)
            (d / "level").write_text(level + "\n")
            (d / "size").write_text(size + "\n")
            (d / "shared_cpu_list").write_text(shared + "\n")
    assert machine.cache_bytes([0, 1], root=str(tmp_path)) == (2 + 2 + 32) << 20
    assert machine.cache_bytes([0], root=str(tmp_path)) == (2 + 32) << 20
    assert machine.cache_bytes([0], root=str(tmp_path / "missing")) is None
    # One level alone: the shared L3 once (decoder_stack.warm_bytes' budget), the L2s each.
    assert machine.cache_bytes([0, 1], root=str(tmp_path), levels=("3",)) == 32 << 20
    assert machine.cache_bytes([0, 1], root=str(tmp_path), levels=("2",)) == 4 << 20


def test_a_bf16_route_whose_product_is_wrong_is_never_chosen():
    """However fast: a dot kernel or oneDNN build that computes wrong (here a
    product off by a lost lane's worth, or NaN at one row count) is dropped
    before timing, with an error in the log; one within bf16 rounding stays."""
    from structlog.testing import capture_logs

    clock = FakeClock()
    weight = torch.randn(8, 64, dtype=torch.float64)

    def exact(x):
        return (x.double() @ weight.T).float()

    def wrong_at(count, how):
        return lambda x: how(exact(x)) if x.shape[0] == count else exact(x)

    gemms = {
        "blocks": clock.gemm(lambda r: 10.0, exact),
        "gguf": clock.gemm(lambda r: 9.0, lambda x: -exact(x)),  # a weight of its own: not compared
        "dot": clock.gemm(lambda r: 1.0, wrong_at(16, lambda y: y * 1.1)),
        "onednn": clock.gemm(lambda r: 2.0, wrong_at(1, lambda y: y.index_fill(1, torch.tensor([3]), float("nan")))),
    }
    with capture_logs() as logs:
        routes, times = calibrate(gemms, 64, rows=(1, 16), reps=1, clock=clock)
    assert routes == ((1, "gguf"),) and set(times[16]) == {"blocks", "gguf"}
    errors = {e["route"]: e for e in logs if e["event"] == "bf16_linear_route_disagrees"}
    assert set(errors) == {"dot", "onednn"} and errors["dot"]["rows"] == 16 and errors["onednn"]["rows"] == 1
    assert 0.09 < errors["dot"]["relative_error"] < 0.11

    rounded = {
        "blocks": clock.gemm(lambda r: 10.0, exact),
        "dot": clock.gemm(lambda r: 1.0, lambda x: exact(x.bfloat16().float())),
    }
    assert calibrate(rounded, 64, rows=(1, 16), reps=1, clock=clock)[0] == ((1, "dot"),)


def test_the_q4_1_dot_loop_is_checked_against_the_files_blocks():
    """gguf_dot multiplies the file's blocks, not the BF16 ones: it is kept
    where it agrees with gguf's product (however far both are from the BF16
    blocks'), dropped where it does not."""
    from structlog.testing import capture_logs

    clock = FakeClock()
    weight = torch.randn(8, 64, dtype=torch.float64)

    def exact(x):
        return (x.double() @ weight.T).float()

    def own(x):  # the file's weight: another weight altogether
        return -exact(x)

    for gguf_dot, kept in ((lambda x: own(x.bfloat16().float()), True), (exact, False)):
        gemms = {
            "blocks": clock.gemm(lambda r: 10.0, exact),
            "gguf": clock.gemm(lambda r: 9.0, own),
            "gguf_dot": clock.gemm(lambda r: 1.0, gguf_dot),
        }
        with capture_logs() as logs:
            routes, times = calibrate(gemms, 64, rows=(1,), reps=1, clock=clock)
        assert routes == (((1, "gguf_dot"),) if kept else ((1, "gguf"),))
        assert ("gguf_dot" in times[1]) == kept
        assert [e["route"] for e in logs if e["event"] == "bf16_linear_route_disagrees"] == (
            [] if kept else ["gguf_dot"]
        )


@pytest.mark.parametrize("gguf_kind", [None, "Q4_1", "Q8_0"])
def test_candidates_compute_the_same_product(gguf_kind):
    """Each candidate multiplies the same random weight (the file's blocks:
    random codes of their own, only shaped alike), by the route it names."""
    onednn = onednn_linear.available()
    gemms = candidates(96, 64, gguf_kind=gguf_kind, dot=True, onednn=onednn)
    names = candidate_names(gguf_kind=gguf_kind, dot=True, onednn=onednn)
    assert list(gemms) == names
    assert set(names) == {"blocks", "dot"} | ({"gguf"} if gguf_kind else set()) | (
        {"gguf_dot"} if gguf_kind == "Q4_1" else set()  # the dot loop reads Q4_1 blocks only
    ) | ({"onednn"} if onednn else set())
    x = torch.randn(5, 64)
    reference = gemms["blocks"](x)
    assert reference.shape == (5, 96) and reference.isfinite().all()
    for name in ("dot", "onednn"):
        if name in gemms:
            torch.testing.assert_close(gemms[name](x), reference, rtol=0, atol=0.05 * reference.abs().max().item())
    if gguf_kind:
        assert gemms["gguf"](x).isfinite().all()
    if "gguf_dot" in gemms:  # the file's weight, its own: the gguf route's product within bf16 rounding
        own = gemms["gguf"](x)
        torch.testing.assert_close(gemms["gguf_dot"](x), own, rtol=0, atol=0.05 * own.abs().max().item())
    routes, times = calibrate(gemms, 64, rows=(1, 16), reps=1)
    assert routes[0][0] == 1 and set(times) == {1, 16} and set(times[16]) == set(gemms)


def test_worker_on_a_fast_bf16_cpu_serves_through_its_measured_routes(tmp_path, monkeypatch):
    """--dtype auto on a CPU reporting native bf16 (forced): the widened
    model's linears take the measured routes (dot kernel for a few rows,
    oneDNN from 32 here), and their logits agree with the plain widened
    model's within bf16 activation rounding."""
    from model_utils import PagedEngine, save_tiny_hf_model
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    from executor_svc import machine
    from executor_svc.config import ExecutorConfig
    from executor_svc.worker import Worker

    if not onednn_linear.available():
        pytest.skip("this torch has no oneDNN packed linear")
    save_tiny_hf_model("llama_tied", str(tmp_path))
    Tokenizer(WordLevel({"<unk>": 0}, unk_token="<unk>")).save(str(tmp_path / "tokenizer.json"))
    monkeypatch.setattr(machine, "cpu_has_fast_bf16", lambda: True)
    routes = ((1, "dot"), (32, "onednn"))
    monkeypatch.setattr(bf16_gemm_routes, "calibrate", lambda *a, **k: (routes, {}))
    # Forced routes must not be stored where a real start would find them.
    monkeypatch.setattr(bf16_gemm_routes, "stored_or_measured", lambda key, measure: (*measure(), "measured"))
    routed = Worker(ExecutorConfig(model=str(tmp_path), kv_cache_gib=0.01))
    assert routed.dtype == torch.bfloat16 and routed.packed_gemm and routed.model.compute_dtype == torch.float32
    packed = routed.model.layers[0].packed["gate_up"]
    assert packed.bf16_routes == routes and packed.onednn is not None
    plain = Worker(ExecutorConfig(model=str(tmp_path), kv_cache_gib=0.01, cpu_gemm="native"))
    assert plain.model.layers[0].packed["gate_up"].bf16_routes == ()

    for length, how in ((37, "onednn"), (20, "dot")):
        assert packed_linear.route(length, packed) == how
        prompt = list(range(3, 3 + length))
        logits = []
        for w in (routed, plain):
            engine = PagedEngine(w.model, num_blocks=16, block_size=16)
            logits.append(engine.step([(engine.add(prompt), len(prompt))])[0])
        assert not torch.equal(logits[0], logits[1]), f"the prefill should have gone through {how}"
        torch.testing.assert_close(logits[0], logits[1], rtol=0, atol=0.05 * logits[1].abs().max().item())


def test_bench_times_every_candidate_and_names_a_route(monkeypatch, capsys):
    """bench.bf16_gemm, one layer, two row counts: a column per candidate
    (the emulated dot kernel included on CPUs without VDPBF16PS) and a route."""
    from bench import bf16_gemm

    monkeypatch.setattr(bf16_gemm, "LAYERS", 1)
    bf16_gemm.main(["--rows", "1,16", "--reps", "1", "--emulated-dot", "--num-threads", "1"])
    out = capsys.readouterr().out.splitlines()
    assert "bf16 flags:" in out[0]
    assert out[1].split()[:5] == ["rows", "blocks", "ms", "gguf", "ms"] and "dot ms" in out[1]
    for line, rows in zip(out[2:], (1, 16)):
        cells = line.split()
        assert int(cells[0]) == rows and cells[-1] in packed_linear.BF16_ROUTES
        assert all(float(c) > 0 for c in cells[1:-1])


def test_routes_are_measured_once_per_key_and_reused(tmp_path, monkeypatch):
    """The first start stores its routes; a second start with the same key
    reuses them without timing anything (so a restarted executor rounds as
    before), another key measures again, and a damaged file is measured over."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    calls = []

    def measure(routes):
        def run():
            calls.append(routes)
            return routes, {1: {"blocks": 1.0}}

        return run

    key = {"shape": [96, 64], "candidates": ["blocks", "dot"], "threads": 2}
    first = bf16_gemm_routes.stored_or_measured(key, measure(((1, "blocks"), (8, "dot"))))
    assert first == (((1, "blocks"), (8, "dot")), {1: {"blocks": 1.0}}, "measured")
    (stored,) = (tmp_path / "pagedserve" / "native").glob("bf16-routes-*.json")
    again = bf16_gemm_routes.stored_or_measured(key, measure(((1, "dot"),)))
    assert again == (((1, "blocks"), (8, "dot")), {}, "stored") and len(calls) == 1
    other = bf16_gemm_routes.stored_or_measured({**key, "threads": 1}, measure(((1, "dot"),)))
    assert other[0] == ((1, "dot"),) and other[2] == "measured" and len(calls) == 2

    stored.write_text("{not json")
    assert bf16_gemm_routes.stored_or_measured(key, measure(((1, "dot"),)))[0] == ((1, "dot"),)
    # A route the key's candidates do not name (an edited file) is not trusted either.
    stored.write_text(
        '{"key": {"shape": [96, 64], "candidates": ["blocks", "dot"], "threads": 2}, "routes": [[1, "onednn"]]}'
    )
    assert bf16_gemm_routes.stored_or_measured(key, measure(((1, "blocks"),)))[2] == "measured"
    assert bf16_gemm_routes.stored_or_measured(key, measure(((1, "dot"),)))[0] == ((1, "blocks"),)


def _start_concurrently(cache: str, mine: tuple, out) -> None:
    """A second executor starting at the same moment (a forked process)."""
    import os
    import time

    os.environ["XDG_CACHE_HOME"] = cache

    def measure():
        time.sleep(0.5)  # long enough for the other process to arrive while this one measures
        return mine, {}

    routes, _, source = bf16_gemm_routes.stored_or_measured({"k": 1, "candidates": ["blocks", "dot"]}, measure)
    out.put((routes, source))


def test_processes_starting_together_share_one_measurement(tmp_path):
    """Two tensor-parallel ranks on one host: one measures, the other waits for
    its routes instead of measuring (and picking others) at the same time."""
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    procs = [
        ctx.Process(target=_start_concurrently, args=(str(tmp_path), mine, out))
        for mine in (((1, "blocks"),), ((1, "dot"),))
    ]
    for p in procs:
        p.start()
    results = [out.get(timeout=30) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    assert sorted(source for _, source in results) == ["measured", "stored"]
    assert results[0][0] == results[1][0]
