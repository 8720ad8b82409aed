#!/usr/bin/env python3
"""Reports the tracked Python files longer than the house rule's 300 lines and
those over 500: a report for reviewers, not a gate (exit 0).

    python tools/file_sizes.py      (from the repository root)
"""

from __future__ import annotations

import subprocess
import sys

SOFT, HARD = 300, 500


def python_files() -> list[str]:
    out = subprocess.run(["git", "ls-files", "*.py"], capture_output=True, text=True, check=True).stdout
    return out.split()


def line_counts(paths: list[str]) -> dict[str, int]:
    counts = {}
    for path in paths:
        with open(path, encoding="utf-8") as f:
            counts[path] = sum(1 for _ in f)
    return counts


def main() -> int:
    counts = line_counts(python_files())
    over = sorted(((n, p) for p, n in counts.items() if n > SOFT), reverse=True)
    print(
        f"{len(counts)} Python files; {len(over)} over {SOFT} lines, "
        f"{sum(n > HARD for n, _ in over)} of them over {HARD}:"
    )
    for n, path in over:
        print(f"  {n:5d}  {path}{'  (over ' + str(HARD) + ')' if n > HARD else ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
