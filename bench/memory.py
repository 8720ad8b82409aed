"""KV-cache waste and concurrency: paged blocks versus reserving the maximum per request.

    python -m bench memory [--kv-cache-gib 0.1 --max-model-len 1024] [--interval 0.05]

Runs the throughput workload against an engine with a small, fixed KV budget
and samples GetServerStatus(include_requests=True) while it runs. For each
sample, over the requests RUNNING at that moment:

    paged:      [tok tok tok tok | tok tok . . ]    allocated = kv_blocks x block_size
    reserve:    [tok tok tok tok | tok tok . . . . . . . . . . ]  prompt + max_tokens
    reserve max:[tok tok tok tok | tok tok . . . . . . . . . . . . . . . . ]  max_model_len
                 ^ held = computed tokens: KV written, or being written by the step
                   in flight (the scheduler counts a step's tokens as computed
                   when it schedules them, as vLLM does)

    waste = (slots allocated - tokens held) / slots allocated

computed for the paged cache as the server reports it, and for two
reserve-the-maximum allocators (prompt + max_tokens, or max_model_len per
request) on the same running set. Waste is averaged over samples.
Concurrency: the most requests RUNNING at once under the budget, against
how many each reserving allocator could admit: budget_tokens / mean(prompt +
max_tokens), and budget_tokens / max_model_len.
"""

from __future__ import annotations

import asyncio
import os
import statistics

from bench import report
from bench.driver import model_info, run_requests, warm_up
from bench.run_servers import EngineFlags, running_engine
from bench.workloads import add_workload_args, check_fits, describe, workload_from_args
from pagedserve.v1 import generation_pb2 as pb
from pagedserve_client import Client

SUITE = "memory"
DEFAULT_KV_GIB = 0.1
DEFAULT_MAX_MODEL_LEN = 1024


def add_args(p) -> None:
    add_workload_args(p)
    p.add_argument(
        "--max-model-len",
        type=int,
        default=DEFAULT_MAX_MODEL_LEN,
        help="the executor's --max-model-len (the reserve-max_model_len comparison uses it)",
    )
    p.add_argument("--interval", type=float, default=0.05, help="seconds between status samples")
    p.add_argument("--block-size", type=int, default=None, help="the scheduler's --block-size (its default if unset)")


def sample_stats(
    status: pb.ServerStatus, max_tokens: dict[str, int], block_size: int, max_model_len: int
) -> dict | None:
    """One sample's slot accounting over the running requests; None when nothing runs."""
    # Only this run's requests (ids it chose): another client's would have no known max_tokens.
    running = [r for r in status.requests if r.status == pb.REQUEST_STATUS_RUNNING and r.request_id in max_tokens]
    if not running:
        return None
    held = sum(r.computed_tokens for r in running)
    paged = sum(r.kv_blocks for r in running) * block_size
    reserve = sum(r.prompt_tokens + max_tokens[r.request_id] for r in running)
    reserve_max = len(running) * max_model_len
    assert paged >= held, f"server reports {held} computed tokens in {paged} allocated slots"
    return dict(
        num_running=len(running),
        held_tokens=held,
        paged_slots=paged,
        reserve_slots=reserve,
        reserve_max_slots=reserve_max,
        kv_blocks_used=status.kv_blocks_used,
        paged_waste=1 - held / paged if paged else 0.0,
        reserve_waste=1 - held / reserve,
        reserve_max_waste=1 - held / reserve_max,
    )


def summarize(samples: list[dict], requests, budget_tokens: int, max_model_len: int) -> dict:
    if not samples:
        raise RuntimeError("no status sample saw a running request; lower --interval")
    mean_reserve = statistics.mean(r.prompt_len + r.max_tokens for r in requests)
    return dict(
        num_samples=len(samples),
        budget_tokens=budget_tokens,
        waste=dict(
            paged=statistics.mean(s["paged_waste"] for s in samples),
            reserve_prompt_plus_max_tokens=statistics.mean(s["reserve_waste"] for s in samples),
            reserve_max_model_len=statistics.mean(s["reserve_max_waste"] for s in samples),
        ),
        concurrency=dict(
            paged_max_running=max(s["num_running"] for s in samples),
            paged_median_running=statistics.median(s["num_running"] for s in samples),
            reserve_prompt_plus_max_tokens=int(budget_tokens // mean_reserve),
            reserve_max_model_len=budget_tokens // max_model_len,
        ),
        max_kv_blocks_used=max(s["kv_blocks_used"] for s in samples),
    )


def chart(result: dict, path) -> None:
    s = result["summary"]
    w, c = s["waste"], s["concurrency"]
    report.bar_panels(
        path,
        f"KV cache: paged vs reserve-the-maximum, budget {s['budget_tokens']} tokens",
        {
            "KV waste, mean over samples (%)": {
                "paged": 100 * w["paged"],
                "reserve\nprompt+max": 100 * w["reserve_prompt_plus_max_tokens"],
                "reserve\nmax_model_len": 100 * w["reserve_max_model_len"],
            },
            "concurrent requests": {
                "paged (max seen)": c["paged_max_running"],
                "reserve\nprompt+max": c["reserve_prompt_plus_max_tokens"],
                "reserve\nmax_model_len": c["reserve_max_model_len"],
            },
        },
        subtitle=f"{result['workload']['num_requests']} requests, max_model_len {result['max_model_len']}",
    )


def main(args, argv: list[str]) -> dict:
    kv_gib = args.kv_cache_gib if args.kv_cache_gib is not None else DEFAULT_KV_GIB
    flags = EngineFlags(
        dtype=args.dtype,
        num_threads=args.num_threads,
        kv_cache_gib=kv_gib,
        max_model_len=args.max_model_len,
        block_size=args.block_size,
    )
    result = report.new_result(SUITE, argv)
    result["engine_flags"] = flags.as_dict()
    samples: list[dict] = []
    with running_engine(flags, args.target) as target:
        info = model_info(target)
        result["model_info"] = info
        block_size, max_model_len = int(info["block_size_tokens"]), int(info["max_model_len_tokens"])
        result["max_model_len"] = max_model_len
        with Client(target) as c:
            requests = workload_from_args(args, int(info["vocab_size"]), c.tokenize)
            check_fits(requests, max_model_len, int(info["vocab_size"]))
            warm_up(target, int(info["vocab_size"]))
            before = c.server_status()
        result["workload"] = describe(requests)
        id_prefix = f"memory-{os.getpid()}"
        max_tokens = {f"{id_prefix}-{i}": r.max_tokens for i, r in enumerate(requests)}

        async def sample(client):
            while True:
                s = sample_stats(
                    await client.server_status(include_requests=True), max_tokens, block_size, max_model_len
                )
                if s is not None:
                    samples.append(s)
                await asyncio.sleep(args.interval)

        progress = report.Progress(f"[{SUITE} kv {kv_gib} GiB]", len(requests))
        run = run_requests(target, requests, on_done=progress.step, during=sample, id_prefix=id_prefix)
        with Client(target) as c:
            after = c.server_status()
    budget = int(before.kv_blocks_total) * block_size
    result["summary"] = summarize(samples, requests, budget, max_model_len)
    result["summary"]["num_preemptions"] = after.num_preemptions - before.num_preemptions
    result["summary"]["output_tokens_per_s"] = run.output_tokens / run.duration_s
    s = result["summary"]
    print(
        report.format_table(
            ["allocator", "KV waste (mean)", "max concurrent requests"],
            [
                ["paged (measured)", f"{s['waste']['paged']:.1%}", s["concurrency"]["paged_max_running"]],
                [
                    "reserve prompt+max_tokens",
                    f"{s['waste']['reserve_prompt_plus_max_tokens']:.1%}",
                    s["concurrency"]["reserve_prompt_plus_max_tokens"],
                ],
                [
                    f"reserve max_model_len ({max_model_len})",
                    f"{s['waste']['reserve_max_model_len']:.1%}",
                    s["concurrency"]["reserve_max_model_len"],
                ],
            ],
        )
    )
    print(
        f"KV budget {budget} tokens ({before.kv_blocks_total} blocks of {block_size}); {s['num_samples']} samples; "
        f"{s['num_preemptions']} preemptions"
    )
    report.save(result, SUITE, args.out_dir, None if args.no_chart else chart)
    return result
