"""Online serving: requests arrive as a Poisson process; latency percentiles per rate.

    python -m bench serve --rates 0.25,0.5,1 [--num-requests 32] [--ttft-slo 2 --tpot-slo 0.25] [--repeats 2]

For each rate the same seeded requests are sent at seeded exponential gaps
(mean 1/rate), against one engine kept up across rates; each pass changes the
first prompt token, so no pass hits the prefix cache an earlier one filled. With `--repeats N`
the whole sweep runs N times, rates interleaved round by round, and every
reported number is its median over rounds: on a shared machine the load
drifts over the minutes a sweep takes, and this spreads the drift over all
rates alike. Reported per rate, at
p50/p90/p99: TTFT (send to first token), TPOT (mean time per token after the
first, one value per request), ITL (every gap between two streamed messages)
and E2E (send to last token); plus goodput: the fraction of requests that met
both TTFT <= --ttft-slo and TPOT <= --tpot-slo, and those requests per second.
Latencies are measured at the client, through gRPC, as a user would see them.
"""

from __future__ import annotations

import math
import statistics

from bench import report
from bench.driver import RunResult, engine_workload, percentile, run_requests, warm_up
from bench.run_servers import EngineFlags, running_engine
from bench.workloads import (
    add_workload_args,
    describe,
    poisson_arrivals,
    with_distinct_first_token,
)

SUITE = "serve"
PERCENTILES = (50, 90, 99)
METRICS = ("ttft", "tpot", "itl", "e2e")


def add_args(p) -> None:
    add_workload_args(p, num_requests=32)
    p.add_argument("--rates", default="0.25,0.5,1", help="comma-separated request rates in req/s ('inf' = all at once)")
    p.add_argument("--ttft-slo", type=float, default=2.0, help="goodput: TTFT target in seconds")
    p.add_argument("--tpot-slo", type=float, default=0.25, help="goodput: TPOT target in seconds")
    p.add_argument(
        "--repeats", type=int, default=1, help="rounds of the whole sweep; each number is its median over rounds"
    )


def latency_summary(run: RunResult, ttft_slo: float, tpot_slo: float) -> dict:
    """Percentiles of each latency metric, and goodput under the (TTFT, TPOT) target."""
    recs = run.records
    values = {
        "ttft": [r.ttft for r in recs],
        "tpot": [r.tpot for r in recs if r.tpot is not None],
        "itl": [gap for r in recs for gap in r.itls],
        "e2e": [r.e2e for r in recs],
    }
    out = {
        m: {f"p{p}": percentile(v, p) for p in PERCENTILES} | {"mean": sum(v) / len(v) if v else math.nan}
        for m, v in values.items()
    }
    # A one-token request has no TPOT; it meets the TPOT target trivially.
    good = [r for r in recs if r.ttft <= ttft_slo and (r.tpot is None or r.tpot <= tpot_slo)]
    out["goodput"] = dict(
        ttft_slo_s=ttft_slo,
        tpot_slo_s=tpot_slo,
        fraction=len(good) / len(recs),
        requests_per_s=len(good) / run.duration_s,
    )
    out["achieved"] = dict(
        duration_s=run.duration_s,
        requests_per_s=len(recs) / run.duration_s,
        output_tokens_per_s=run.output_tokens / run.duration_s,
    )
    return out


def median_over_rounds(summaries: list[dict]) -> dict:
    """Each number of a rate's summary, as its median over rounds (the rate and targets stay as they are)."""
    first = summaries[0]
    if len(summaries) == 1:
        return first
    out = {}
    for key, value in first.items():
        if isinstance(value, dict):
            out[key] = median_over_rounds([s[key] for s in summaries])
        elif key in ("rate", "ttft_slo_s", "tpot_slo_s"):
            out[key] = value
        else:
            out[key] = statistics.median(s[key] for s in summaries)
    return out


def parse_rates(text: str) -> list[float]:
    rates = [float(x) for x in text.split(",") if x]
    if not rates or any(not r > 0 for r in rates):
        raise ValueError(f"--rates {text!r}: expected positive numbers (or inf)")
    return rates


def chart(result: dict, path) -> None:
    # "inf" (everything at once) has no place on a rate axis; the table shows it.
    per_rate = [r for r in result["rates"] if math.isfinite(r["rate"])]
    xs = [r["rate"] for r in per_rate]
    names = {"ttft": "TTFT (s)", "tpot": "TPOT (s)", "itl": "ITL (s)", "e2e": "E2E latency (s)"}
    panels = {names[m]: {f"p{p}": [r[m][f"p{p}"] for r in per_rate] for p in PERCENTILES} for m in METRICS}
    g = per_rate[0]["goodput"]
    goodput = f"goodput: share with TTFT<={g['ttft_slo_s']}s, TPOT<={g['tpot_slo_s']}s"
    panels[goodput] = {"fraction": [r["goodput"]["fraction"] for r in per_rate]}
    report.percentile_grid(
        path,
        f"Online serving, {result['workload']['num_requests']} requests per rate (Poisson arrivals)",
        xs,
        panels,
        "request rate (req/s)",
        ylims={goodput: (0, 1.05)},
    )


def main(args, argv: list[str]) -> dict:
    rates = parse_rates(args.rates)
    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    result = report.new_result(SUITE, argv)
    flags = EngineFlags(dtype=args.dtype, num_threads=args.num_threads, kv_cache_gib=args.kv_cache_gib)
    result["engine_flags"] = flags.as_dict()
    with running_engine(flags, args.target) as target:
        info, requests = engine_workload(args, target)
        result["model_info"] = info
        result["workload"] = describe(requests)
        warm_up(target, int(info["vocab_size"]))
        rounds = []
        for r in range(args.repeats):
            per_rate = []
            for i, rate in enumerate(rates):
                progress = report.Progress(f"[{SUITE} round {r + 1}/{args.repeats} rate {rate:g}/s]", len(requests))
                fresh = with_distinct_first_token(requests, 1 + r * len(rates) + i, int(info["vocab_size"]))
                run = run_requests(target, fresh, poisson_arrivals(len(requests), rate, args.seed), progress.step)
                per_rate.append(dict(rate=rate) | latency_summary(run, args.ttft_slo, args.tpot_slo))
            rounds.append(per_rate)
    result["rounds"] = rounds
    result["rates"] = [median_over_rounds([rnd[i] for rnd in rounds]) for i in range(len(rates))]
    headers = [
        "rate",
        "TTFT p50",
        "p90",
        "p99",
        "TPOT p50",
        "p90",
        "p99",
        "ITL p50",
        "p99",
        "E2E p50",
        "p99",
        "goodput",
        "out tok/s",
    ]
    rows = [
        [
            r["rate"],
            r["ttft"]["p50"],
            r["ttft"]["p90"],
            r["ttft"]["p99"],
            r["tpot"]["p50"],
            r["tpot"]["p90"],
            r["tpot"]["p99"],
            r["itl"]["p50"],
            r["itl"]["p99"],
            r["e2e"]["p50"],
            r["e2e"]["p99"],
            f"{r['goodput']['fraction']:.0%}",
            r["achieved"]["output_tokens_per_s"],
        ]
        for r in result["rates"]
    ]
    print(report.format_table(headers, rows))
    print(f"(seconds; goodput = share of requests with TTFT <= {args.ttft_slo}s and TPOT <= {args.tpot_slo}s)")
    drawable = not args.no_chart and any(math.isfinite(r) for r in rates)  # all-at-once has no rate axis
    report.save(result, SUITE, args.out_dir, chart if drawable else None)
    return result
