"""The scheduler's Prometheus metrics, named after vLLM's (`vllm:` -> `pagedserve:`).

Gauges and the cache/preemption counters are read from the scheduler at scrape
time (no per-step cost); per-request latencies are observed by the engine as
tokens arrive.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)


class _SchedulerCollector:
    def __init__(self, engine):
        self._engine = engine

    def collect(self):
        engine = self._engine
        sched = engine.scheduler
        if sched is None:
            return
        s = sched.stats()
        for name, doc, value in (
            ("pagedserve:num_requests_running", "Requests in the running batch.", s.num_running),
            ("pagedserve:num_requests_waiting", "Requests waiting (including preempted).", s.num_waiting),
            ("pagedserve:kv_cache_usage_perc", "Fraction of KV blocks held by live requests (0-1).",
             s.kv_blocks_used / max(s.kv_blocks_total, 1)),
            ("pagedserve:kv_cache_blocks_total", "Usable KV blocks.", s.kv_blocks_total),
            ("pagedserve:kv_cache_blocks_used", "KV blocks held by live requests.", s.kv_blocks_used),
            ("pagedserve:kv_cache_blocks_cached_free", "Free KV blocks still holding a reusable prefix.", s.kv_blocks_cached_free),
            ("pagedserve:executor_connected", "1 when the executor is connected.", float(engine.connected)),
        ):
            yield GaugeMetricFamily(name, doc, value=value)
        for name, doc, value in (
            ("pagedserve:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", s.prefix_cache_queries_tokens),
            ("pagedserve:prefix_cache_hits", "Prompt tokens found in the prefix cache.", s.prefix_cache_hits_tokens),
            ("pagedserve:num_preemptions", "Requests preempted (evicted, later recomputed).", s.num_preemptions),
            ("pagedserve:num_steps", "Steps executed.", s.num_steps),
        ):
            yield CounterMetricFamily(name, doc, value=value)


class SchedulerMetrics:
    def __init__(self, engine):
        self.registry = CollectorRegistry()
        self.registry.register(_SchedulerCollector(engine))
        r = self.registry
        self.prompt_tokens = Counter("pagedserve:prompt_tokens", "Prompt tokens of finished requests.", registry=r)
        self.generation_tokens = Counter("pagedserve:generation_tokens", "Generated tokens.", registry=r)
        self.request_success = Counter("pagedserve:request_success", "Finished samples by finish reason.",
                                       ["finished_reason"], registry=r)
        self.ttft = Histogram("pagedserve:time_to_first_token_seconds", "Time to first token.", buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("pagedserve:inter_token_latency_seconds", "Time between tokens of a sample.", buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("pagedserve:e2e_request_latency_seconds", "Arrival to last token.", buckets=_LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram("pagedserve:request_queue_time_seconds", "Arrival to first scheduling.", buckets=_LATENCY_BUCKETS, registry=r)
        self.prompt_len = Histogram("pagedserve:request_prompt_tokens", "Prompt length of finished samples.", buckets=_TOKEN_BUCKETS, registry=r)
        self.generation_len = Histogram("pagedserve:request_generation_tokens", "Output length of finished samples.", buckets=_TOKEN_BUCKETS, registry=r)
