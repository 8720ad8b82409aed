"""Prefix caching: requests sharing a long system prompt, cache on versus off.

    python -m bench prefix [--num-requests 32 --prefix-len 1024 --suffix-len 16:48 --output-len 16]

    request i:  [ shared system prompt, 1024 tokens | distinct suffix_i ] -> output

Two engine runs with the same flags except `--no-prefix-caching` (or two
running engines: `--target` with the cache on, `--target-off` without); each gets
the same requests submitted at once, after a warm-up that shares nothing with
them. Reported per run: prefill tokens actually computed (sum of
prompt_tokens - cached_prompt_tokens, from each stream's usage), the server's
own prefix-cache hit counters, TTFT percentiles, and the wall time.
"""

from __future__ import annotations

import statistics

from bench import report
from bench.driver import model_info, percentile, run_requests, server_status, warm_up
from bench.run_servers import EngineFlags, running_engine
from bench.workloads import check_fits, describe, parse_range, shared_prefix_workload

SUITE = "prefix"


def add_args(p) -> None:
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--prefix-len", type=int, default=1024, help="tokens in the shared system prompt")
    p.add_argument("--suffix-len", default="16:48", help="LO:HI tokens of each request's own suffix")
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--target-off",
        default=None,
        help="with --target (an engine with prefix caching on): a running engine with it off",
    )


def measure(flags: EngineFlags, args, running: str | None = None) -> dict:
    """One engine run (`running`: the address of an engine already up, else one is started)."""
    mode = "on" if flags.prefix_caching else "off"
    with running_engine(flags, running) as target:
        info = model_info(target)
        requests = shared_prefix_workload(
            args.num_requests,
            args.prefix_len,
            parse_range(args.suffix_len),
            args.output_len,
            int(info["vocab_size"]),
            args.seed,
        )
        check_fits(requests, int(info["max_model_len_tokens"]), int(info["vocab_size"]))
        warm_up(target, int(info["vocab_size"]))
        before = server_status(target)
        progress = report.Progress(f"[{SUITE} cache {mode}]", len(requests))
        run = run_requests(target, requests, on_done=progress.step)
        after = server_status(target)
    ttfts = [r.ttft for r in run.records]
    return dict(
        prefix_caching=flags.prefix_caching,
        engine_flags=flags.as_dict(),
        workload=describe(requests),
        prompt_tokens=run.prompt_tokens,
        cached_prompt_tokens=sum(r.cached_prompt_tokens for r in run.records),
        computed_prefill_tokens=sum(r.prompt_tokens - r.cached_prompt_tokens for r in run.records),
        server_prefix_queries_tokens=after.prefix_cache_queries_tokens - before.prefix_cache_queries_tokens,
        server_prefix_hits_tokens=after.prefix_cache_hits_tokens - before.prefix_cache_hits_tokens,
        ttft={f"p{p}": percentile(ttfts, p) for p in (50, 90, 99)} | {"mean": statistics.mean(ttfts)},
        duration_s=run.duration_s,
    )


def chart(result: dict, path) -> None:
    on, off = result["on"], result["off"]
    report.bar_panels(
        path,
        f"Prefix caching: {result['num_requests']} requests sharing a {result['prefix_len']}-token system prompt",
        {
            "prefill tokens computed": {
                "cache on": on["computed_prefill_tokens"],
                "cache off": off["computed_prefill_tokens"],
            },
            "TTFT p50 (s)": {"cache on": on["ttft"]["p50"], "cache off": off["ttft"]["p50"]},
            "wall time, all requests (s)": {"cache on": on["duration_s"], "cache off": off["duration_s"]},
        },
    )


def main(args, argv: list[str]) -> dict:
    if bool(args.target) != bool(args.target_off):
        raise ValueError(
            "the prefix suite needs two engines: give both --target (cache on) and --target-off, or neither"
        )
    result = report.new_result(SUITE, argv)
    result.update(num_requests=args.num_requests, prefix_len=args.prefix_len)
    for caching in (True, False):
        flags = EngineFlags(
            dtype=args.dtype, num_threads=args.num_threads, kv_cache_gib=args.kv_cache_gib, prefix_caching=caching
        )
        result["on" if caching else "off"] = measure(flags, args, args.target if caching else args.target_off)
    on, off = result["on"], result["off"]
    result["computed_prefill_ratio_off_over_on"] = off["computed_prefill_tokens"] / max(
        1, on["computed_prefill_tokens"]
    )
    result["ttft_p50_ratio_off_over_on"] = off["ttft"]["p50"] / on["ttft"]["p50"]
    result["duration_ratio_off_over_on"] = off["duration_s"] / on["duration_s"]
    rows = [
        [
            f"cache {m}",
            d["prompt_tokens"],
            d["cached_prompt_tokens"],
            d["computed_prefill_tokens"],
            d["server_prefix_hits_tokens"],
            d["ttft"]["p50"],
            d["ttft"]["p90"],
            d["duration_s"],
        ]
        for m, d in (("on", on), ("off", off))
    ]
    print(
        report.format_table(
            [
                "run",
                "prompt tok",
                "cached tok",
                "computed prefill",
                "server hits",
                "TTFT p50 (s)",
                "TTFT p90 (s)",
                "wall (s)",
            ],
            rows,
        )
    )
    print(
        f"cache off / on: computed prefill {result['computed_prefill_ratio_off_over_on']:.1f}x, "
        f"TTFT p50 {result['ttft_p50_ratio_off_over_on']:.2f}x, wall {result['duration_ratio_off_over_on']:.2f}x"
    )
    report.save(result, SUITE, args.out_dir, None if args.no_chart else chart)
    return result
