"""`make run`'s launcher (shared/launch.py): both processes from one environment.

Three flags exist in both services with different meanings (--listen,
--metrics-listen, --auth-token); the launcher must route each PAGEDSERVE_*
variable to the process it means, or one process fails to start or refuses
the other.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request

import grpc
import pytest

from pagedserve_client import Client
from shared.launch import child_envs
from tests.servers import REPO, free_port

pytestmark = pytest.mark.e2e


def test_shared_flags_reach_the_process_they_mean():
    executor, scheduler = child_envs({
        "PAGEDSERVE_METRICS_LISTEN": "127.0.0.1:9101", "PAGEDSERVE_EXECUTOR_METRICS_LISTEN": "127.0.0.1:9102",
        "PAGEDSERVE_AUTH_TOKEN": "client-secret", "PAGEDSERVE_EXECUTOR_AUTH_TOKEN": "hop-secret",
        "PAGEDSERVE_KV_CACHE_GIB": "1", "PATH": "/bin",
    })
    assert executor["PAGEDSERVE_METRICS_LISTEN"] == "127.0.0.1:9102" and executor["PAGEDSERVE_AUTH_TOKEN"] == "hop-secret"
    assert scheduler["PAGEDSERVE_METRICS_LISTEN"] == "127.0.0.1:9101" and scheduler["PAGEDSERVE_AUTH_TOKEN"] == "client-secret"
    assert scheduler["PAGEDSERVE_EXECUTOR_AUTH_TOKEN"] == "hop-secret"  # the scheduler presents it
    assert executor["PAGEDSERVE_KV_CACHE_GIB"] == scheduler["PAGEDSERVE_KV_CACHE_GIB"] == "1"
    executor, _ = child_envs({"PAGEDSERVE_METRICS_LISTEN": "127.0.0.1:9101", "PAGEDSERVE_AUTH_TOKEN": "x"})
    assert "PAGEDSERVE_METRICS_LISTEN" not in executor and "PAGEDSERVE_AUTH_TOKEN" not in executor


def test_make_run_launcher_serves_with_metrics_and_a_token_on_both(tmp_path):
    public, scheduler_metrics, executor_metrics = (f"127.0.0.1:{free_port()}" for _ in range(3))
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PAGEDSERVE_LISTEN": public,
           "PAGEDSERVE_EXECUTOR": f"unix://{tmp_path}/executor.sock", "PAGEDSERVE_KV_CACHE_GIB": "0.1",
           "PAGEDSERVE_DTYPE": "float32", "PAGEDSERVE_METRICS_LISTEN": scheduler_metrics,
           "PAGEDSERVE_EXECUTOR_METRICS_LISTEN": executor_metrics, "PAGEDSERVE_AUTH_TOKEN": "s3cret"}
    log = open(tmp_path / "launch.log", "w+")
    launcher = subprocess.Popen([sys.executable, "-m", "shared.launch"], cwd=REPO, env=env, stdout=log,
                                stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while "is serving" not in (tmp_path / "launch.log").read_text():
            assert launcher.poll() is None, (tmp_path / "launch.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the launcher did not report serving"
            time.sleep(0.5)
        printed = (tmp_path / "launch.log").read_text()
        assert f"pagedserve --target {public} --token YOUR_TOKEN generate" in printed
        with Client(public, token="s3cret") as c:
            assert c.complete("Hi", max_tokens=3, ignore_eos=True, timeout=120)[0].completion_tokens == 3
        with Client(public) as c, pytest.raises(grpc.RpcError) as info:
            c.complete("Hi", max_tokens=3, timeout=60)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        for addr, metric in ((scheduler_metrics, "pagedserve:num_requests_running"),
                             (executor_metrics, "pagedserve:executor_step")):
            body = urllib.request.urlopen(f"http://{addr}/metrics", timeout=10).read().decode()
            assert metric in body, f"{metric} not served on {addr}"
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(timeout=60) == 0
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
