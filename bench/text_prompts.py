"""A JSONL workload of real English prompts, for `--jsonl` (no network needed).

    .venv/bin/python -m bench.text_prompts --out /tmp/text64.jsonl [--num-requests 64]
        [--prompt-words 50:400] [--output-len 32:256] [--seed 0]

The throughput suite's own prompts are random token ids: a model's
next-token distribution after them is nearly flat (a top-p 0.95 nucleus of
~8,000 tokens), unlike after text (a median of 18; bench/sampler_cpu.py).
These prompts are consecutive, non-overlapping runs of words from the
docstrings of the Python standard library this interpreter ships (modules,
their public classes and functions), so no two share a prefix the cache
could reuse; each asks for a uniform number of output tokens, as the
uniform workload does.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import pkgutil
import random
import sys

from bench.workloads import parse_range

# Modules that open windows or print on import.
SKIP = {"antigravity", "this", "idlelib", "turtledemo", "tkinter", "turtle"}


def stdlib_words() -> list[str]:
    """The words of the standard library's docstrings of more than 30 words, in module order."""
    names = sorted(
        m.name
        for m in pkgutil.iter_modules()
        if not m.name.startswith("_")
        and m.name not in SKIP
        and getattr(m.module_finder, "path", "").startswith(sys.base_prefix)
        and "-packages" not in getattr(m.module_finder, "path", "")
    )
    docs = []
    for name in names:
        try:
            module = importlib.import_module(name)
        except Exception:  # a platform's missing optional module: skip it
            continue
        public = [
            v
            for k, v in vars(module).items()
            if not k.startswith("_") and (inspect.isclass(v) or inspect.isfunction(v)) and v.__module__ == name
        ]
        for obj in [module, *public]:
            doc = inspect.getdoc(obj)
            if doc and len(doc.split()) > 30:
                docs.append(" ".join(doc.split()))
    return " ".join(docs).split()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--prompt-words", default="50:400", help="LO:HI words a prompt (about 1.3 tokens each)")
    p.add_argument("--output-len", default="32:256", help="LO:HI tokens")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    words, rng = stdlib_words(), random.Random(a.seed)
    (w_lo, w_hi), (o_lo, o_hi) = parse_range(a.prompt_words), parse_range(a.output_len)
    lines, pos = [], 0
    for _ in range(a.num_requests):
        n = rng.randint(w_lo, w_hi)
        if pos + n > len(words):
            raise SystemExit(f"the docstrings hold {len(words)} words: too few for {a.num_requests} prompts")
        lines.append(json.dumps({"prompt": " ".join(words[pos : pos + n]), "max_tokens": rng.randint(o_lo, o_hi)}))
        pos += n
    with open(a.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {a.num_requests} prompts ({pos} of {len(words)} docstring words) to {a.out}")


if __name__ == "__main__":
    main()
