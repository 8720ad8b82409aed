"""Decode step times under each --omp-wait-policy, on quiet cores and beside a busy process.

    .venv/bin/python -m bench.omp_wait [--rounds 2] [--batch-sizes 1,8,64] [--policies default,passive]

The OpenMP runtime reads its wait policy once, when torch loads, so every
(policy, condition) runs in a fresh interpreter (`--child`), which sets the
policy the way the executor's main does, loads the executor's Worker and
times synthetic decode steps (context 256) as bench.forward_sweep does. The
conditions: quiet, and "busy", with one other process spinning on a core, the
way a co-located busy process takes one. Rounds interleave the policies;
the table has each round's median step time in ms.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

CONTEXT, ROUNDS_PER_POINT = 256, 5
SPIN = "while True: pass"


def child(policy: str, batch_sizes: list[int]) -> None:
    from executor_svc.__main__ import set_omp_wait_policy

    set_omp_wait_policy(policy)  # before torch loads, as in the executor
    import itertools

    import torch

    from bench import forward_sweep as fs
    from executor_svc.config import ExecutorConfig
    from executor_svc.model_loader import open_checkpoint
    from executor_svc.worker import Worker
    from shared.logging import configure_logging

    configure_logging("warning", json=False)
    rows = [dict(batch=b, context=CONTEXT, new=1) for b in batch_sizes]
    gib = fs.kv_gib_needed(open_checkpoint(None)[0].config, torch.float32, rows)
    worker = Worker(ExecutorConfig(dtype="float32", kv_cache_gib=gib, num_threads=2))
    worker.configure(block_size=fs.BLOCK_SIZE, max_num_batched_tokens=2048, max_num_seqs=max(batch_sizes))
    timed = worker.runner.model = fs.TimedModel(worker.runner.model)
    steps, gen = itertools.count(1), torch.Generator().manual_seed(0)
    out = {str(r["batch"]): 1e3 * fs.time_row(worker, timed, r, ROUNDS_PER_POINT, steps, gen)[0] for r in rows}
    print(json.dumps(out), flush=True)


def run_child(policy: str, batch_sizes: str, busy: bool) -> dict:
    spinner = subprocess.Popen([sys.executable, "-c", SPIN]) if busy else None
    try:
        out = subprocess.run(
            [sys.executable, "-m", "bench.omp_wait", "--child", policy, "--batch-sizes", batch_sizes],
            capture_output=True,
            text=True,
            timeout=900,
            check=True,
        )
    finally:
        if spinner is not None:
            spinner.kill()
            spinner.wait()
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--batch-sizes", default="1,8,64")
    p.add_argument("--policies", default="default,passive")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    batch_sizes = [int(b) for b in a.batch_sizes.split(",")]
    from executor_svc.config import OMP_WAIT_POLICIES

    unknown = set(a.policies.split(",")) - set(OMP_WAIT_POLICIES)
    if unknown:
        p.error(f"unknown policies {sorted(unknown)}; expected some of {', '.join(OMP_WAIT_POLICIES)}")
    if a.child:
        child(a.child, batch_sizes)
        return
    print("| round | condition | policy | " + " | ".join(f"{b} decodes (ms)" for b in batch_sizes) + " |")
    print("|---|---|---|" + "---:|" * len(batch_sizes))
    for r in range(1, a.rounds + 1):
        for busy in (False, True):
            for policy in a.policies.split(","):
                ms = run_child(policy, a.batch_sizes, busy)
                cells = " | ".join(f"{ms[str(b)]:.1f}" for b in batch_sizes)
                print(f"| {r} | {'busy' if busy else 'quiet'} | {policy} | {cells} |", flush=True)


if __name__ == "__main__":
    main()
