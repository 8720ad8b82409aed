"""The periodic stats line (like vLLM's "Avg prompt throughput: ... tokens/s"):

    stats prompt_tok_s=412.0 gen_tok_s=96.5 running=8 waiting=2 kv_usage_pct=37.5 prefix_hit_pct=61.0 preemptions=0

One INFO line every --log-stats-interval seconds while there is work or there
was some since the last line; an idle server stays quiet. Prompt throughput
counts the tokens the executor computed that were not sampled outputs (prefill
work, prefix-cache hits excluded); the hit rate is over the interval's lookups.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import structlog

log = structlog.get_logger("scheduler_svc.stats")


@dataclass(frozen=True)
class _Totals:
    at: float
    computed: int
    generated: int
    queries: int
    hits: int
    preemptions: int


class StatsLogger:
    def __init__(self, engine, interval_s: float):
        assert interval_s > 0
        self._engine = engine
        self._interval_s = interval_s
        self._last: _Totals | None = None

    def _totals(self, stats, now: float) -> _Totals:
        e = self._engine
        return _Totals(
            now,
            e.metrics.computed_tokens,
            e.metrics.generated_tokens,
            stats.prefix_cache_queries_tokens,
            stats.prefix_cache_hits_tokens,
            stats.num_preemptions,
        )

    def line(self, now: float) -> dict | None:
        """The fields of the line due at `now` (None when there is nothing to report)."""
        sched = self._engine.scheduler
        if sched is None:
            return None
        s = sched.stats()
        cur, last = self._totals(s, now), self._last
        self._last = cur
        if last is None or (s.num_running == 0 and s.num_waiting == 0 and cur.computed == last.computed):
            return None
        dt = max(cur.at - last.at, 1e-9)
        generated = cur.generated - last.generated
        queries = cur.queries - last.queries
        return dict(
            prompt_tok_s=round(max(cur.computed - last.computed - generated, 0) / dt, 1),
            gen_tok_s=round(generated / dt, 1),
            running=s.num_running,
            waiting=s.num_waiting,
            kv_usage_pct=round(100 * s.kv_blocks_used / max(s.kv_blocks_total, 1), 1),
            prefix_hit_pct=round(100 * (cur.hits - last.hits) / queries, 1) if queries else 0.0,
            preemptions=cur.preemptions - last.preemptions,
        )

    async def run(self) -> None:
        """Logs until cancelled."""
        self.line(time.monotonic())  # the baseline
        while True:
            await asyncio.sleep(self._interval_s)
            fields = self.line(time.monotonic())
            if fields is not None:
                log.info("stats", **fields)
