"""Both /metrics endpoints, scraped during and after real traffic."""

from __future__ import annotations

import threading
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagedserve_client import Client
from tests.servers import Servers, free_port

pytestmark = pytest.mark.e2e


MODEL_NAME = "smollm2-135m-8k-lc100k-mix1-ep2"  # the embedded model's id, every series' model_name


def scrape(port: int) -> dict[str, float]:
    """Sample name (with its labels but `le` and `model_name`) -> value; checks every
    engine series is labelled with the model."""
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    samples = {}
    for family in text_string_to_metric_families(body):
        for s in family.samples:
            if s.name.startswith("pagedserve:"):
                assert s.labels.get("model_name") == MODEL_NAME, s
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k not in ("le", "model_name"))
            if "le" not in s.labels:
                samples[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return samples


def test_metrics_move_with_traffic():
    sched_port, exec_port = free_port(), free_port()
    with (
        Servers(
            executor_args=["--dtype", "float32", "--kv-cache-gib", "0.5", "--metrics-listen", f"127.0.0.1:{exec_port}"],
            scheduler_args=["--metrics-listen", f"127.0.0.1:{sched_port}"],
        ) as s,
        Client(s.public_addr) as c,
    ):
        before = scrape(sched_port)
        assert before["pagedserve:kv_cache_blocks_total"] > 0
        assert before["pagedserve:num_requests_running"] == 0
        assert before["pagedserve:executor_connected"] == 1

        long = threading.Thread(
            target=lambda: c.complete("Count slowly:", max_tokens=120, ignore_eos=True, timeout=300)
        )
        long.start()
        deadline = time.monotonic() + 60
        during = scrape(sched_port)
        while during["pagedserve:num_requests_running"] < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
            during = scrape(sched_port)
        assert during["pagedserve:num_requests_running"] == 1
        assert during["pagedserve:kv_cache_blocks_used"] > 0 and during["pagedserve:kv_cache_usage_perc"] > 0
        long.join()

        shared = "You are a meticulous assistant. " * 8
        for i in range(3):
            c.complete(shared + f"Question {i}?", max_tokens=6, ignore_eos=True)
        after = scrape(sched_port)
        assert after["pagedserve:num_requests_running"] == 0 and after["pagedserve:kv_cache_blocks_used"] == 0
        assert after["pagedserve:request_success_total{finished_reason=length}"] == 4
        assert after["pagedserve:generation_tokens_total"] == 120 + 3 * 6
        assert after["pagedserve:time_to_first_token_seconds_count"] == 4
        assert after["pagedserve:inter_token_latency_seconds_count"] >= 119 + 3 * 5
        assert after["pagedserve:e2e_request_latency_seconds_count"] == 4
        assert after["pagedserve:request_queue_time_seconds_count"] == 4
        assert after["pagedserve:prefix_cache_hits_total"] > 0, "the shared prefix should hit"
        assert after["pagedserve:prefix_cache_queries_total"] >= after["pagedserve:prefix_cache_hits_total"]
        assert after["pagedserve:kv_cache_blocks_cached_free"] > 0

        ex = scrape(exec_port)
        steps = ex["pagedserve:executor_step_duration_seconds_count"]
        assert steps == after["pagedserve:num_steps_total"] > 0
        assert ex["pagedserve:executor_batch_tokens_sum"] >= 120 + 3 * 6
        assert ex["pagedserve:executor_failed_steps_total"] == 0

        # A client that goes away still counts its request in the per-request metrics.
        stream = c.generate("Abandon me:", max_tokens=200, ignore_eos=True, timeout=120)
        next(stream)
        stream.close()
        deadline = time.monotonic() + 30
        while scrape(sched_port).get("pagedserve:request_success_total{finished_reason=abort}", 0) < 1:
            assert time.monotonic() < deadline, "the abort was never counted"
            time.sleep(0.05)
        aborted = scrape(sched_port)
        assert aborted["pagedserve:prompt_tokens_total"] - after["pagedserve:prompt_tokens_total"] == len(
            c.tokenize("Abandon me:")
        )
        assert aborted["pagedserve:request_prompt_tokens_count"] == after["pagedserve:request_prompt_tokens_count"] + 1
