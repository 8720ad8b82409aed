"""How much of wall time the executor is busy at 64 running decodes.

    .venv/bin/python -m bench.overhead [--seconds 20]

Starts both processes with /metrics on, keeps 64 greedy requests decoding, and
compares the executor's step time (pagedserve:executor_step_duration_seconds)
with wall time over a window: the rest is the gRPC hop plus the scheduler.
"""
from __future__ import annotations

import argparse
import random
import threading
import time
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from pagedserve_client import Client
from tests.servers import Servers, free_port


def scrape(port: int, name: str) -> float:
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return next(s.value for f in text_string_to_metric_families(body) for s in f.samples if s.name == name)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--dtype", default="float32")
    a = p.parse_args(argv)
    port = free_port()
    steps_sum, steps_count = "pagedserve:executor_step_duration_seconds_sum", "pagedserve:executor_step_duration_seconds_count"
    with Servers(executor_args=["--dtype", a.dtype, "--metrics-listen", f"127.0.0.1:{port}"]) as s, Client(s.public_addr) as c:
        rng = random.Random(0)
        prompts = [[rng.randrange(100, 40000) for _ in range(64)] for _ in range(64)]
        max_tokens = 400
        threads = [threading.Thread(target=c.complete, kwargs=dict(token_ids=p, max_tokens=max_tokens, ignore_eos=True,
                                                                    temperature=0.0)) for p in prompts]
        for t in threads:
            t.start()
        while c.server_status().num_running < 64:
            time.sleep(0.05)
        time.sleep(2)
        busy0, n0, t0 = scrape(port, steps_sum), scrape(port, steps_count), time.monotonic()
        time.sleep(a.seconds)
        busy1, n1, t1 = scrape(port, steps_sum), scrape(port, steps_count), time.monotonic()
        running = c.server_status().num_running
        busy, wall, steps = busy1 - busy0, t1 - t0, n1 - n0
        print(f"{running} requests still decoding at the end of the window; executor busy {busy:.2f} s of {wall:.2f} s "
              f"wall = {100 * busy / wall:.1f}%; overhead {100 * (1 - busy / wall):.1f}% over {int(steps)} steps "
              f"({1000 * wall / steps:.0f} ms/step wall, {1000 * busy / steps:.0f} ms/step busy)")
        for t in threads:
            t.join()


if __name__ == "__main__":
    main()
