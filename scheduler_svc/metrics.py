"""The scheduler's Prometheus metrics, named after vLLM's (`vllm:` -> `pagedserve:`).

Gauges and the cache/preemption counters are read from the scheduler at scrape
time (no per-step cost); per-request latencies are observed by the engine as
tokens arrive (the output processor calls the `observe_*` methods). Every series carries a `model_name` label, and the prefix is
`--metrics-prefix` (`vllm` makes vLLM's Grafana dashboards work unchanged).
The per-request metrics exist once the model is known (`bind`, at the first
executor handshake); no request is admitted before.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

# Token latencies (TTFT, inter-token) are milliseconds to seconds.
_LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
# Whole requests on CPU take seconds to minutes (500 tokens at 10 tok/s is 50 s): vLLM's e2e buckets
# reach 7680 s; these keep resolution where CPU requests land and reach 30 minutes.
_REQUEST_BUCKETS = (
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    90.0,
    120.0,
    180.0,
    240.0,
    300.0,
    480.0,
    600.0,
    900.0,
    1200.0,
    1800.0,
)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)
LABELS = ["model_name"]


class _SchedulerCollector:
    def __init__(self, engine, prefix: str, model_name):
        self._engine = engine
        self._prefix = prefix
        self._model_name = model_name  # a callable: the label is known after the handshake

    def collect(self):
        engine = self._engine
        sched = engine.scheduler
        if sched is None:
            return
        s = sched.stats()
        p, label = self._prefix, [self._model_name()]
        for name, doc, value in (
            ("num_requests_running", "Requests in the running batch.", s.num_running),
            ("num_requests_waiting", "Requests waiting (including preempted).", s.num_waiting),
            (
                "kv_cache_usage_perc",
                "Fraction of KV blocks held by live requests (0-1).",
                s.kv_blocks_used / max(s.kv_blocks_total, 1),
            ),
            ("kv_cache_blocks_total", "Usable KV blocks.", s.kv_blocks_total),
            ("kv_cache_blocks_used", "KV blocks held by live requests.", s.kv_blocks_used),
            ("kv_cache_blocks_cached_free", "Free KV blocks still holding a reusable prefix.", s.kv_blocks_cached_free),
            ("executor_connected", "1 when the executor is connected.", float(engine.connected)),
        ):
            family = GaugeMetricFamily(f"{p}:{name}", doc, labels=LABELS)
            family.add_metric(label, value)
            yield family
        for name, doc, value in (
            ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", s.prefix_cache_queries_tokens),
            ("prefix_cache_hits", "Prompt tokens found in the prefix cache.", s.prefix_cache_hits_tokens),
            ("num_preemptions", "Requests preempted (evicted, later recomputed).", s.num_preemptions),
            ("num_steps", "Steps executed.", s.num_steps),
        ):
            family = CounterMetricFamily(f"{p}:{name}", doc, labels=LABELS)
            family.add_metric(label, value)
            yield family


class SchedulerMetrics:
    def __init__(self, engine, prefix: str = "pagedserve"):
        self.registry = r = CollectorRegistry()
        self.model_name = ""
        r.register(_SchedulerCollector(engine, prefix, lambda: self.model_name))

        def counter(name, doc, extra=()):
            return Counter(f"{prefix}:{name}", doc, LABELS + list(extra), registry=r)

        def histogram(name, doc, buckets):
            return Histogram(f"{prefix}:{name}", doc, LABELS, buckets=buckets, registry=r)

        self._families = dict(
            prompt_tokens=counter("prompt_tokens", "Prompt tokens of finished requests."),
            generation_tokens=counter("generation_tokens", "Generated tokens."),
            ttft=histogram("time_to_first_token_seconds", "Time to first token.", _LATENCY_BUCKETS),
            itl=histogram("inter_token_latency_seconds", "Time between tokens of a sample.", _LATENCY_BUCKETS),
            e2e=histogram("e2e_request_latency_seconds", "Arrival to last token.", _REQUEST_BUCKETS),
            queue_time=histogram("request_queue_time_seconds", "Arrival to first scheduling.", _REQUEST_BUCKETS),
            prompt_len=histogram("request_prompt_tokens", "Prompt length of finished samples.", _TOKEN_BUCKETS),
            generation_len=histogram("request_generation_tokens", "Output length of finished samples.", _TOKEN_BUCKETS),
        )
        self._request_success = counter("request_success", "Finished samples by finish reason.", ["finished_reason"])
        # Totals for the periodic stats line (stats_logger.py): tokens the executor computed, tokens streamed.
        self.computed_tokens = 0
        self.generated_tokens = 0

    def bind(self, model_name: str) -> None:
        """Labels every series with the served model (called once, when the model is known)."""
        self.model_name = model_name
        for attr, family in self._families.items():
            setattr(self, attr, family.labels(model_name))

    def request_success(self, reason: str):
        return self._request_success.labels(self.model_name, reason)

    def observe_step(self, num_tokens: int) -> None:
        """A step succeeded: the executor computed `num_tokens` tokens."""
        self.computed_tokens += num_tokens

    def observe_scheduled(self, arrival: float, now: float) -> None:
        """A sample was scheduled for the first time."""
        self.queue_time.observe(now - arrival)

    def observe_tokens(self, count: int, arrival: float, last_token_time: float | None, now: float) -> None:
        """`count` (> 0) new tokens of one sample; `last_token_time` None for its first."""
        if last_token_time is None:
            self.ttft.observe(now - arrival)
        else:
            self.itl.observe((now - last_token_time) / count)
        self.generation_tokens.inc(count)
        self.generated_tokens += count

    def observe_finished(self, reason: str, num_prompt_tokens: int, num_output_tokens: int, arrival: float) -> None:
        """A sample ended (client aborts included)."""
        self.request_success(reason).inc()
        self.prompt_tokens.inc(num_prompt_tokens)
        self.prompt_len.observe(num_prompt_tokens)
        self.generation_len.observe(num_output_tokens)
        self.e2e.observe(time.monotonic() - arrival)
