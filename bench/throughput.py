"""Offline throughput: N requests submitted at once, timed until the last one finishes.

    python -m bench throughput [--baseline hf] [--dtype float32[,bfloat16]] [--repeats 3] [--deterministic both]
        [--kv-cache-dtype int8]

Reports requests/s, output tokens/s and total (prompt + output) tokens/s. With
`--baseline hf` the same requests also run through Hugging Face `generate` in
static batches (bench/hf_baseline.py), with `--vllm-python` through vLLM's
CPU build (bench/vllm_baseline.py), at the same dtype, and with
`--llama-server` through llama.cpp over the embedded GGUF file at its own
precision (bench/llamacpp_baseline.py), in the same process run, on the same
machine. Systems never run at the same time: each round
starts a fresh engine (the same prompts again would otherwise hit the prefix
cache the previous round filled), runs it, stops it, then runs the baselines,
so that load from other users of a shared machine falls on all of them alike. The headline is the
median over rounds of each round's PagedServe / best-HF ratio; with vLLM, a
fresh vLLM process runs the requests once per round too, and its ratio is
likewise the median of per-round ratios. `--deterministic both` runs the
executor without and with --deterministic, alternating within each round,
and reports the median of the per-round on/off ratios (docs/determinism.md).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

from bench import hf_baseline, llamacpp_baseline, report, vllm_baseline
from bench.driver import engine_workload, run_requests, warm_up
from bench.run_servers import EngineFlags, running_engine
from bench.workloads import add_workload_args, describe

SUITE = "throughput"
# Peer engines a round may also run: the result key, and the name in tables.
PEERS = {"vllm": "vLLM CPU", "llamacpp": "llama.cpp (GGUF)"}


def add_args(p) -> None:
    add_workload_args(p)
    p.add_argument("--repeats", type=int, default=1, help="rounds; each round runs every system once")
    p.add_argument("--baseline", choices=("none", "hf"), default="none")
    p.add_argument("--hf-batch-sizes", default=",".join(map(str, hf_baseline.DEFAULT_BATCH_SIZES)))
    p.add_argument("--vllm-python", default=None, help="python of a venv with vLLM's CPU build: run it too")
    p.add_argument(
        "--vllm-model", default=None, help="model path for vLLM (default: the embedded GGUF saved once as a HF folder)"
    )
    p.add_argument(
        "--llama-server", default=None, help="a llama.cpp llama-server binary: run the embedded GGUF file in it too"
    )
    p.add_argument(
        "--no-overlap-scheduling", action="store_true", help="start PagedServe's scheduler with --no-overlap-scheduling"
    )
    p.add_argument(
        "--kv-cache-dtype",
        choices=("auto", "int8"),
        default=None,
        help="the executor's --kv-cache-dtype (unset: its default, auto)",
    )
    p.add_argument(
        "--deterministic",
        choices=("off", "on", "both"),
        default="off",
        help="the executor's --deterministic; both: each dtype in both modes, alternating per round",
    )


def measure_pagedserve(target: str, requests, label: str) -> dict:
    progress = report.Progress(label, len(requests))
    run = run_requests(target, requests, on_done=progress.step)
    return dict(
        duration_s=run.duration_s,
        requests_per_s=len(requests) / run.duration_s,
        output_tokens_per_s=run.output_tokens / run.duration_s,
        total_tokens_per_s=(run.output_tokens + run.prompt_tokens) / run.duration_s,
        output_tokens=run.output_tokens,
        prompt_tokens=run.prompt_tokens,
        cached_prompt_tokens=sum(r.cached_prompt_tokens for r in run.records),
    )


def measure_hf(model, requests, batch_sizes: list[int], pad_token_id: int, label: str) -> list[dict]:
    out = []
    for bs in batch_sizes:
        progress = report.Progress(f"{label} hf bs={bs}", len(requests))
        out.append(
            hf_baseline.run_static_batches(
                model, requests, bs, pad_token_id, on_batch=lambda n, p=progress: p.step(n=n)
            )
        )
    return out


def _median(rounds: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rounds)


def run_dtype(args, flags: EngineFlags) -> dict:
    """Every system on one dtype: engine rounds interleaved with baseline rounds."""
    batch_sizes = [int(b) for b in args.hf_batch_sizes.split(",") if b]
    out: dict = dict(
        dtype=flags.dtype,
        engine_flags=flags.as_dict(),
        pagedserve_rounds=[],
        hf_rounds=[],
        vllm_rounds=[],
        llamacpp_rounds=[],
    )
    model, requests = None, None
    for r in range(args.repeats):
        label = f"[{SUITE} {flags.dtype} round {r + 1}/{args.repeats}]"
        # A fresh engine per round: the same prompts again would hit the prefix cache the previous
        # round left behind, which no baseline has. (A --target engine cannot be restarted: its
        # rounds after the first report their cache hits in cached_prompt_tokens.)
        with running_engine(flags, args.target) as target:
            if requests is None:
                info, requests = engine_workload(args, target)
                out["model_info"] = info
                out["workload"] = describe(requests)
            warm_up(target, int(info["vocab_size"]))
            out["pagedserve_rounds"].append(measure_pagedserve(target, requests, f"{label} pagedserve"))
        if args.baseline == "hf":
            if model is None:
                # The dtype the server reports, so a --target engine is matched too.
                print(f"[{SUITE}] loading the HF baseline ({info['dtype']})", file=sys.stderr)
                model = hf_baseline.load_model(info["dtype"])
                if flags.num_threads:
                    torch.set_num_threads(flags.num_threads)  # the executor gets the same --num-threads
            out["hf_rounds"].append(measure_hf(model, requests, batch_sizes, int(info["eos_token_ids"][0]), label))
        if args.vllm_python:
            # A fresh vLLM process per round too (its start-up is not timed).
            out["vllm_rounds"].append(
                vllm_baseline.run(args.vllm_python, requests, flags.dtype, args.vllm_model, flags.num_threads)
            )
        if args.llama_server:
            gguf = os.path.join(hf_baseline.embedded_model_dir(), hf_baseline.GGUF_FILE)
            out["llamacpp_rounds"].append(llamacpp_baseline.run(args.llama_server, requests, gguf, flags.num_threads))
    del model
    return _summarize(out)


def run_modes(args, variants: list[EngineFlags]) -> list[dict]:
    """The same dtype in several executor modes, one round of each in turn
    (the order alternating between rounds), so that load from other users
    of the machine falls on all of them alike. PagedServe alone: no baselines."""
    one = argparse.Namespace(
        **{**vars(args), "repeats": 1, "baseline": "none", "vllm_python": None, "llama_server": None}
    )
    outs: list[dict | None] = [None] * len(variants)
    for r in range(args.repeats):
        order = range(len(variants)) if r % 2 == 0 else reversed(range(len(variants)))
        for i in order:
            d = run_dtype(one, variants[i])
            if outs[i] is None:
                outs[i] = d
            else:
                outs[i]["pagedserve_rounds"] += d["pagedserve_rounds"]
    outs = [_summarize(o) for o in outs]
    base = outs[0]["pagedserve_rounds"]
    for o in outs:
        o["ratio_vs_first_mode_per_round"] = [
            p["output_tokens_per_s"] / b["output_tokens_per_s"] for p, b in zip(o["pagedserve_rounds"], base)
        ]
        o["ratio_vs_first_mode"] = statistics.median(o["ratio_vs_first_mode_per_round"])
    return outs


def _summarize(out: dict) -> dict:
    ps = out["pagedserve_rounds"]
    out["pagedserve"] = {k: _median(ps, k) for k in ("requests_per_s", "output_tokens_per_s", "total_tokens_per_s")}
    if out["hf_rounds"]:
        sizes = [b["batch_size"] for b in out["hf_rounds"][0]]
        out["hf"] = {
            bs: {
                k: statistics.median(rnd[i][k] for rnd in out["hf_rounds"])
                for k in ("requests_per_s", "output_tokens_per_s", "total_tokens_per_s")
            }
            for i, bs in enumerate(sizes)
        }
        best = max(out["hf"], key=lambda bs: out["hf"][bs]["output_tokens_per_s"])
        out["hf_best_batch_size"] = best
        # Each round's ratio uses that round's best batch size: both sides saw the same load.
        ratios = [
            p["output_tokens_per_s"] / max(b["output_tokens_per_s"] for b in h) for p, h in zip(ps, out["hf_rounds"])
        ]
        out["ratio_vs_best_hf_per_round"] = ratios
        out["ratio_vs_best_hf"] = statistics.median(ratios)
    for peer in PEERS:
        rounds = out.get(f"{peer}_rounds")
        if not rounds:
            continue
        failed = [v for v in rounds if "output_tokens_per_s" not in v]
        if failed:
            out[peer] = failed[0]
            continue
        out[peer] = {k: _median(rounds, k) for k in ("requests_per_s", "output_tokens_per_s", "total_tokens_per_s")}
        out[peer]["version"] = rounds[0].get("version")
        ratios = [p["output_tokens_per_s"] / v["output_tokens_per_s"] for p, v in zip(ps, rounds)]
        out[f"ratio_vs_{peer}_per_round"] = ratios
        out[f"ratio_vs_{peer}"] = statistics.median(ratios)
    return out


def table_rows(d: dict) -> list[list]:
    mode = " --deterministic" if d["engine_flags"]["deterministic"] else ""
    rows = [
        [
            d["dtype"],
            "PagedServe" + mode,
            d["pagedserve"]["requests_per_s"],
            d["pagedserve"]["output_tokens_per_s"],
            d["pagedserve"]["total_tokens_per_s"],
            f"{d['ratio_vs_first_mode']:.3f}x" if "ratio_vs_first_mode" in d else "",
        ]
    ]
    for bs, h in d.get("hf", {}).items():
        ratio = d["pagedserve"]["output_tokens_per_s"] / h["output_tokens_per_s"]
        rows.append(
            [
                d["dtype"],
                f"HF static bs={bs}",
                h["requests_per_s"],
                h["output_tokens_per_s"],
                h["total_tokens_per_s"],
                f"{ratio:.2f}x",
            ]
        )
    for peer, name in PEERS.items():
        v = d.get(peer)
        if not v:
            continue
        if "output_tokens_per_s" in v:
            ratio = f"{d[f'ratio_vs_{peer}']:.2f}x"
            rows.append(
                [d["dtype"], name, v["requests_per_s"], v["output_tokens_per_s"], v["total_tokens_per_s"], ratio]
            )
        else:
            rows.append([d["dtype"], name, "failed", "", "", v.get("error", "")[:60]])
    return rows


def chart(result: dict, path) -> None:
    labels, values, colors = [], [], []
    for d in result["dtypes"]:
        tag = f" ({d['dtype']})" if len(result["dtypes"]) > 1 else ""
        labels.append("PagedServe" + (" det" if d["engine_flags"]["deterministic"] else "") + tag)
        values.append(d["pagedserve"]["output_tokens_per_s"])
        colors.append("tab:green")
        for bs, h in d.get("hf", {}).items():
            labels.append(f"HF bs={bs}{tag}")
            values.append(h["output_tokens_per_s"])
            colors.append("tab:gray")
        for peer, name in PEERS.items():
            if "output_tokens_per_s" in d.get(peer, {}):
                labels.append(name + tag)
                values.append(d[peer]["output_tokens_per_s"])
                colors.append("tab:purple" if peer == "vllm" else "tab:orange")
    w = result["dtypes"][0]["workload"]
    report.bar_chart(
        path,
        "Offline throughput: useful output tokens/s (median over rounds)",
        labels,
        values,
        "output tokens/s",
        colors,
        subtitle=f"{w['num_requests']} requests, prompts {w['prompt_len_min']}-{w['prompt_len_max']}, "
        f"outputs {w['output_len_min']}-{w['output_len_max']}",
    )


def main(args, argv: list[str]) -> dict:
    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    if args.target and "," in args.dtype:
        raise ValueError("--target serves one dtype; give a single --dtype (it only labels the results)")
    if (args.temperature, args.top_p, args.top_k) != (0.0, 1.0, 0) and (args.baseline == "hf" or args.llama_server):
        raise ValueError("the Hugging Face and llama.cpp baselines run greedy only: drop --temperature/--top-p/--top-k")
    result = report.new_result(SUITE, argv)
    modes = {"off": [False], "on": [True], "both": [False, True]}[args.deterministic]

    def flags(dt: str, deterministic: bool) -> EngineFlags:
        return EngineFlags(
            dtype=dt,
            num_threads=args.num_threads,
            kv_cache_gib=args.kv_cache_gib,
            kv_cache_dtype=args.kv_cache_dtype,
            overlap_scheduling=not args.no_overlap_scheduling,
            deterministic=deterministic,
        )

    if len(modes) == 1:
        result["dtypes"] = [run_dtype(args, flags(dt, modes[0])) for dt in args.dtype.split(",")]
    else:
        result["dtypes"] = [d for dt in args.dtype.split(",") for d in run_modes(args, [flags(dt, m) for m in modes])]
    table = [r for d in result["dtypes"] for r in table_rows(d)]
    print(report.format_table(["dtype", "system", "req/s", "out tok/s", "total tok/s", "PagedServe is"], table))
    for d in result["dtypes"]:
        if "ratio_vs_best_hf" in d:
            print(
                f"{d['dtype']}: PagedServe / best HF (bs={d['hf_best_batch_size']}) = "
                f"{d['ratio_vs_best_hf']:.2f}x (median of per-round ratios "
                f"{', '.join(f'{x:.2f}' for x in d['ratio_vs_best_hf_per_round'])})"
            )
        if d["engine_flags"]["deterministic"] and "ratio_vs_first_mode_per_round" in d:
            print(
                f"{d['dtype']}: --deterministic / default = {d['ratio_vs_first_mode']:.3f}x (median of per-round "
                f"ratios {', '.join(f'{x:.3f}' for x in d['ratio_vs_first_mode_per_round'])})"
            )
        for peer, name in PEERS.items():
            if f"ratio_vs_{peer}_per_round" in d:
                print(
                    f"{d['dtype']}: PagedServe / {name} = {d[f'ratio_vs_{peer}']:.2f}x (median of per-round ratios "
                    f"{', '.join(f'{x:.2f}' for x in d[f'ratio_vs_{peer}_per_round'])})"
                )
    report.save(result, SUITE, args.out_dir, None if args.no_chart else chart)
    return result
