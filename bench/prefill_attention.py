"""One layer's prefill attention: the CPU backend's native kernel against the torch backend (gather + SDPA).

    .venv/bin/python bench/prefill_attention.py [--threads 2] [--rounds 9]

SmolLM2-135M shapes (9 heads over 3 KV heads, head_dim 64, block size 16),
float32. Each case is one step's prefills: fresh prompts, a chunked prefill
with cached tokens, and prefills beside 64 decodes (where the torch backend
also gathers the decodes' K/V). The two backends run interleaved round by
round; medians; the outputs are compared too. GFLOP/s counts the useful
causal work of the prefills, 4 x head_dim FLOPs per (query, key) pair per
head, over the whole call (in the last case that includes the decodes).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch

from executor_svc.attention import get_backend
from executor_svc.attention.reference import make_batch

CASES = {
    "7 x 292": [(0, 292)] * 7,
    "4 x 512": [(0, 512)] * 4,
    "1 x 1024": [(0, 1024)],
    "1 x 2048": [(0, 2048)],
    "4 x (200 cached + 300)": [(200, 300)] * 4,
    "64 decodes + 2 x 512": [(400, 1)] * 64 + [(0, 512)] * 2,
}
HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=9)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    backends = {"cpu": get_backend("cpu"), "torch": get_backend("torch")}
    for name, shapes in CASES.items():
        batch = make_batch(
            shapes,
            block_size=16,
            num_kv_heads=KV_HEADS,
            group=HEADS // KV_HEADS,
            head_dim=HEAD_DIM,
            dtype=torch.float32,
            seed=1,
        )
        backends["torch"].write_kv(batch.new_key, batch.new_value, batch.k_cache, batch.v_cache, batch.meta)
        metas = {n: dataclasses.replace(batch.meta, extra={}) for n in backends}
        for n, b in backends.items():
            b.prepare(metas[n])
        outs = {
            n: b.forward(batch.query, batch.k_cache, batch.v_cache, metas[n], batch.scale) for n, b in backends.items()
        }
        diff = (outs["cpu"] - outs["torch"]).abs().max().item()
        times = {n: [] for n in backends}
        for r in range(a.rounds):
            for n, b in backends.items() if r % 2 else reversed(list(backends.items())):
                t = time.perf_counter()
                b.forward(batch.query, batch.k_cache, batch.v_cache, metas[n], batch.scale)
                times[n].append(time.perf_counter() - t)
        ms = {n: 1e3 * statistics.median(v) for n, v in times.items()}
        pairs = sum(sum(cached + j + 1 for j in range(new)) for cached, new in shapes if new > 1)
        gflop = 4 * HEAD_DIM * HEADS * pairs / 1e9
        print(
            f"{name:24} cpu {ms['cpu']:7.2f} ms ({gflop / ms['cpu'] * 1e3:5.1f} GFLOP/s)  "
            f"torch {ms['torch']:7.2f} ms  torch/cpu {ms['torch'] / ms['cpu']:.2f}x  max|diff| {diff:.1e}",
            flush=True,
        )


if __name__ == "__main__":
    main()
