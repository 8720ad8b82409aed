"""The executor's Prometheus metrics: step duration and batch shape."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

_STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12)
_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


class ExecutorMetrics:
    def __init__(self):
        self.registry = r = CollectorRegistry()
        self.step_duration = Histogram("pagedserve:executor_step_duration_seconds", "Forward + sampling time of one step.",
                                       buckets=_STEP_BUCKETS, registry=r)
        self.batch_tokens = Histogram("pagedserve:executor_batch_tokens", "Tokens computed per step.", buckets=_SIZE_BUCKETS, registry=r)
        self.batch_requests = Histogram("pagedserve:executor_batch_requests", "Requests per step.", buckets=_SIZE_BUCKETS, registry=r)
        self.failed_steps = Counter("pagedserve:executor_failed_steps", "Steps that raised.", registry=r)

    def observe(self, plan, result) -> None:
        self.step_duration.observe(result.execute_time_ns / 1e9)
        self.batch_tokens.observe(plan.total_num_scheduled_tokens)
        self.batch_requests.observe(plan.num_requests)
        if result.error:
            self.failed_steps.inc()
