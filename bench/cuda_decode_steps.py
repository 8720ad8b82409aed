"""Decode and mixed steps in process on CUDA: replayed CUDA graphs against --enforce-eager.

    python -m bench.cuda_decode_steps [--batch-sizes 1,64,256] [--context 256] [--steps 30]
        [--mixed-chunk 256] [--profile]
    python -m bench.cuda_decode_steps --cpu-smoke     # a tiny model on CPU: does the script run?

The executor's Worker (bfloat16, --device cuda, otherwise defaults) over the
random SmolLM2-135M-shaped model of bench/cuda_check.py, once with CUDA
graphs (the default) and once with --enforce-eager. For each batch size B:
B requests of `--context` random tokens are prefilled, then `--steps`
decode steps of all B run through ModelRunner.execute, the call the
executor server makes per step; the median wall time of the steps after
the first five is printed, twice per batch size; then the same with a new
request's `--mixed-chunk`-token prefill beside the B decodes in every step
(a mixed step, as a busy server runs most of its steps). `--profile` adds
torch.profiler's tables (by CPU time, by GPU time) over three eager steps at
the middle batch size: how many kernels a step launches and how long the
CPU takes to launch them against the GPU's time running them.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import tempfile
import time

import torch

from bench import cuda_check
from executor_svc.config import ExecutorConfig
from executor_svc.worker import Worker
from shared.logging import configure_logging
from shared.sampling_params import SamplingParams
from shared.step_plan import CachedRequestData, NewRequestData, StepPlan

GREEDY = SamplingParams(temperature=0.0)
WARMUP = 5
PREFILL_CHUNK = 16  # requests per prefill step


def timed_steps(
    worker: Worker, batch: int, context: int, steps: int, vocab: int, ids, profile: bool = False, chunk: int = 0
):
    """(median step seconds, profiler or None) for `batch` requests decoding at `context`,
    each step beside a new request's `chunk`-token prefill where chunk > 0."""
    runner = worker.runner
    runner.reset()
    blocks_each = (context + steps) // 16 + 2
    gen = torch.Generator().manual_seed(batch)
    tokens = torch.randint(3, vocab, (batch, context), generator=gen).tolist()
    rids = [f"b{batch}-{i}-{next(ids)}" for i in range(batch)]
    for lo in range(0, batch, PREFILL_CHUNK):
        new = [
            NewRequestData(
                rids[i],
                tokens[i],
                context,
                GREEDY,
                list(range(1 + i * blocks_each, 1 + (i + 1) * blocks_each)),
                0,
                context,
            )
            for i in range(lo, min(batch, lo + PREFILL_CHUNK))
        ]
        result = runner.execute(StepPlan(next(ids), new))
        assert not result.error, result.error
    computed, wall, prof, side = context, [], None, None
    side_blocks = list(range(1 + batch * blocks_each, 1 + batch * blocks_each + -(-chunk // 16)))
    side_tokens = torch.randint(3, vocab, (chunk,), generator=gen).tolist()
    for k in range(steps):
        finished = [side] if side else []
        side = f"side-{next(ids)}" if chunk else None
        new = [NewRequestData(side, side_tokens, chunk, GREEDY, side_blocks, 0, chunk)] if chunk else []
        plan = StepPlan(
            next(ids),
            new,
            cached_requests=CachedRequestData(list(rids), [[] for _ in rids], [computed] * batch, [1] * batch),
            finished_request_ids=finished,
        )
        if profile and k == steps - 3:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            prof = torch.profiler.profile(activities=activities)
            prof.__enter__()
        t0 = time.perf_counter()
        result = runner.execute(plan)
        wall.append(time.perf_counter() - t0)
        assert not result.error and len(result.sampled) == batch + bool(chunk), result.error
        computed += 1
    if prof is not None:
        prof.__exit__(None, None, None)
    return statistics.median(wall[WARMUP:]), prof


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch-sizes", default="1,64,256")
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--mixed-chunk", type=int, default=256, help="prefill tokens beside the decodes; 0: skip")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--cpu-smoke", action="store_true")
    args = p.parse_args(argv)
    device = cuda_check.device_for(args.cpu_smoke)
    if device is None:
        return 2
    configure_logging("warning")
    batches = [int(b) for b in args.batch_sizes.split(",")]
    folder = tempfile.mkdtemp(prefix="cuda-steps-")
    vocab = cuda_check.save_model(folder, args.cpu_smoke)
    ids = itertools.count(1)
    for eager in (False, True):
        extra = dict(kv_cache_gib=0.2) if args.cpu_smoke else {}
        worker = Worker(ExecutorConfig(model=folder, dtype="bfloat16", device=device, enforce_eager=eager, **extra))
        # One more request than the largest batch: the mixed steps' new request (a step of more
        # than max_num_seqs requests, which no scheduler sends, would run eagerly).
        worker.configure(block_size=16, max_num_batched_tokens=8192, max_num_seqs=max(batches) + 1)
        print(f"== enforce_eager={eager}, graphs captured: {worker.runner.graphs is not None}", flush=True)
        for batch in batches:
            for rep in range(2):
                step_s, _ = timed_steps(worker, batch, args.context, args.steps, vocab, ids)
                print(f"batch {batch}: decode step {step_s * 1e3:.2f} ms (rep {rep})", flush=True)
            for rep in range(2 if args.mixed_chunk else 0):
                step_s, _ = timed_steps(worker, batch, args.context, args.steps, vocab, ids, chunk=args.mixed_chunk)
                print(
                    f"batch {batch} + {args.mixed_chunk}-token prefill: step {step_s * 1e3:.2f} ms (rep {rep})",
                    flush=True,
                )
        if eager and args.profile:
            middle = batches[len(batches) // 2]
            step_s, prof = timed_steps(worker, middle, args.context, args.steps, vocab, ids, profile=True)
            table = prof.key_averages()
            print(f"-- torch.profiler, 3 eager steps of batch {middle} ({step_s * 1e3:.2f} ms each)")
            print(table.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
            if device == "cuda":
                print(table.table(sort_by="self_device_time_total", row_limit=15, max_name_column_width=60))
        del worker
        if device == "cuda":
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
