"""Decode steps of a bfloat16 model, the native bf16 kernels on and off, interleaved in one process.

    .venv/bin/python -m bench.fused_ops_ab [--rounds 5] [--num-threads 2] [--batch-sizes 1,16,64]
        [--context 512] [--cpu-gemm torch|auto] [--profile]

A bfloat16 model keeps bfloat16 activations where it is not widened to
float32 arithmetic (weight_packing.widen_bf16): here with --cpu-gemm torch,
torch's own bf16 GEMM (emulated on CPUs without AVX512-BF16). Its norms,
rope, SwiGLU gate and KV writes then run through native/fused_ops_bf16.c, or, with the
kernels switched off (fused_ops reporting no bf16 library, as before they
existed), through the model's plain-torch code. With --cpu-gemm auto the
model is widened instead (float32 activations, the default on CPU), and
what the switch changes is the KV write only: float32 K/V rounded into the
bf16 cache natively or by torch. One executor, the same rows
as bench.forward_sweep's batch sweep; each round times 2 steps per setting
and row, the order alternating round by round so that load from other
processes falls on both alike. Prints the median step and forward times of
each and their ratio. --profile instead prints torch.profiler's busiest
operators over one step (ModelRunner.execute) per row and setting, the
native calls among them as "native::<function>".
"""

from __future__ import annotations

import argparse
import functools
import itertools
import statistics

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from bench.forward_sweep import BLOCK_SIZE, FIRST_TOKEN, TimedModel, kv_gib_needed, make_plan, time_row
from executor_svc import fused_ops
from executor_svc.config import ExecutorConfig
from executor_svc.model_loader import open_checkpoint
from executor_svc.worker import Worker
from shared.logging import configure_logging

NATIVE_CALLS = ("rms_norm", "add_rms_norm", "rope_", "silu_mul", "write_kv")


def _recorded(name: str, fn):
    """fn inside a profiler range: the ctypes calls are no torch operators of their own."""

    @functools.wraps(fn)
    def wrapper(*args):
        with record_function(f"native::{name}"):
            return fn(*args)

    return wrapper


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5, help="alternations; each times 2 steps per setting and row")
    p.add_argument("--num-threads", type=int, default=2)
    p.add_argument("--batch-sizes", default="1,16,64")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--cpu-gemm", choices=("torch", "auto"), default="torch", help="torch: bf16 activations")
    p.add_argument("--profile", action="store_true", help="torch.profiler tables instead of timings")
    a = p.parse_args(argv)
    configure_logging("warning", False)
    torch.set_num_threads(a.num_threads)
    rows = [dict(sweep="batch", batch=int(b), context=a.context, new=1) for b in a.batch_sizes.split(",")]
    gib = kv_gib_needed(open_checkpoint(None)[0].config, torch.bfloat16, rows)
    worker = Worker(ExecutorConfig(kv_cache_gib=gib, num_threads=a.num_threads, dtype="bfloat16", cpu_gemm=a.cpu_gemm))
    batch = max(r["batch"] for r in rows)
    worker.configure(block_size=BLOCK_SIZE, max_num_batched_tokens=batch, max_num_seqs=batch)
    widened = worker.model.compute_dtype == torch.float32
    assert widened == (a.cpu_gemm == "auto"), f"--cpu-gemm {a.cpu_gemm} gave {worker.model.compute_dtype} activations"
    timed = worker.runner.model = TimedModel(worker.runner.model)
    kernels = fused_ops._LIBRARIES[torch.bfloat16]
    assert kernels() is not None, "no native bf16 kernels here (needs AVX-512 and a C compiler)"

    def use(on: bool) -> None:
        fused_ops._LIBRARIES[torch.bfloat16] = kernels if on else lambda: None

    steps, gen = itertools.count(1), torch.Generator().manual_seed(0)
    unwrapped = {name: getattr(fused_ops, name) for name in NATIVE_CALLS}
    if a.profile:  # the model and the CPU backend look these up in fused_ops at each call
        for name, fn in unwrapped.items():
            setattr(fused_ops, name, _recorded(name, fn))
    try:
        for row in rows:
            if a.profile:
                for on in (False, True):
                    use(on)
                    time_row(worker, timed, row, 1, steps, gen)  # warm
                    shape = (row["batch"], row["context"])
                    tokens = torch.randint(FIRST_TOKEN, worker.model_config.vocab_size, shape, generator=gen).tolist()
                    plan = make_plan(next(steps), row, tokens, [])
                    with profile(activities=[ProfilerActivity.CPU]) as prof:
                        worker.runner.execute(plan)
                    worker.runner.reset()
                    print(f"batch {row['batch']}, context {row['context']}, bf16 fused ops {'on' if on else 'off'}")
                    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18), flush=True)
                continue
            ms: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
            for r in range(a.rounds):
                for on in (True, False) if r % 2 == 0 else (False, True):
                    use(on)
                    step_s, fwd_s = time_row(worker, timed, row, 2, steps, gen)
                    ms[on].append((1e3 * step_s, 1e3 * fwd_s))
            step = {on: statistics.median(s for s, _ in v) for on, v in ms.items()}
            fwd = {on: statistics.median(f for _, f in v) for on, v in ms.items()}
            print(
                f"batch {row['batch']:4} context {row['context']}: step ms off {step[False]:8.1f} on {step[True]:8.1f}"
                f" ({step[False] / step[True]:.2f}x); forward ms off {fwd[False]:8.1f} on {fwd[True]:8.1f}"
                f" ({fwd[False] / fwd[True]:.2f}x)",
                flush=True,
            )
    finally:
        use(True)
        for name, fn in unwrapped.items():
            setattr(fused_ops, name, fn)


if __name__ == "__main__":
    main()
