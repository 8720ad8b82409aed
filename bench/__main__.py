"""`python -m bench <suite> [flags]`: one entry point for every suite.

    python -m bench throughput --baseline hf      # offline throughput vs HF static batches
    python -m bench serve --rates 0.25,0.5,1      # online latency under Poisson arrivals
    python -m bench memory                        # KV waste and concurrency, paged vs reserved
    python -m bench prefix                        # shared system prompt, prefix cache on vs off
    python -m bench all                           # all four with defaults, then the micro-benchmarks

Each suite prints a table, shows progress on stderr, and writes
bench/results/<suite>-<timestamp>.json and .png.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from bench import memory, prefix, report, serve, throughput

SUITES = {"throughput": throughput, "serve": serve, "memory": memory, "prefix": prefix}
# Micro-benchmarks owned elsewhere; `all` runs them as they are, with their defaults.
MICRO = (["-m", "bench.scheduler_cost"], ["bench/attention_cpu.py"], ["bench/sampler_cpu.py"])
# Micro-benchmarks that write result files as the suites do: `all` also passes them its threads and output
# flags (not --dtype: each sweeps its own dtypes).
REPORTING_MICRO = (["-m", "bench.forward_sweep"],)


def _common(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--dtype", default="float32", help="float32 or bfloat16 (throughput: a comma list runs each)")
    g.add_argument(
        "--num-threads",
        type=int,
        default=0,
        help="torch threads for the executor and the HF baseline alike (0 = torch's default)",
    )
    g.add_argument("--kv-cache-gib", type=float, default=None, help="the executor's KV budget (suite default if unset)")
    g.add_argument("--target", default=None, help="measure a running scheduler at HOST:PORT instead of starting one")
    g.add_argument("--out-dir", type=Path, default=None, help=f"results folder (default {report.RESULTS_DIR})")
    g.add_argument("--no-chart", action="store_true", help="skip the PNG")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench", description="PagedServe benchmark suites.")
    sub = p.add_subparsers(dest="suite", required=True)
    for name, module in SUITES.items():
        sp = sub.add_parser(
            name,
            help=module.__doc__.splitlines()[0],
            description=module.__doc__,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        module.add_args(sp)
        _common(sp)
    a = sub.add_parser(
        "all", help="every suite with its defaults (throughput with --baseline hf), then the micro-benchmarks"
    )
    a.add_argument(
        "--no-micro", action="store_true", help="skip bench/scheduler_cost, attention_cpu, sampler_cpu, forward_sweep"
    )
    a.add_argument("--vllm-python", default=None, help="also run vLLM in the throughput suite")
    _common(a)
    return p


def run_all(args, argv: list[str]) -> None:
    p = parser()
    shared = ["--num-threads", str(args.num_threads)]
    if args.out_dir:
        shared += ["--out-dir", str(args.out_dir)]
    if args.no_chart:
        shared.append("--no-chart")
    common = ["--dtype", args.dtype, *shared]
    runs = [
        ["throughput", "--baseline", "hf", *(["--vllm-python", args.vllm_python] if args.vllm_python else [])],
        ["serve"],
        ["memory"],
        ["prefix"],
    ]
    for suite_argv in runs:
        full = suite_argv + common
        print(f"\n=== python -m bench {' '.join(full)}", flush=True)
        SUITES[full[0]].main(p.parse_args(full), full)
    if not args.no_micro:
        for cmd in (*MICRO, *([*c, *shared] for c in REPORTING_MICRO)):
            print(f"\n=== python {' '.join(cmd)}", flush=True)
            subprocess.run([sys.executable, *cmd], cwd=report.REPO, check=True)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args = parser().parse_args(argv)
    try:
        if args.suite == "all":
            run_all(args, argv)
        else:
            SUITES[args.suite].main(args, argv)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
