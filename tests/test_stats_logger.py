"""The scheduler's periodic stats line (scheduler_svc/stats_logger.py), from a fake engine."""

from __future__ import annotations

from types import SimpleNamespace

from scheduler_svc.scheduler import SchedulerStats
from scheduler_svc.stats_logger import StatsLogger


def stats(running=0, waiting=0, used=0, queries=0, hits=0, preemptions=0) -> SchedulerStats:
    return SchedulerStats(
        num_running=running,
        num_waiting=waiting,
        kv_blocks_total=200,
        kv_blocks_used=used,
        kv_blocks_cached_free=0,
        prefix_cache_queries_tokens=queries,
        prefix_cache_hits_tokens=hits,
        num_preemptions=preemptions,
        num_steps=0,
    )


def test_rates_are_over_the_interval_and_an_idle_server_is_quiet():
    current = {"s": stats()}
    engine = SimpleNamespace(
        scheduler=SimpleNamespace(stats=lambda: current["s"]),
        metrics=SimpleNamespace(computed_tokens=0, generated_tokens=0),
    )
    logger = StatsLogger(engine, 10.0)
    assert logger.line(0.0) is None  # the baseline
    assert logger.line(10.0) is None  # nothing ran, nothing live: no line
    # 10 s of work: 1000 prompt tokens computed + 200 sampled, 300 of 400 looked-up prompt tokens hit the cache.
    engine.metrics.computed_tokens, engine.metrics.generated_tokens = 1200, 200
    current["s"] = stats(running=3, waiting=1, used=50, queries=400, hits=300, preemptions=2)
    line = logger.line(20.0)
    assert line == dict(
        prompt_tok_s=100.0, gen_tok_s=20.0, running=3, waiting=1, kv_usage_pct=25.0, prefix_hit_pct=75.0, preemptions=2
    )
    # Requests still live but no step ran: a line with zero rates, not silence.
    line = logger.line(30.0)
    assert (
        line["gen_tok_s"] == 0.0 and line["running"] == 3 and line["prefix_hit_pct"] == 0.0 and line["preemptions"] == 0
    )
    current["s"] = stats()
    assert logger.line(40.0) is None


def test_no_line_before_the_executor_connects():
    assert StatsLogger(SimpleNamespace(scheduler=None), 1.0).line(5.0) is None
