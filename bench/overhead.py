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

over the steps after the first ten (start-up, warm-up and admission).
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


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max-tokens", type=int, default=120, help="tokens each request decodes")
    p.add_argument("--dtype", default="float32")
    a = p.parse_args(argv)
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(PROMPT_LEN)] for _ in range(NUM_REQUESTS)]
    with Servers(executor_args=["--dtype", a.dtype], scheduler_args=["--log-level", "debug", "--log-json"]) as s, \
            Client(s.public_addr) as c:
        threads = [threading.Thread(target=c.complete, kwargs=dict(token_ids=prompt, max_tokens=a.max_tokens,
                                                                    ignore_eos=True, temperature=0.0))
                   for prompt in prompts]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        steps = step_lines(s.logs("scheduler"))
    if len(steps) <= SKIP + 1:
        raise RuntimeError(f"only {len(steps)} steps logged; raise --max-tokens")
    ends = [datetime.fromisoformat(x["timestamp"].replace("Z", "+00:00")).timestamp() for x in steps]
    execute = [x["execute_ms"] / 1e3 for x in steps]
    wall = ends[-1] - ends[SKIP]
    busy = sum(execute[SKIP + 1:])
    gaps = [1e3 * (ends[i] - ends[i - 1] - execute[i]) for i in range(SKIP + 1, len(steps))]
    print(f"{len(steps) - SKIP - 1} steps: wall {wall:.2f} s, executor busy {busy:.2f} s = {100 * busy / wall:.1f}%; "
          f"overhead {100 * (1 - busy / wall):.1f}%; per step {1e3 * wall / len(gaps):.0f} ms wall, around the "
          f"executor median {statistics.median(gaps):.1f} ms (min {min(gaps):.1f}, max {max(gaps):.1f})")


if __name__ == "__main__":
    main()
