"""What every suite leaves behind: a table on stdout, a JSON file, a PNG chart.

Result files go to bench/results/ (git-ignored) as `<suite>-<timestamp>.json`
and `.png`, and record the machine they were measured on: CPU model, cores,
load average before and after (this project's machines are shared, so a busy
machine must show in the record), torch version, and the git commit.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO / "bench" / "results"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def cpu_description() -> str:
    """The CPU model and its bf16 arithmetic flags, to print beside every figure."""
    from executor_svc.native_build import cpu_flags

    bf16 = sorted(cpu_flags() & {"avx512_bf16", "amx_bf16"})
    return f"{_cpu_model()}, bf16 flags: {' '.join(bf16) or 'none'}"


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def machine_info() -> dict:
    """Where and on what a result was measured."""
    import torch

    return dict(
        cpu_model=_cpu_model(),
        cpu_count=os.cpu_count(),
        cpus_usable=len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        load_avg_1_5_15=list(os.getloadavg()),
        python=platform.python_version(),
        torch=torch.__version__,
        torch_threads=torch.get_num_threads(),
        platform=platform.platform(),
        git_commit=_git("rev-parse", "HEAD"),
        git_dirty=bool(_git("status", "--porcelain", "--untracked-files=no")),
    )


def new_result(suite: str, argv: list[str]) -> dict:
    """The common head of a result file; the suite adds its numbers."""
    return dict(
        suite=suite,
        command="python -m bench " + " ".join(argv),
        started_at=_dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        machine=machine_info(),
    )


def result_path(suite: str, out_dir: Path | None = None, ext: str = "json") -> Path:
    out_dir = out_dir or RESULTS_DIR
    out_dir.mkdir(parents=True, exist_ok=True)
    return out_dir / f"{suite}-{time.strftime('%Y%m%d-%H%M%S')}.{ext}"


def write_json(result: dict, path: Path) -> Path:
    result["finished_at"] = _dt.datetime.now().astimezone().isoformat(timespec="seconds")
    result["load_avg_at_end"] = list(os.getloadavg())
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}", file=sys.stderr)
    return path


def save(result: dict, suite: str, out_dir: Path | None, chart=None) -> Path:
    """Writes the result JSON and, when `chart(result, png_path)` is given, its PNG beside it."""
    json_path = result_path(suite, out_dir)
    if chart is not None:
        chart(result, json_path.with_suffix(".png"))
        result["chart"] = str(json_path.with_suffix(".png"))
    return write_json(result, json_path)


def format_table(headers: list[str], rows: list[list]) -> str:
    """A plain aligned text table; floats get 3 significant decimals."""

    def cell(v):
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 10 else f"{v:.1f}"
        return str(v)

    cells = [[cell(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    line = "  ".join(h.ljust(w) for h, w in zip(headers, widths))
    out = [line, "-" * len(line)]
    out += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells]
    return "\n".join(out)


class Progress:
    """One self-overwriting stderr line: `[suite] label 12/64`."""

    def __init__(self, label: str, total: int):
        self.label, self.total, self.done, self.t0 = label, total, 0, time.perf_counter()
        self._show()

    def step(self, _finished=None, n: int = 1) -> None:
        """Counts n more done; usable directly as a driver `on_done` callback."""
        self.done += n
        self._show()
        if self.done >= self.total:
            print(file=sys.stderr)

    def _show(self) -> None:
        elapsed = time.perf_counter() - self.t0
        print(f"\r{self.label} {self.done}/{self.total}  {elapsed:6.1f}s", end="", file=sys.stderr, flush=True)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only; never a window
    import matplotlib.pyplot as plt

    return plt


def bar_chart(
    path: Path,
    title: str,
    labels: list[str],
    values: list[float],
    ylabel: str,
    colors: list[str] | None = None,
    subtitle: str = "",
) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(5.0, 1.1 * len(labels) + 2), 4))
    bars = ax.bar(labels, values, color=colors or "tab:blue")
    ax.bar_label(bars, fmt="%.3g", fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title + (f"\n{subtitle}" if subtitle else ""), fontsize=10)
    ax.tick_params(axis="x", labelrotation=20, labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}", file=sys.stderr)
    return path


def bar_panels(path: Path, title: str, panels: dict[str, dict[str, float]], subtitle: str = "") -> Path:
    """Side-by-side bar panels, each with its own scale (its title names the unit)."""
    plt = _pyplot()
    palette = ["tab:green", "tab:gray", "tab:orange", "tab:purple", "tab:blue"]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels), 4), squeeze=False)
    for ax, (name, bars) in zip(axes.flat, panels.items()):
        drawn = ax.bar(list(bars), list(bars.values()), color=palette[: len(bars)])
        ax.bar_label(drawn, fmt="%.3g", fontsize=8)
        ax.set_title(name, fontsize=10)
        ax.tick_params(axis="x", labelsize=8, labelrotation=10)
    fig.suptitle(title + (f"\n{subtitle}" if subtitle else ""), fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}", file=sys.stderr)
    return path


def percentile_grid(
    path: Path,
    title: str,
    x: list[float],
    panels: dict[str, dict[str, list[float]]],
    xlabel: str,
    ylims: dict[str, tuple[float, float]] | None = None,
) -> Path:
    """One panel per metric (its title names the unit), one line per percentile, against x (e.g. request rate).

    ylims fixes the y range of the panels it names (e.g. 0..1 for a fraction).
    """
    plt = _pyplot()
    cols = 2
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(10, 3.4 * rows), squeeze=False)
    for ax, (metric, lines) in zip(axes.flat, panels.items()):
        for name, ys in lines.items():
            ax.plot(x, ys, marker="o", label=name)
        ax.set_title(metric, fontsize=10)
        if ylims and metric in ylims:
            ax.set_ylim(*ylims[metric])
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(panels) :]:
        ax.set_visible(False)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}", file=sys.stderr)
    return path
