"""bench.forward_sweep's printout and chart: the table, the matmul ceiling beside the
read floor per dtype, and issue 18's targets read off the rows (bench/forward_sweep.py
says what each figure is)."""

from __future__ import annotations

import sys
from pathlib import Path

from bench import report

HEADERS = [
    "dtype",
    "sweep",
    "batch",
    "context",
    "tokens",
    "step ms",
    "fwd ms",
    "tok/s",
    "GFLOP/s",
    "ceil ms",
    "of ceiling",
    "wt MB",
    "KV MB",
    "wt floor ms",
    "wt+KV floor ms",
    "x floor",
    "attn GB/s",
    "of copy",
]
MB = 1e6


def issue_18_targets(rows: list[dict]) -> dict:
    """One dtype's figures for issue 18's targets, where the sweep has their rows:
    batch 64 >= 0.6 of the ceiling, batch 1 <= 2x the weights' read time, attention >= 0.6 of copy."""
    batch = {r["batch"]: r for r in rows if r["sweep"] == "batch"}
    out = {}
    if 64 in batch:
        out["batch_64_of_ceiling"] = batch[64]["fraction_of_ceiling"]
    if 1 in batch:
        out["batch_1_x_weight_floor"] = batch[1]["step_ms"] / batch[1]["weight_floor_ms"]
    attention = {r["context"]: r["attention_of_copy"] for r in rows if "attention_of_copy" in r}
    if attention:
        out["attention_of_copy_by_context"] = attention
    return out


def summary_lines(result: dict, dtype: str) -> list[str]:
    """The ceiling and the floor of one dtype's rows, and issue 18's targets against them."""
    c, b, t = result["ceiling"][dtype], result["bandwidth"][dtype], result["targets"][dtype]
    lines = [f"{dtype} model: matmul ceiling {c['best_gflops']:.1f} GFLOP/s ({c['best_dtype']} torch.mm)"]
    for mm_dtype, mc in c["by_dtype"].items():
        shapes = ", ".join(f"{s} {g:.0f}" for s, g in mc["gflops_by_shape"].items())
        emulated = mm_dtype == "bfloat16" and not c["cpu_has_fast_bf16"]
        note = "  [emulated by torch: this CPU has no AVX512-BF16/AMX]" if emulated else ""
        lines.append(f"  torch.mm {mm_dtype}: {mc['best_gflops']:.1f} GFLOP/s (M x K x N: {shapes}){note}")
    first = min((r for r in result["rows"] if r["dtype"] == dtype), key=lambda r: (r["tokens"], r["context"]))
    lines.append(
        f"  read floor at {b['floor_bytes_per_s'] / 1e9:.1f} GB/s (sum {b['read_bytes_per_s'] / 1e9:.1f}, copy "
        f"{b['copy_bytes_per_s'] / 1e9:.1f} read+written; {b['tensor_bytes'] >> 20} MiB, {b['threads']} threads): "
        f"batch {first['batch']} reads {first['weight_bytes'] / MB:.1f} MB of weights, {first['weight_floor_ms']:.2f} ms"
    )
    verdicts = []
    if "batch_64_of_ceiling" in t:
        x = t["batch_64_of_ceiling"]
        verdicts.append(f"batch 64 at {x:.2f} of the ceiling (>= 0.6: {_met(x >= 0.6)})")
    if "batch_1_x_weight_floor" in t:
        x = t["batch_1_x_weight_floor"]
        verdicts.append(f"batch 1 at {x:.2f}x the weight-read floor (<= 2: {_met(x <= 2)})")
    if "attention_of_copy_by_context" in t:
        by_context = t["attention_of_copy_by_context"]
        rates = ", ".join(f"{x:.2f} at context {ctx}" for ctx, x in by_context.items())
        # Judged at the longest context: the widest span, the least noise in a difference of two steps.
        longest = by_context[max(by_context)]
        met = _met(longest >= 0.6)
        if longest * b["copy_bytes_per_s"] > b["floor_bytes_per_s"]:
            met = "unsure: faster than any read measured here, i.e. noise; more --rounds"
        verdicts.append(f"attention at {rates} of the copy bandwidth (>= 0.6 at the longest: {met})")
    if verdicts:
        lines.append(f"  issue 18 targets: {'; '.join(verdicts)}")
        if dtype == "bfloat16" and not c["cpu_has_fast_bf16"]:
            lines.append("  (issue 18's bfloat16 targets are for a CPU with AVX512-BF16 or AMX; this one has neither)")
    return lines


def _met(ok: bool) -> str:
    return "met" if ok else "NOT met"


def table_row(r: dict) -> list:
    attention = ("-", "-")
    if "attention_of_copy" in r:
        attention = (r["attention_bytes_per_s"] / 1e9, r["attention_of_copy"])
    return [
        r["dtype"],
        r["sweep"],
        r["batch"],
        r["context"],
        r["tokens"],
        r["step_ms"],
        r["forward_ms"],
        r["tokens_per_s"],
        r["gflops"],
        r["ceiling_ms"],
        r["fraction_of_ceiling"],
        r["weight_bytes"] / MB,
        r["kv_bytes"] / MB,
        r["weight_floor_ms"],
        r["floor_ms"],
        r["times_floor"],
        *attention,
    ]


def chart(result: dict, path: Path) -> Path:
    plt = report._pyplot()
    panels = [
        ("batch", "decodes per step", f"context {result['settings']['context']}"),
        ("context", "context (tokens)", f"batch {result['settings']['batch']}"),
    ]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    colors = dict(zip(result["ceiling"], ["tab:blue", "tab:orange", "tab:green", "tab:purple"]))
    for ax, (sweep, xlabel, fixed) in zip(axes, panels):
        for dtype, color in colors.items():
            rows = [r for r in result["rows"] if r["sweep"] == sweep and r["dtype"] == dtype]
            if not rows:
                continue
            x = [r[sweep] for r in rows]
            ax.plot(x, [r["step_ms"] for r in rows], marker="o", color=color, label=f"{dtype} step")
            ax.plot(
                x,
                [r["ceiling_ms"] for r in rows],
                linestyle="--",
                marker="x",
                color=color,
                label=f"{dtype} matmul ceiling ({result['ceiling'][dtype]['best_gflops']:.0f} GFLOP/s)",
            )
            floor_gbps = result["bandwidth"][dtype]["floor_bytes_per_s"] / 1e9
            ax.plot(
                x,
                [r["floor_ms"] for r in rows],
                linestyle=":",
                marker="+",
                color=color,
                label=f"{dtype} weights+KV read floor ({floor_gbps:.0f} GB/s)",
            )
        ax.set_xscale("log", base=2)
        ticks = sorted({r[sweep] for r in result["rows"] if r["sweep"] == sweep})
        ax.set_xticks(ticks, [str(t) for t in ticks])  # plain numbers, not powers of 2
        ax.minorticks_off()
        ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("ms per step")
        ax.set_title(f"decode step vs {sweep} ({fixed})", fontsize=10)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
    m = result["machine"]
    fig.suptitle(f"{result['model']['name']} on CPU ({m['cpu_model']}, threads: {m['torch_threads']})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}", file=sys.stderr)
    return path


def print_summary(result: dict) -> None:
    for dtype in result["ceiling"]:
        print("\n".join(summary_lines(result, dtype)))
    print(report.format_table(HEADERS, [table_row(r) for r in result["rows"]]))
