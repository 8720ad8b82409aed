"""The executor's Prometheus metrics: step duration and batch shape.

Names are `<prefix>:executor_*` (prefix `pagedserve`, or `vllm` with
--metrics-prefix vllm); every series carries the served model's `model_name`.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

_STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12)
_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


class ExecutorMetrics:
    def __init__(self, prefix: str = "pagedserve", model_name: str = ""):
        self.registry = r = CollectorRegistry()
        label = ["model_name"]

        def histogram(name, doc, buckets):
            return Histogram(f"{prefix}:{name}", doc, label, buckets=buckets, registry=r).labels(model_name)

        self.step_duration = histogram(
            "executor_step_duration_seconds", "Forward + sampling time of one step.", _STEP_BUCKETS
        )
        self.batch_tokens = histogram("executor_batch_tokens", "Tokens computed per step.", _SIZE_BUCKETS)
        self.batch_requests = histogram("executor_batch_requests", "Requests per step.", _SIZE_BUCKETS)
        self.failed_steps = Counter(f"{prefix}:executor_failed_steps", "Steps that raised.", label, registry=r).labels(
            model_name
        )

    def observe(self, plan, result) -> None:
        self.step_duration.observe(result.execute_time_ns / 1e9)
        self.batch_tokens.observe(plan.total_num_scheduled_tokens)
        self.batch_requests.observe(plan.num_requests)
        if result.error:
            self.failed_steps.inc()
