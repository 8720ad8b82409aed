"""Micro-benchmark: CPU cost of one schedule() (plan building included) in steady decode.

    .venv/bin/python -m bench.scheduler_cost [--steps 300]

N requests with distinct random prompts of 32..47 tokens (a 0% prefix-hit
rate; the lengths spread block boundaries, so each decode step about 1/16 of
the requests fill a block and need a new one, as in real traffic) are
admitted and brought to steady decode. Each timed step is one schedule()
call; a fake executor then runs the plan and update_from_result() applies it
(timed separately). The heap built during warm-up is frozen (gc.freeze), so
the tail shows the scheduler's own work and garbage, not full collections
over the fake executor's state. Targets: well under 1 ms at 256 requests and
4 ms at 1024.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import statistics
import sys
import time
from pathlib import Path

from scheduler_svc.request import Request
from scheduler_svc.scheduler import Scheduler
from scheduler_svc.scheduler_config import SchedulerConfig
from shared.sampling_params import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from fake_executor import FakeExecutor  # noqa: E402

PROMPT_LENS = range(32, 48)
BLOCK_SIZE = 16


def measure(num_requests: int, prefix_caching: bool, steps: int, seed: int = 0) -> tuple[list[int], list[int]]:
    """Returns (schedule ns per step, update_from_result ns per step)."""
    blocks_per_request = -(-(max(PROMPT_LENS) + steps + 64) // BLOCK_SIZE)
    config = SchedulerConfig(
        block_size=BLOCK_SIZE,
        num_blocks=num_requests * blocks_per_request + 64,
        max_num_seqs=num_requests,
        max_num_batched_tokens=8192,
        max_model_len=2048,
        enable_prefix_caching=prefix_caching,
    )
    scheduler = Scheduler(config)
    executor = FakeExecutor.for_scheduler(scheduler, vocab_size=32000, verify_kv=False)
    rng = random.Random(seed)
    for i in range(num_requests):
        prompt = [rng.randrange(32000) for _ in range(rng.choice(PROMPT_LENS))]
        scheduler.add_request(
            Request(f"req-{i}", prompt, SamplingParams(temperature=0.0), max_tokens=1024, ignore_eos=True)
        )
    # Warm up until every request is decoding (one token per step).
    while scheduler.waiting or any(r.num_computed_tokens < r.num_tokens - 1 for r in scheduler.running):
        plan = scheduler.schedule()
        scheduler.update_from_result(plan, executor.execute(plan))

    gc.collect()
    gc.freeze()
    schedule_ns, update_ns = [], []
    for _ in range(steps):
        t0 = time.perf_counter_ns()
        plan = scheduler.schedule()
        t1 = time.perf_counter_ns()
        result = executor.execute(plan)
        t2 = time.perf_counter_ns()
        scheduler.update_from_result(plan, result)
        t3 = time.perf_counter_ns()
        assert len(plan.cached_requests) == num_requests, "benchmark left steady decode"
        schedule_ns.append(t1 - t0)
        update_ns.append(t3 - t2)
    gc.unfreeze()
    return schedule_ns, update_ns


def _ms(values: list[int], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] / 1e6


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="timed decode steps per configuration")
    args = parser.parse_args(argv)
    print(f"command: {' '.join([Path(sys.executable).name, '-m', 'bench.scheduler_cost', *sys.argv[1:]])}")
    # Other processes competing for the CPU inflate the tail; say how busy the machine was.
    print(f"load average: {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    header = f"{'requests':>8} {'prefix cache':>12} | {'schedule median':>15} {'p99':>8}"
    print(f"{header} | {'update median':>13} {'p99':>8}")
    for num_requests in (256, 1024):
        for prefix_caching in (False, True):
            sched, upd = measure(num_requests, prefix_caching, args.steps)
            print(
                f"{num_requests:>8} {'on' if prefix_caching else 'off':>12} | "
                f"{statistics.median(sched) / 1e6:>12.3f} ms {_ms(sched, 0.99):>5.3f} ms | "
                f"{statistics.median(upd) / 1e6:>10.3f} ms {_ms(upd, 0.99):>5.3f} ms"
            )


if __name__ == "__main__":
    main()
