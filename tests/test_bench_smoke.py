"""The benchmark harness works: workloads, accounting, and a tiny run of every suite.

One real engine (both processes, the embedded model) serves all four suites
through `--target`, with a handful of short requests each, so the harness's
gRPC path, result files and charts are exercised in well under a minute of
model time. The HF baseline runs on a tiny random Llama, not the real model:
what is under test is the static-batch bookkeeping, not the model.
"""

from __future__ import annotations

import json
import math
import sys

import pytest
import torch

from bench import hf_baseline, memory
from bench.__main__ import main as bench_main
from bench.driver import RequestRecord, percentile
from bench.workloads import (
    BenchRequest,
    check_fits,
    long_tail_workload,
    poisson_arrivals,
    read_jsonl,
    shared_prefix_workload,
    uniform_workload,
)
from pagedserve.v1 import generation_pb2 as pb
from tests.servers import Servers

VOCAB = 49152


def test_uniform_workload_is_seeded_and_within_ranges():
    a = uniform_workload(20, (64, 512), (32, 256), VOCAB, seed=3)
    assert a == uniform_workload(20, (64, 512), (32, 256), VOCAB, seed=3)
    assert a != uniform_workload(20, (64, 512), (32, 256), VOCAB, seed=4)
    assert all(64 <= r.prompt_len <= 512 and 32 <= r.max_tokens <= 256 for r in a)
    assert all(100 <= t < VOCAB for r in a for t in r.prompt_token_ids)


def test_long_tail_workload_has_a_tail():
    w = long_tail_workload(400, VOCAB, seed=0)
    prompts = sorted(r.prompt_len for r in w)
    assert prompts[-1] > 3 * prompts[len(prompts) // 2], "the longest prompts should be far above the median"
    assert all(r.prompt_len <= 1024 and r.max_tokens <= 512 for r in w)


def test_shared_prefix_workload_shares_exactly_the_prefix():
    w = shared_prefix_workload(5, 64, (4, 8), 3, VOCAB, seed=1)
    assert all(r.prompt_token_ids[:64] == w[0].prompt_token_ids[:64] for r in w)
    assert len({tuple(r.prompt_token_ids[64:]) for r in w}) == 5


def test_read_jsonl_accepts_ids_and_text_and_names_bad_lines(tmp_path):
    good = tmp_path / "w.jsonl"
    good.write_text('{"prompt_token_ids": [5, 6, 7], "max_tokens": 4}\n\n{"prompt": "hello", "max_tokens": 2}\n')
    reqs = read_jsonl(str(good))
    assert reqs[0] == BenchRequest(max_tokens=4, prompt_token_ids=[5, 6, 7])
    assert reqs[1] == BenchRequest(max_tokens=2, prompt="hello")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "x", "max_tokens": 1}\n{"prompt": "no max_tokens"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        read_jsonl(str(bad))


def test_check_fits_rejects_requests_past_the_context():
    with pytest.raises(ValueError, match="request 1"):
        check_fits([BenchRequest(4, [1] * 10), BenchRequest(8, [1] * 10)], max_model_len=16, vocab_size=VOCAB)


def test_poisson_arrivals_mean_gap_and_burst():
    times = poisson_arrivals(2000, rate=4.0, seed=0)
    assert times == sorted(times) and times[0] == 0.0
    assert times[-1] / (len(times) - 1) == pytest.approx(0.25, rel=0.1)
    assert poisson_arrivals(3, math.inf) == [0.0, 0.0, 0.0]


def test_latency_definitions():
    rec = RequestRecord(
        index=0,
        max_tokens=4,
        sent_at=1.0,
        chunk_times=[1.5, 1.6, 2.0],
        chunk_tokens=[1, 2, 1],
        finished_at=2.0,
        output_tokens=4,
    )
    assert rec.ttft == pytest.approx(0.5)
    assert rec.e2e == pytest.approx(1.0)
    assert rec.tpot == pytest.approx(0.5 / 3)
    assert rec.itls == pytest.approx([0.1, 0.4])
    assert percentile([1, 2, 3, 4], 50) == 2.5 and percentile([7], 99) == 7


def test_serve_reports_medians_over_rounds():
    from bench.serve import median_over_rounds

    rounds = [
        {"rate": 2.0, "ttft": {"p50": t}, "goodput": {"ttft_slo_s": 1.0, "fraction": f}}
        for t, f in ((1.0, 0.5), (9.0, 1.0), (3.0, 0.75))
    ]
    assert median_over_rounds(rounds) == {
        "rate": 2.0,
        "ttft": {"p50": 3.0},
        "goodput": {"ttft_slo_s": 1.0, "fraction": 0.75},
    }


def test_memory_waste_accounting():
    status = pb.ServerStatus(
        kv_blocks_used=5,
        requests=[
            pb.RequestSummary(
                request_id="m-0", status=pb.REQUEST_STATUS_RUNNING, prompt_tokens=20, computed_tokens=24, kv_blocks=2
            ),
            pb.RequestSummary(
                request_id="m-1", status=pb.REQUEST_STATUS_RUNNING, prompt_tokens=40, computed_tokens=40, kv_blocks=3
            ),
            pb.RequestSummary(request_id="m-2", status=pb.REQUEST_STATUS_WAITING, prompt_tokens=99),
        ],
    )
    s = memory.sample_stats(status, {"m-0": 10, "m-1": 30, "m-2": 5}, block_size=16, max_model_len=100)
    assert s["num_running"] == 2 and s["held_tokens"] == 64
    assert s["paged_waste"] == pytest.approx(1 - 64 / 80)
    assert s["reserve_waste"] == pytest.approx(1 - 64 / 100)
    assert s["reserve_max_waste"] == pytest.approx(1 - 64 / 200)


def test_hf_static_batches_count_only_useful_tokens():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=300,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=128,
        )
    )
    reqs = uniform_workload(5, (3, 9), (1, 6), 300, seed=2)
    batches = []
    r = hf_baseline.run_static_batches(model.eval(), reqs, batch_size=2, on_batch=batches.append)
    assert batches == [2, 2, 1]
    assert r["useful_output_tokens"] == sum(q.max_tokens for q in reqs)
    assert r["generated_tokens"] == sum(
        len(reqs[i : i + 2]) * max(q.max_tokens for q in reqs[i : i + 2]) for i in range(0, 5, 2)
    )
    assert r["output_tokens_per_s"] == pytest.approx(r["useful_output_tokens"] / r["duration_s"])


@pytest.fixture(scope="module")
def engine():
    with Servers(executor_args=["--dtype", "float32", "--kv-cache-gib", "0.1", "--max-model-len", "512"]) as s:
        yield s.public_addr


def _run(suite: str, args: list[str], out_dir) -> dict:
    assert bench_main([suite, *args, "--out-dir", str(out_dir)]) == 0
    (json_path,) = out_dir.glob(f"{suite}-*.json")
    assert json_path.with_suffix(".png").stat().st_size > 0
    result = json.loads(json_path.read_text())
    assert result["machine"]["cpu_count"] >= 1 and result["command"].startswith(f"python -m bench {suite}")
    return result


@pytest.mark.e2e
def test_suites_run_end_to_end(engine, tmp_path):
    small = ["--target", engine, "--prompt-len", "16:48", "--output-len", "3:6"]

    t = _run("throughput", [*small, "--num-requests", "4"], tmp_path / "t")
    d = t["dtypes"][0]
    assert d["pagedserve_rounds"][0]["output_tokens"] == d["workload"]["output_tokens"]
    assert d["pagedserve"]["output_tokens_per_s"] > 0
    assert d["workload"]["sampling"] == [[0.0, 1.0, 0]]  # greedy by default

    # Sampled requests still produce exactly max_tokens each (ignore_eos).
    sampling = ["--temperature", "0.8", "--top-p", "0.9", "--top-k", "40"]
    t = _run("throughput", [*small, "--num-requests", "4", *sampling], tmp_path / "ts")
    d = t["dtypes"][0]
    assert d["workload"]["sampling"] == [[0.8, 0.9, 40]]
    assert d["pagedserve_rounds"][0]["output_tokens"] == d["workload"]["output_tokens"]

    s = _run("serve", [*small, "--num-requests", "4", "--rates", "8,inf", "--repeats", "2"], tmp_path / "s")
    assert [r["rate"] for r in s["rates"]] == [8.0, math.inf] and len(s["rounds"]) == 2
    for r in s["rates"]:
        assert 0 < r["ttft"]["p50"] <= r["ttft"]["p99"] <= r["e2e"]["p99"]
        assert 0 <= r["goodput"]["fraction"] <= 1

    m = _run(
        "memory",
        [
            "--target",
            engine,
            "--num-requests",
            "4",
            "--prompt-len",
            "64:200",
            "--output-len",
            "8:12",
            "--interval",
            "0.005",
        ],
        tmp_path / "m",
    )
    w, c = m["summary"]["waste"], m["summary"]["concurrency"]
    assert 0 <= w["paged"] < 1 and w["paged"] <= w["reserve_max_model_len"]
    assert 1 <= c["paged_max_running"] <= 4 and c["reserve_max_model_len"] == m["summary"]["budget_tokens"] // 512

    # One engine stands in for both runs: the harness path is the same, the accounting must hold.
    p = _run(
        "prefix",
        [
            "--target",
            engine,
            "--target-off",
            engine,
            "--num-requests",
            "3",
            "--prefix-len",
            "48",
            "--suffix-len",
            "4:8",
            "--output-len",
            "2",
        ],
        tmp_path / "p",
    )
    for run in (p["on"], p["off"]):
        assert run["cached_prompt_tokens"] + run["computed_prefill_tokens"] == run["prompt_tokens"]
        assert run["prompt_tokens"] == run["workload"]["prompt_tokens"]


def test_sampling_flags_refuse_the_greedy_only_baselines():
    from bench import throughput
    from bench.__main__ import parser

    for extra in (["--baseline", "hf"], ["--llama-server", "llama-server"]):
        argv = ["throughput", "--temperature", "0.7", *extra]
        with pytest.raises(ValueError, match="greedy only"):
            throughput.main(parser().parse_args(argv), argv)


def test_all_runs_every_suite_with_flags_that_parse(monkeypatch):
    import bench.__main__ as entry

    seen = []
    for name, module in entry.SUITES.items():
        monkeypatch.setattr(module, "main", lambda args, argv, name=name: seen.append((name, args.dtype, argv)))
    assert entry.main(["all", "--no-micro", "--dtype", "bfloat16"]) == 0
    assert [s[0] for s in seen] == ["throughput", "serve", "memory", "prefix"]
    assert all(dtype == "bfloat16" for _, dtype, _ in seen)
    assert seen[0][2][:3] == ["throughput", "--baseline", "hf"]


def test_forward_sweep_times_the_runner_in_process(tmp_path):
    """The real Worker and ModelRunner on a tiny random Llama (the real model takes far longer to load):
    what is under test is the synthetic plans, the FLOP accounting and the result files."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    from bench import forward_sweep
    from tests.model_utils import save_tiny_hf_model

    model_dir = tmp_path / "model"
    hf = save_tiny_hf_model("llama_tied", str(model_dir))
    # The Worker loads a tokenizer with every model; the sweep never tokenizes.
    Tokenizer(WordLevel({"<unk>": 0}, unk_token="<unk>")).save(str(model_dir / "tokenizer.json"))
    threads = torch.get_num_threads()
    try:
        r = forward_sweep.main(
            [
                "--model",
                str(model_dir),
                "--batch-sizes",
                "1,2",
                "--context",
                "40",
                "--contexts",
                "32",
                "--batch",
                "2",
                "--prefill-tokens",
                "16",
                "--prefill-batch",
                "2",
                "--dtypes",
                "float32",
                "--rounds",
                "1",
                "--num-threads",
                "1",
                "--bandwidth-mib",
                "16",
                "--out-dir",
                str(tmp_path / "out"),
            ]
        )
    finally:
        torch.set_num_threads(threads)  # the Worker sets them for the whole process
    (json_path,) = (tmp_path / "out").glob("forward_sweep-*.json")
    assert json_path.with_suffix(".png").stat().st_size > 0
    assert json.loads(json_path.read_text())["rows"] == r["rows"]
    assert r["command"].startswith("python -m bench.forward_sweep --model")
    assert [(x["sweep"], x["batch"], x["context"], x["tokens"]) for x in r["rows"]] == [
        ("batch", 1, 40, 1),
        ("batch", 2, 40, 2),
        ("context", 2, 32, 2),
        ("prefill", 2, 16, 32),
    ]
    m = r["model"]
    head = hf.config.vocab_size * hf.config.hidden_size
    assert m["head_params"] == head and m["non_embedding_params"] == sum(p.numel() for p in hf.parameters()) - head
    assert r["rows"][-1]["flops"] == 2 * (m["non_embedding_params"] * 32 + head * 2)  # the head on sampled rows only
    assert r["ceiling"]["float32"]["best_gflops"] > 0
    bandwidth = r["bandwidth"]["float32"]["floor_bytes_per_s"]
    assert bandwidth > 0
    kv_per_token = 2 * hf.config.num_hidden_layers * (hf.config.hidden_size // 2) * 4  # K+V of 2 KV heads of 4
    for row in r["rows"]:
        assert 0 < row["forward_ms"] <= row["step_ms"]
        assert row["fraction_of_ceiling"] == pytest.approx(row["ceiling_ms"] / row["step_ms"])
        assert row["weight_bytes"] == sum(row["weight_bytes_by_route"].values()) > 0
        assert row["kv_bytes"] == row["batch"] * row["context"] * kv_per_token
        assert row["floor_ms"] == pytest.approx((row["weight_bytes"] + row["kv_bytes"]) / bandwidth * 1e3)
        assert 0 < row["weight_floor_ms"] < row["floor_ms"]
        assert row["times_floor"] == pytest.approx(row["step_ms"] / row["floor_ms"])
    # Float32 weights: MKL's at one row, the kernel's panels (padded to whole panels) from two.
    assert set(r["rows"][0]["weight_bytes_by_route"]) <= {"torch"}
    assert (
        r["rows"][1]["weight_bytes"]
        >= r["rows"][0]["weight_bytes"]
        == 4 * (m["non_embedding_params"] + head) - 4 * (2 * hf.config.num_hidden_layers + 1) * hf.config.hidden_size
    )  # less the norms, which step_bytes leaves out
    assert r["targets"]["float32"]["batch_1_x_weight_floor"] == pytest.approx(
        r["rows"][0]["step_ms"] / r["rows"][0]["weight_floor_ms"]
    )


@pytest.mark.parametrize("peer", ["vllm", "llamacpp"])
def test_a_peers_ratio_is_the_median_of_per_round_ratios(peer):
    from bench.throughput import _summarize

    def r(tok_s):
        return dict(requests_per_s=1.0, output_tokens_per_s=tok_s, total_tokens_per_s=3 * tok_s)

    out = _summarize(
        {"pagedserve_rounds": [r(100), r(150), r(90)], "hf_rounds": [], f"{peer}_rounds": [r(80), r(100), r(100)]}
    )
    assert out[f"ratio_vs_{peer}_per_round"] == pytest.approx([1.25, 1.5, 0.9])
    assert out[f"ratio_vs_{peer}"] == pytest.approx(1.25) and out[peer]["output_tokens_per_s"] == 100
    failed = _summarize({"pagedserve_rounds": [r(100)], "hf_rounds": [], f"{peer}_rounds": [dict(error="exit 1")]})
    assert failed[peer] == {"error": "exit 1"} and f"ratio_vs_{peer}" not in failed


FAKE_LLAMA_SERVER = """#!{python}
import json, sys, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
args = sys.argv[1:]
if args == ["--version"]:
    print("version: 9 (fake)", file=sys.stderr)
    sys.exit(0)
opt = dict(zip(args[::2], args[1::2]))
short = "--short" in open({flags!r}).read()  # a server that stops early

class Handler(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert body["ignore_eos"] and body["temperature"] == 0 and not body["cache_prompt"]
        n = body["n_predict"] - (1 if short else 0)
        time.sleep(0.01)
        out = json.dumps(dict(tokens_predicted=n, tokens_evaluated=len(body["prompt"]), slots=opt["-np"]))
        self.send_response(200); self.end_headers(); self.wfile.write(out.encode())

ThreadingHTTPServer((opt["--host"], int(opt["--port"])), Handler).serve_forever()
"""


def test_llamacpp_baseline_sends_every_request_at_once_and_counts_tokens(tmp_path):
    """Against a stand-in llama-server: every request's tokens counted, its
    version recorded, and a server that produces fewer tokens than asked is
    reported as an error rather than timed."""
    from bench import llamacpp_baseline

    flags = tmp_path / "flags"
    flags.write_text("")
    server = tmp_path / "llama-server"
    server.write_text(FAKE_LLAMA_SERVER.format(python=sys.executable, flags=str(flags)))
    server.chmod(0o755)
    reqs = uniform_workload(6, (5, 9), (2, 4), 300, seed=1)
    out = llamacpp_baseline.run(str(server), reqs, "model.gguf", num_threads=1, timeout_s=60)
    assert out["output_tokens"] == sum(r.max_tokens for r in reqs) and out["output_tokens_per_s"] > 0
    assert out["prompt_tokens"] == sum(r.prompt_len for r in reqs) and out["version"] == "version: 9 (fake)"
    flags.write_text("--short")
    short = llamacpp_baseline.run(str(server), reqs, "model.gguf", num_threads=1, timeout_s=60)
    assert "output_tokens_per_s" not in short and "asked for" in short["error"]
    missing = llamacpp_baseline.run(str(tmp_path / "nope"), reqs, "model.gguf")
    assert "FileNotFoundError" in missing["error"]


def test_each_pass_gets_a_distinct_first_token_and_the_same_work():
    from bench.workloads import with_distinct_first_token

    reqs = uniform_workload(4, (5, 9), (1, 3), 300, seed=1)
    a, b = with_distinct_first_token(reqs, 1, 300), with_distinct_first_token(reqs, 2, 300)
    assert {r.prompt_token_ids[0] for r in a} != {r.prompt_token_ids[0] for r in b}
    for x, y, orig in zip(a, b, reqs):
        assert x.prompt_token_ids[1:] == y.prompt_token_ids[1:] == orig.prompt_token_ids[1:]
        assert len(x.prompt_token_ids) == len(orig.prompt_token_ids) and x.max_tokens == orig.max_tokens


def test_omp_wait_child_times_steps_under_a_policy():
    from bench.omp_wait import run_child

    ms = run_child("passive", "1,2", busy=True)
    assert set(ms) == {"1", "2"} and all(v > 0 for v in ms.values())


def test_overlap_sim_drives_the_real_scheduler_against_the_stand_in_executor():
    from bench.overlap_sim import run_once

    for overlap in (False, True):
        out = run_once(2.0, overlap, num_requests=4, max_tokens=16)
        assert out["steps"] >= 4 and 0 < out["busy"] <= 1.0 and out["tokens_per_s"] > 0


def test_kv_read_bandwidth_times_the_dot_route_beside_the_kernel(capsys):
    """--dot adds the bf16 dot decode route to the bfloat16 rows (emulated
    where the CPU lacks AVX512-BF16) and prints its speed-up."""
    from bench import kv_read_bandwidth
    from executor_svc.attention import native_kernel

    if native_kernel.load() is None or not native_kernel.dot_supported(9, 3, 64):
        pytest.skip("needs the AVX-512 decode kernel built with AVX-512BW")
    kv_read_bandwidth.main(["--contexts", "40", "--batch", "2", "--rounds", "1", "--dot"])
    lines = capsys.readouterr().out.splitlines()
    f32, bf16 = (next(line for line in lines if f" {dt} " in line) for dt in ("float32", "bfloat16"))
    assert "dot" not in f32 and " now " in f32
    assert " dot " in bf16 and "now/dot" in bf16 and "of copy" in bf16


def test_text_prompts_are_distinct_runs_of_docstring_words(tmp_path):
    from bench import text_prompts

    out = tmp_path / "text.jsonl"
    text_prompts.main(["--out", str(out), "--num-requests", "6", "--prompt-words", "40:60", "--output-len", "8:9"])
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(lines) == 6 and all(8 <= r["max_tokens"] <= 9 for r in lines)
    assert all(40 <= len(r["prompt"].split()) <= 60 for r in lines)
    words = text_prompts.stdlib_words()
    joined = " ".join(r["prompt"] for r in lines)
    assert joined == " ".join(words[: len(joined.split())])  # consecutive, none repeated
    assert len(read_jsonl(str(out), limit=6)) == 6
