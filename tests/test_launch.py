"""`pagedserve serve` (shared/launch.py): one command, one process tree, as a user runs it.

The launcher routes each flag to the service that has it, starts executor,
scheduler and gateway, prints where to send requests once they serve, and on
SIGTERM or Ctrl-C stops all three and exits 0. An executor started by hand
and interrupted while it loads exits at once.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request

import openai
import pytest

from pagedserve_client import Client
from shared.serve_flags import EXECUTOR, GATEWAY, SCHEDULER, child_envs, routes, service_parsers
from tests.servers import REPO, free_port

pytestmark = pytest.mark.e2e


def test_shared_flags_reach_the_process_they_mean():
    executor, scheduler = child_envs(
        {
            "PAGEDSERVE_METRICS_LISTEN": "127.0.0.1:9101",
            "PAGEDSERVE_EXECUTOR_METRICS_LISTEN": "127.0.0.1:9102",
            "PAGEDSERVE_AUTH_TOKEN": "client-secret",
            "PAGEDSERVE_EXECUTOR_AUTH_TOKEN": "hop-secret",
            "PAGEDSERVE_KV_CACHE_GIB": "1",
            "PATH": "/bin",
        }
    )
    assert (
        executor["PAGEDSERVE_METRICS_LISTEN"] == "127.0.0.1:9102" and executor["PAGEDSERVE_AUTH_TOKEN"] == "hop-secret"
    )
    assert (
        scheduler["PAGEDSERVE_METRICS_LISTEN"] == "127.0.0.1:9101"
        and scheduler["PAGEDSERVE_AUTH_TOKEN"] == "client-secret"
    )
    assert scheduler["PAGEDSERVE_EXECUTOR_AUTH_TOKEN"] == "hop-secret"  # the scheduler presents it
    assert executor["PAGEDSERVE_KV_CACHE_GIB"] == scheduler["PAGEDSERVE_KV_CACHE_GIB"] == "1"
    executor, _ = child_envs({"PAGEDSERVE_METRICS_LISTEN": "127.0.0.1:9101", "PAGEDSERVE_AUTH_TOKEN": "x"})
    assert "PAGEDSERVE_METRICS_LISTEN" not in executor and "PAGEDSERVE_AUTH_TOKEN" not in executor


def test_flags_pass_through_to_the_services_that_have_them():
    parsers = service_parsers({})
    got = routes(
        [
            "--max-num-seqs",
            "4",
            "--dtype=float32",
            "--log-level",
            "debug",
            "--drain-timeout",
            "5",
            "--no-prefix-caching",
            "--allowed-origins",
            "*",
            "--metrics-prefix",
            "vllm",
        ],
        parsers,
    )
    assert got[SCHEDULER] == [
        "--max-num-seqs",
        "4",
        "--log-level",
        "debug",
        "--drain-timeout",
        "5",
        "--no-prefix-caching",
        "--metrics-prefix",
        "vllm",
    ]
    assert got[EXECUTOR] == ["--dtype=float32", "--log-level", "debug", "--metrics-prefix", "vllm"]
    assert got[GATEWAY] == ["--log-level", "debug", "--drain-timeout", "5", "--allowed-origins", "*"]
    for bad, message in (
        (["--no-such-flag"], "unknown flag"),
        (["--executor", "x:1"], "set by pagedserve serve"),
        (["--max-num-seqs"], "needs a value"),
    ):
        with pytest.raises(ValueError, match=message):
            routes(bad, parsers)


def serve(args: list[str], log_path, env: dict | None = None) -> subprocess.Popen:
    log = open(log_path, "w+")
    return subprocess.Popen(
        [sys.executable, "-m", "pagedserve_client.cli", "serve", *args],
        cwd=REPO,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "PAGEDSERVE_LOG_JSON": "1", **(env or {})},
        stdout=log,
        stderr=subprocess.STDOUT,
    )


def wait_for(log_path, text: str, proc: subprocess.Popen, timeout: float = 300) -> str:
    deadline = time.monotonic() + timeout
    while text not in (out := log_path.read_text()):
        assert proc.poll() is None, out[-4000:]
        assert time.monotonic() < deadline, f"{text!r} never printed:\n{out[-4000:]}"
        time.sleep(0.25)
    return out


def children(out: str) -> dict[str, int]:
    return {name: int(pid) for name, pid in re.findall(r"started (\w+) \(pid (\d+)\)", out)}


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


def stop_and_check(proc: subprocess.Popen, sig: int, pids: dict[str, int], log_path) -> str:
    proc.send_signal(sig)
    assert proc.wait(timeout=90) == 0, log_path.read_text()[-3000:]
    deadline = time.monotonic() + 10
    while any(alive(p) for p in pids.values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [n for n, p in pids.items() if alive(p)], "children outlived pagedserve serve"
    return log_path.read_text()


def test_serve_starts_all_three_answers_openai_and_stops_cleanly(tmp_path):
    port, openai_port = free_port(), free_port()
    log_path = tmp_path / "serve.log"
    proc = serve(
        [
            "--port",
            str(port),
            "--openai-port",
            str(openai_port),
            "--kv-cache-gib",
            "0.1",
            "--dtype",
            "float32",
            "--log-stats-interval",
            "1",
            "--metrics-prefix",
            "vllm",
            "--served-model-name",
            "smol",
        ],
        log_path,
    )
    try:
        out = wait_for(log_path, "Ctrl-C stops everything", proc)
        pids = children(out)
        assert set(pids) == {EXECUTOR, SCHEDULER, GATEWAY}
        base = f"http://127.0.0.1:{openai_port}"
        assert f"{base}/v1" in out and f"pagedserve --target 127.0.0.1:{port} generate" in out
        assert '"model": "smol"' in out  # the banner's curl names the served model
        loading = [
            json.loads(line) for line in out.splitlines() if '"model_loading"' in line or '"model_loaded"' in line
        ]
        assert loading[0]["event"] == "model_loading" and loading[0]["path"].endswith(".gguf")
        assert loading[1]["event"] == "model_loaded" and loading[1]["load_s"] > 0
        # Start-up's objects are out of the collector's way (a full collection over them took ~100 ms),
        # in the scheduler too once it has connected.
        assert loading[1]["frozen_objects"] > 10_000 and loading[1]["gc_collect_ms"] >= 0
        frozen = [json.loads(line) for line in out.splitlines() if '"startup_objects_frozen"' in line]
        assert len(frozen) == 1 and frozen[0]["frozen_objects"] > 10_000
        assert '"event": "waiting_for_executor"' not in out  # DEBUG while the model loads (INFO every 30 s)

        oai = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
        done = oai.completions.create(
            model="smol", prompt="The capital of France is", max_tokens=24, extra_body={"ignore_eos": True}
        )
        assert done.usage.completion_tokens == 24
        cli = subprocess.run(
            [
                sys.executable,
                "-m",
                "pagedserve_client.cli",
                "--target",
                f"127.0.0.1:{port}",
                "generate",
                "Hi",
                "--max-tokens",
                "2",
                "--json",
            ],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
        )
        messages = [json.loads(line) for line in cli.stdout.splitlines()]
        assert cli.returncode == 0 and messages[-1]["finish_reason"] == "length", cli.stderr
        assert messages[-1]["usage"]["completion_tokens"] == 2

        metrics = urllib.request.urlopen(f"{base}/metrics", timeout=10).read().decode()
        assert 'vllm:num_requests_running{model_name="smol"}' in metrics
        assert 'vllm:generation_tokens_total{model_name="smol"} 26.0' in metrics  # the OpenAI request's and the CLI's
        assert (
            'vllm:e2e_request_latency_seconds_bucket{le="600.0",model_name="smol"}' in metrics
        )  # minutes-long CPU requests
        assert "vllm:executor_step_duration_seconds_count" in metrics
        out = wait_for(log_path, '"event": "stats"', proc, timeout=30)
        stats = json.loads(next(line for line in out.splitlines() if '"event": "stats"' in line))
        assert stats["gen_tok_s"] > 0 and {
            "prompt_tok_s",
            "running",
            "waiting",
            "kv_usage_pct",
            "prefix_hit_pct",
        } <= set(stats)

        out = stop_and_check(proc, signal.SIGTERM, pids, log_path)
        assert "Task exception was never retrieved" not in out and "Traceback" not in out
        sockets = re.findall(r"unix://(\S+?)/executor\.sock", out)
        assert sockets and not os.path.exists(sockets[0]), "the private socket folder outlived the tree"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_serve_a_hugging_face_id_from_the_cache_with_a_token_and_ctrl_c(tmp_path):
    from tests.model_utils import save_tiny_model_with_tokenizer
    from tests.test_model_source import make_cache

    cache = tmp_path / "hub"
    snapshot = make_cache(str(cache), "tiny-org/tiny-model", files={})
    save_tiny_model_with_tokenizer(snapshot)
    port = free_port()
    log_path = tmp_path / "serve.log"
    proc = serve(
        ["tiny-org/tiny-model", "--no-openai", "--port", str(port), "--kv-cache-gib", "0.05", "--auth-token", "s3cret"],
        log_path,
        env={"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"},
    )
    try:
        out = wait_for(log_path, "Ctrl-C stops everything", proc)
        pids = children(out)
        assert set(pids) == {EXECUTOR, SCHEDULER} and "OpenAI-compatible API" not in out
        assert f"pagedserve --target 127.0.0.1:{port} --token YOUR_TOKEN generate" in out
        with Client(f"127.0.0.1:{port}", token="s3cret") as c:
            assert c.model_info().model_name == "tiny-org/tiny-model"
            assert c.complete(token_ids=[5, 6, 7], max_tokens=3, ignore_eos=True, timeout=60)[0].completion_tokens == 3
        stop_and_check(proc, signal.SIGINT, pids, log_path)  # what Ctrl-C sends
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_serve_with_a_missing_model_says_so_and_exits_1(tmp_path):
    log_path = tmp_path / "serve.log"
    proc = serve(
        ["no-org/no-model", "--no-openai", "--port", str(free_port())],
        log_path,
        env={"HF_HUB_CACHE": str(tmp_path), "HF_HUB_OFFLINE": "1"},
    )
    assert proc.wait(timeout=120) == 1
    out = log_path.read_text()
    assert "Traceback" not in out and "not in the Hugging Face cache" in out
    assert "executor_svc exited with code 1 during start-up" in out


def test_ctrl_c_while_a_lone_executor_loads_exits_130_without_waiting_for_the_load(tmp_path):
    """Run by hand (`python -m executor_svc`), the executor loads its model on
    the forward thread, which a KeyboardInterrupt cannot stop and a normal exit
    would wait for: Ctrl-C then ends the process at once, before the load
    finishes, and says so."""
    env = {**os.environ, "PAGEDSERVE_SECRET_DIR": str(tmp_path / "secret")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "executor_svc", "--listen", f"unix://{tmp_path}/executor.sock"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        # As from a terminal: a test run started in the background (`make test &`, nohup)
        # passes SIGINT on ignored, and Python then never raises KeyboardInterrupt.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    try:
        for line in proc.stdout:
            if "model_loading" in line:  # the forward thread has the load now: seconds of it
                break
        proc.send_signal(signal.SIGINT)
        rest = proc.communicate(timeout=120)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, rest
    assert "executor_interrupted_while_loading" in rest and "model_loaded" not in rest
