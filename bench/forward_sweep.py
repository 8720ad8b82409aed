"""Forward time per step against batch size and context length, between the CPU's matmul
ceiling and its memory read floor.

    .venv/bin/python -m bench.forward_sweep [--dtypes float32,bfloat16] [--num-threads 0] [--rounds 5]
        [--batch-sizes 1,2,4,8,16,32,64,128,256 --context 256] [--contexts 128,256,512,1024,2048 --batch 64]
        [--prefill-tokens 256 --prefill-batch 8] [--kv-cache-gib 0] [--gguf-blocks auto] [--decoder-stack auto] [--bandwidth-mib 0]
        [--out-dir DIR] [--no-chart]

In process, no gRPC: the executor's Worker (the embedded SmolLM2-135M unless
--model) runs synthetic step plans through ModelRunner.execute, the call the
executor server makes once per step, in a process set up as the executor's
is: its heap maps no block per use (executor_svc/heap.py; without it the
logits of 170 decodes or more, past 32 MiB, were faulted in at every step)
and the objects alive after the load are frozen out of the garbage collector
(shared/gc_startup.py). A decode at context c is a request of c
random tokens whose first c-1 count as cached (num_computed_tokens = c-1; KV
contents do not change the time) and one scheduled token, in ceil(c/16)
blocks of its own: no two requests share a block, as in a real cache, so
attention reads as much memory as it would in service. Each timed step sends
fresh request ids and finishes the previous step's, so the runner only ever
holds one batch; sending requests as new rather than cached costs a copy of
their token lists, small beside the forward. A prefill row is one step of
--prefill-batch requests with --prefill-tokens new tokens each, none cached.

On a machine shared with busy processes, run it with OMP_WAIT_POLICY=PASSIVE
(what the executor's --omp-wait-policy passive sets): with libgomp's spinning
default a batch-1 step of the embedded model took 1.3 s there instead of 44 ms.
Times are medians over --rounds steps after 2 warm-up steps. "step" is all of
execute() (plan, inputs, forward, LM head, sampling); "fwd" is the model call
alone. "tok/s" is scheduled tokens per second (for decodes, tokens generated).

Achieved GFLOP/s counts matmul work only, at 2 FLOPs per weight per token:

    flops = 2 * (P * tokens + V * H * sampled)

P is the non-embedding parameters (every scheduled token passes every layer);
V * H is the LM head, applied only to the sampled tokens (one per decode, one
per prefill request). Attention over the context, 4 * context * H FLOPs per
token and layer, is not counted: long contexts fall below the ceiling by that
work as well as by its memory traffic.

The ceiling is the best median GFLOP/s of torch.mm with the same threads,
at the model's MLP shape [T, H] x [H, I] for a few T (the weight a
contiguous [in, out] matrix, as the model stores it) and at 2048^3, in the
dtype the model computes in (float32 for a bfloat16 model widened for the
native kernel) and, for a bfloat16 model, in bfloat16 as well: "ceil ms" is
a step's FLOPs at the faster of the two, its time if all its work were
matmul at the machine's best. On CPUs without AVX512-BF16 or AMX
(machine.cpu_has_fast_bf16) torch emulates the bfloat16 GEMM, far below the
hardware's float32 rate; the printout says so.

The floor is the other bound: the bytes a step must read over the machine's
read bandwidth (bench/membw.py: the faster of a copy and a sum over a tensor
4x the LLC, same threads). "wt MB" is the linear weights and LM head in the
representation the engine reads for that row count (packed_linear.route:
float32 panels, BF16 or GGUF block panels, oneDNN's copy or the plain
tensor; bench/step_bytes.py), "KV MB" the K and V of every token of every
request; "wt floor ms" and "wt+KV floor ms" are their read times, and
"x floor" is step ms over the wt+KV floor. (Issue 18's "batch 1 at <= 2x
the weight-read time" is printed against the weights alone.) The embedded
model is a Q4_1 GGUF: with --gguf-blocks auto its 1-32 row steps read 96 MB
of blocks, in either dtype; --gguf-blocks off reads the 270 MB of BF16 blocks.

Context sweep: "attn GB/s" is attention's K/V read rate estimated from the
difference to the same batch's step at the shortest context, and "of copy"
its fraction of the copy bandwidth (read + written bytes, as
bench.kv_read_bandwidth counts it):

    attn GB/s = (KV bytes at c - KV bytes at c0) / (step at c - step at c0)

(the step at c0 reads its own KV too: the extra time pays for the extra bytes
only). The assumption: everything in a decode step but attention costs the same
at every context (the linears, norms, rope, head and sampling see one token
per request whatever its context), so the extra time of a longer context is
attention reading the extra K/V. Attention's own context-independent cost
cancels out; noise in two step times does not, so short context spans (or
a busy machine) give a loose estimate, and a row whose step is no slower
than the shortest context's gets none.

Per dtype, the printout (forward_sweep_report.py) gives the ceiling beside
the floor, then issue 18's targets read off the rows where the sweep has
them: batch 64 (batch sweep) at >= 0.6 of the ceiling, batch 1 at <= 2x the
weights' read floor, attention at >= 0.6 of the copy bandwidth (judged at the
longest context; "unsure" where the estimate beats every read rate measured,
which only noise in the two step times can do). They are bfloat16 targets
for CPUs with AVX512-BF16.
The result JSON (bench/report.py) holds every figure: per row the bytes by
route, the floors and the attention rate; per dtype "ceiling", "bandwidth"
and "targets".
"""

from __future__ import annotations

import argparse
import gc
import itertools
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from bench import forward_sweep_report, membw, report, step_bytes
from executor_svc.config import GGUF_ACTIVATIONS, GGUF_BLOCKS, ExecutorConfig
from executor_svc.heap import keep_freed_memory, release_free_memory
from executor_svc.kv_cache import GIB, bytes_per_block
from executor_svc.machine import cpu_has_fast_bf16
from executor_svc.model_loader import open_checkpoint
from executor_svc.worker import Worker
from shared.gc_startup import freeze_startup_objects
from shared.logging import configure_logging
from shared.sampling_params import SamplingParams
from shared.step_plan import NewRequestData, StepPlan

SUITE = "forward_sweep"
BLOCK_SIZE = 16
WARMUP = 2
GREEDY = SamplingParams(temperature=0.0)
FIRST_TOKEN = 100  # SmolLM2's special tokens sit below this; synthetic text uses ordinary ones


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.forward_sweep", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--batch-sizes", type=ints, default=ints("1,2,4,8,16,32,64,128,256"), help="decodes per step in the batch sweep"
    )
    p.add_argument("--context", type=int, default=256, help="context of every decode in the batch sweep")
    p.add_argument("--contexts", type=ints, default=ints("128,256,512,1024,2048"), help="the context sweep")
    p.add_argument("--batch", type=int, default=64, help="decodes per step in the context sweep")
    p.add_argument(
        "--prefill-tokens",
        type=ints,
        default=ints("256"),
        help="new tokens per request in the prefill rows ('' for none)",
    )
    p.add_argument("--prefill-batch", type=int, default=8, help="requests in each prefill step")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--num-threads", type=int, default=0, help="torch threads (0 = torch's default)")
    p.add_argument(
        "--cpu-gemm",
        default="auto",
        choices=("auto", "native", "torch"),
        help="the executor's --cpu-gemm, for every dtype (native: packed AVX-512 kernel; torch: MKL, and for "
        "bfloat16 torch's own bf16 GEMM with bfloat16 activations)",
    )
    p.add_argument(
        "--gguf-blocks",
        default="auto",
        choices=GGUF_BLOCKS,
        help="the executor's --gguf-blocks (auto: 1-32 rows of a GGUF model, the embedded one included, read "
        "its Q4_1/Q8_0 blocks, and the read floor counts those; off: the float32 panels or BF16 blocks)",
    )
    p.add_argument(
        "--decoder-stack",
        default="auto",
        choices=("auto", "off"),
        help="the executor's --decoder-stack (auto: decode steps run their layers in one native call)",
    )
    p.add_argument(
        "--gguf-activations",
        default="float",
        choices=GGUF_ACTIVATIONS,
        help="the executor's --gguf-activations (int8: the rows that read GGUF blocks quantise their "
        "activations to int8, on CPUs with AVX512-VNNI)",
    )
    p.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=("auto", "int8"),
        help="the executor's --kv-cache-dtype (auto: the dtype's own; int8: one byte a value and a scale per "
        "token and KV head, which the KV bytes and their floor count)",
    )
    p.add_argument("--rounds", type=int, default=5, help="timed steps per row (median), after 2 warm-ups")
    p.add_argument("--model", default=None, help="model path (default: the embedded SmolLM2-135M)")
    p.add_argument(
        "--kv-cache-gib",
        type=float,
        default=0,
        help="KV budget (0 = just what the largest row needs, computed per dtype)",
    )
    p.add_argument(
        "--bandwidth-mib",
        type=int,
        default=0,
        help="tensor size for the bandwidth measurement (0 = 4x the last-level cache, at least 256 MiB)",
    )
    p.add_argument("--out-dir", type=Path, default=None, help=f"results folder (default {report.RESULTS_DIR})")
    p.add_argument("--no-chart", action="store_true", help="skip the PNG")
    return p


def sweep_rows(args) -> list[dict]:
    """Every row to time; `new` is the scheduled tokens per request (1 for a decode)."""
    rows = [dict(sweep="batch", batch=b, context=args.context, new=1) for b in args.batch_sizes]
    rows += [dict(sweep="context", batch=args.batch, context=c, new=1) for c in args.contexts]
    rows += [dict(sweep="prefill", batch=args.prefill_batch, context=n, new=n) for n in args.prefill_tokens]
    if not rows or any(r["batch"] < 1 or r["context"] < 1 for r in rows) or args.rounds < 1:
        raise ValueError("batch sizes, contexts and --rounds must be >= 1, and there must be at least one row")
    return rows


def blocks_per_request(context: int) -> int:
    return -(-context // BLOCK_SIZE)


def kv_gib_needed(config, dtype: torch.dtype, rows: list[dict]) -> float:
    # + block 0 (reserved) + one more so float rounding of the GiB figure never loses a block.
    blocks = max(r["batch"] * blocks_per_request(r["context"]) for r in rows) + 2
    return blocks * bytes_per_block(config, BLOCK_SIZE, dtype) / GIB


class TimedModel:
    """Stands in for runner.model and times its forward call; everything else passes through."""

    def __init__(self, model):
        self.model, self.last_s = model, 0.0

    def __call__(self, *args):
        t0 = time.perf_counter()
        out = self.model(*args)
        self.last_s = time.perf_counter() - t0
        return out

    def __getattr__(self, name):
        return getattr(self.model, name)


def matmul_ceiling(dtype: torch.dtype, hidden: int, intermediate: int, rounds: int) -> dict:
    """Median GFLOP/s of torch.mm in `dtype` per shape (M x K x N), and the best of them."""
    shapes = [(t, hidden, intermediate) for t in (64, 256, 2048)] + [(2048, 2048, 2048)]
    gen = torch.Generator().manual_seed(0)
    gflops = {}
    for m, k, n in shapes:
        x = torch.randn(m, k, generator=gen).to(dtype)
        w = torch.randn(k, n, generator=gen).to(dtype)
        times = []
        for i in range(WARMUP + rounds):
            t0 = time.perf_counter()
            torch.mm(x, w)
            if i >= WARMUP:
                times.append(time.perf_counter() - t0)
        gflops[f"{m}x{k}x{n}"] = 2 * m * k * n / statistics.median(times) / 1e9
    return dict(gflops_by_shape=gflops, best_gflops=max(gflops.values()))


def ceilings(worker: Worker, rounds: int) -> dict:
    """torch.mm's ceiling in the dtype the model computes in and, for a bfloat16
    model, in bfloat16 too; `best_gflops` is the faster one's, `best_dtype` names it."""
    cfg = worker.model_config
    dtypes = [worker.model.compute_dtype]
    if worker.dtype == torch.bfloat16 and torch.bfloat16 not in dtypes:
        dtypes.append(torch.bfloat16)
    by_dtype = {
        str(d).removeprefix("torch."): matmul_ceiling(d, cfg.hidden_size, cfg.intermediate_size, rounds) for d in dtypes
    }
    best = max(by_dtype, key=lambda d: by_dtype[d]["best_gflops"])
    return dict(
        by_dtype=by_dtype,
        best_dtype=best,
        best_gflops=by_dtype[best]["best_gflops"],
        cpu_has_fast_bf16=cpu_has_fast_bf16(),
    )


def make_plan(step: int, row: dict, tokens: list[list[int]], finished: list[str]) -> StepPlan:
    n_blocks = blocks_per_request(row["context"])
    requests = [
        NewRequestData(
            f"s{step}-r{i}",
            tokens[i],
            row["context"],
            GREEDY,
            list(range(1 + i * n_blocks, 1 + (i + 1) * n_blocks)),
            row["context"] - row["new"],
            row["new"],
        )
        for i in range(row["batch"])
    ]
    return StepPlan(step, requests, finished_request_ids=finished)


def time_row(worker: Worker, timed: TimedModel, row: dict, rounds: int, steps, gen) -> tuple[float, float]:
    """Median (step seconds, forward seconds) over `rounds` steps after the warm-ups."""
    runner = worker.runner
    tokens = torch.randint(
        FIRST_TOKEN, worker.model_config.vocab_size, (row["batch"], row["context"]), generator=gen
    ).tolist()
    finished, step_s, fwd_s = [], [], []
    for k in range(WARMUP + rounds):
        plan = make_plan(next(steps), row, tokens, finished)
        t0 = time.perf_counter()
        result = runner.execute(plan)
        elapsed = time.perf_counter() - t0
        if result.error or len(result.sampled) != row["batch"]:
            raise RuntimeError(f"step failed for {row}: {result.error or 'not every request sampled'}")
        finished = [r.request_id for r in plan.new_requests]
        if k >= WARMUP:
            step_s.append(elapsed)
            fwd_s.append(timed.last_s)
    runner.reset()
    return statistics.median(step_s), statistics.median(fwd_s)


def run_dtype(args, dtype_name: str, rows: list[dict], progress: report.Progress) -> tuple[dict, dict, dict, list]:
    """(model facts, matmul ceiling, memory bandwidth, measured rows) for one dtype."""
    config = open_checkpoint(args.model)[0].config
    kv_dtype = torch.int8 if args.kv_cache_dtype == "int8" else getattr(torch, dtype_name)
    gib = args.kv_cache_gib or kv_gib_needed(config, kv_dtype, rows)
    worker = Worker(
        ExecutorConfig(
            model=args.model,
            dtype=dtype_name,
            kv_cache_gib=gib,
            num_threads=args.num_threads,
            cpu_gemm=args.cpu_gemm,
            gguf_blocks=args.gguf_blocks,
            decoder_stack=args.decoder_stack,
            gguf_activations=args.gguf_activations,
            kv_cache_dtype=args.kv_cache_dtype,
        )
    )
    too_long = [r["context"] for r in rows if r["context"] > worker.max_model_len]
    if too_long:
        raise ValueError(f"contexts {too_long} exceed the model's {worker.max_model_len} positions")
    max_tokens = max(r["batch"] * r["new"] for r in rows)
    worker.configure(
        block_size=BLOCK_SIZE, max_num_batched_tokens=max_tokens, max_num_seqs=max(r["batch"] for r in rows)
    )
    timed = worker.runner.model = TimedModel(worker.runner.model)
    # As the executor does once its model is loaded (executor_svc/__main__.py).
    freeze_startup_objects()
    release_free_memory()

    cfg = worker.model_config
    head = cfg.vocab_size * cfg.hidden_size
    # The embedding is a lookup, and the LM head (tied or not) runs on sampled tokens only: count it apart.
    body = sum(p.numel() for name, p in worker.model.named_parameters() if name not in ("embed_tokens", "lm_head"))
    model = dict(
        name=cfg.model_name,
        non_embedding_params=body,
        head_params=head,
        hidden=cfg.hidden_size,
        vocab=cfg.vocab_size,
        layers=cfg.num_hidden_layers,
        kv_cache_gib=round(gib, 4),
        kv_cache_dtype=str(worker.kv_dtype).removeprefix("torch."),
    )
    ceiling = ceilings(worker, args.rounds)
    bandwidth = membw.measure(args.rounds, args.bandwidth_mib * membw.MIB)
    floor_bps = bandwidth["floor_bytes_per_s"]

    out, steps, gen = [], itertools.count(1), torch.Generator().manual_seed(0)
    for row in rows:
        step_s, fwd_s = time_row(worker, timed, row, args.rounds, steps, gen)
        tokens = row["batch"] * row["new"]
        flops = 2 * (body * tokens + head * row["batch"])
        ceil_s = flops / (ceiling["best_gflops"] * 1e9)
        weights = step_bytes.weight_read_bytes(worker.model, tokens, row["batch"])
        weight_bytes = sum(weights.values())
        kv = step_bytes.kv_read_bytes(cfg, worker.kv_dtype, row["batch"], row["context"])
        floor_s = (weight_bytes + kv) / floor_bps
        out.append(
            dict(
                row,
                dtype=dtype_name,
                tokens=tokens,
                step_ms=step_s * 1e3,
                forward_ms=fwd_s * 1e3,
                tokens_per_s=tokens / step_s,
                flops=flops,
                gflops=flops / step_s / 1e9,
                ceiling_ms=ceil_s * 1e3,
                fraction_of_ceiling=ceil_s / step_s,
                weight_bytes=weight_bytes,
                weight_bytes_by_route=weights,
                kv_bytes=kv,
                weight_floor_ms=weight_bytes / floor_bps * 1e3,
                floor_ms=floor_s * 1e3,
                times_floor=step_s / floor_s,
            )
        )
        progress.step()
    add_attention_rates(out, bandwidth["copy_bytes_per_s"])
    del worker, timed
    gc.unfreeze()
    gc.collect()  # free this dtype's weights and KV before the next loads
    return model, ceiling, bandwidth, out


def add_attention_rates(rows: list[dict], copy_bps: float) -> None:
    """Context-sweep rows past the shortest context get attention's K/V read
    rate, from the differences to the shortest context's row (module docstring)."""
    sweep = sorted((r for r in rows if r["sweep"] == "context"), key=lambda r: r["context"])
    for r in sweep[1:]:
        extra_s = (r["step_ms"] - sweep[0]["step_ms"]) / 1e3
        if extra_s > 0:
            r["attention_bytes_per_s"] = (r["kv_bytes"] - sweep[0]["kv_bytes"]) / extra_s
            r["attention_of_copy"] = r["attention_bytes_per_s"] / copy_bps


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    args = parser().parse_args(argv)
    rows = sweep_rows(args)
    dtypes = [d for d in args.dtypes.split(",") if d]
    result = report.new_result(SUITE, argv)
    result["command"] = "python -m bench.forward_sweep " + " ".join(argv)  # not a `python -m bench` suite
    result["settings"] = {k: v for k, v in vars(args).items() if k != "out_dir"}
    result["flops_formula"] = "2 * (non_embedding_params * tokens + vocab * hidden * sampled_tokens)"
    result["ceiling"], result["bandwidth"], result["rows"] = {}, {}, []
    progress = report.Progress(f"[{SUITE}]", len(rows) * len(dtypes))
    for dtype_name in dtypes:
        model, result["ceiling"][dtype_name], result["bandwidth"][dtype_name], measured = run_dtype(
            args, dtype_name, rows, progress
        )
        result["model"] = model
        result["rows"] += measured
    result["machine"]["torch_threads"] = torch.get_num_threads()  # as the Worker set them, not as at the start
    result["targets"] = {
        d: forward_sweep_report.issue_18_targets([r for r in result["rows"] if r["dtype"] == d]) for d in dtypes
    }

    print(
        f"{result['model']['name']}: {result['model']['non_embedding_params'] / 1e6:.1f}M non-embedding "
        f"params + {result['model']['head_params'] / 1e6:.1f}M LM head; threads {torch.get_num_threads()}; "
        f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs"
    )
    forward_sweep_report.print_summary(result)
    report.save(result, SUITE, args.out_dir, None if args.no_chart else forward_sweep_report.chart)
    return result


if __name__ == "__main__":
    configure_logging("warning")  # the runner logs every new request at debug level
    keep_freed_memory(steps_on_main_thread=True)  # the executor's heap (executor_svc/heap.py)
    main()
