"""How much of wall time the executor is busy at 64 running decodes.

    .venv/bin/python -m bench.overhead [--max-tokens 120] [--dtype float32]

Starts both processes (the scheduler logging each step as JSON at debug
level), runs 64 greedy requests (64-token prompts) to completion, and reads
the scheduler's `step` lines: each carries the executor's own execute time
for that step and the scheduler's timestamp at the step's end. Between two
consecutive step ends, the wall time is one step's execute time plus
everything around it (scheduling, plan encoding, the gRPC hop both ways,
applying the result, streaming tokens to clients):

    overhead = 1 - sum(execute) / (t_last - t_first)

over the steps after the first ten (start-up, warm-up and admission). With
overlap scheduling (the default) the next plan is already waiting when a step
ends, so what is left is the executor's own hop: writing a result, reading the
next plan. `--overlap both` (the default) runs with it off, then on.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import threading
from datetime import datetime

from pagedserve_client import Client
from tests.servers import Servers

NUM_REQUESTS, PROMPT_LEN, SKIP = 64, 64, 10


def step_lines(log_text: str) -> list[dict]:
    lines = (json.loads(line) for line in log_text.splitlines() if line.startswith("{") and '"step"' in line)
    return [line for line in lines if line.get("event") == "step"]


def step_stats(steps: list[dict]) -> dict:
    """Over the step lines after the first SKIP: how many, the wall time they span, the
    executor's busy seconds, the gap around each step (ms), and the tokens they computed."""
    if len(steps) <= SKIP + 1:
        raise RuntimeError(f"only {len(steps)} steps logged; raise --max-tokens")
    ends = [datetime.fromisoformat(x["timestamp"].replace("Z", "+00:00")).timestamp() for x in steps]
    execute = [x["execute_ms"] / 1e3 for x in steps]
    return dict(
        steps=len(steps) - SKIP - 1,
        wall=ends[-1] - ends[SKIP],
        busy=sum(execute[SKIP + 1 :]),
        gaps_ms=[1e3 * (ends[i] - ends[i - 1] - execute[i]) for i in range(SKIP + 1, len(steps))],
        tokens=sum(x["num_tokens"] for x in steps[SKIP + 1 :]),
    )


def run_once(prompts: list[list[int]], max_tokens: int, dtype: str, overlap: bool) -> str:
    scheduler_args = ["--log-level", "debug", "--log-json"] + ([] if overlap else ["--no-overlap-scheduling"])
    with Servers(executor_args=["--dtype", dtype], scheduler_args=scheduler_args) as s, Client(s.public_addr) as c:
        threads = [
            threading.Thread(
                target=c.complete,
                kwargs=dict(token_ids=prompt, max_tokens=max_tokens, ignore_eos=True, temperature=0.0),
            )
            for prompt in prompts
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        st = step_stats(step_lines(s.logs("scheduler")))
    wall, busy, gaps = st["wall"], st["busy"], st["gaps_ms"]
    return (
        f"overlap {'on ' if overlap else 'off'}: {st['steps']} steps: wall {wall:.2f} s, executor busy "
        f"{busy:.2f} s = {100 * busy / wall:.1f}%; overhead {100 * (1 - busy / wall):.1f}%; per step "
        f"{1e3 * wall / len(gaps):.0f} ms wall, around the executor median {statistics.median(gaps):.1f} ms "
        f"(min {min(gaps):.1f}, max {max(gaps):.1f})"
    )


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max-tokens", type=int, default=120, help="tokens each request decodes")
    p.add_argument("--dtype", default="float32")
    p.add_argument(
        "--overlap",
        choices=("on", "off", "both"),
        default="both",
        help="overlap scheduling in the scheduler; both = alternate off and on each round",
    )
    p.add_argument("--rounds", type=int, default=1, help="runs of each mode")
    a = p.parse_args(argv)
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(PROMPT_LEN)] for _ in range(NUM_REQUESTS)]
    modes = {"on": [True], "off": [False], "both": [False, True]}[a.overlap]
    for _ in range(a.rounds):
        for overlap in modes:
            print(run_once(prompts, a.max_tokens, a.dtype, overlap), flush=True)


if __name__ == "__main__":
    main()
