"""One layer's decode attention: the native CPU kernel against plain torch.

    .venv/bin/python bench/decode_attention.py [--threads 2] [--rounds 15]

64 decodes at contexts 300-500 (SmolLM2's 9 heads / 3 KV heads, head_dim 64,
block size 16), float32 and bfloat16; medians, both backends in one run.
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from executor_svc.attention import get_backend
from executor_svc.attention.reference import make_batch


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=15)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    rng = random.Random(0)
    for dtype in (torch.float32, torch.bfloat16):
        shapes = [(rng.randint(300, 500), 1) for _ in range(64)]
        batch = make_batch(shapes, block_size=16, num_kv_heads=3, group=3, head_dim=64, dtype=dtype, seed=1)
        ms = {}
        for name in ("cpu", "torch"):
            backend = get_backend(name)
            backend.prepare(batch.meta)
            times = []
            for _ in range(a.rounds):
                t = time.perf_counter()
                backend.forward(batch.query, batch.k_cache, batch.v_cache, batch.meta, batch.scale)
                times.append(time.perf_counter() - t)
            ms[name] = 1000 * statistics.median(times)
        print(f"{str(dtype):15} threads={a.threads}  cpu {ms['cpu']:.2f} ms  torch {ms['torch']:.2f} ms  "
              f"torch/cpu {ms['torch'] / ms['cpu']:.2f}x")


if __name__ == "__main__":
    main()
