"""One layer's decode attention: the native CPU kernel (AVX-512 and portable builds) against plain torch.

    .venv/bin/python bench/decode_attention.py [--threads 2] [--rounds 15] [--block-size 16] [--layers 1]

64 decodes at contexts 300-500 (SmolLM2's 9 heads / 3 KV heads, head_dim 64),
float32 and bfloat16 KV; medians, every variant in one run, interleaved
round by round so that load from other processes falls on all of them alike.
"portable" is the plain-C build of the same kernel (-DPAGED_DECODE_GENERIC):
the kernel CPUs without AVX-512 run, and the algorithm the AVX-512 path
replaced. GB/s is the K/V bytes read per call over its median time.
`--layers 30` times a whole step's worth of layers, each over its own copy of
the cache (1.2 GB in float32), so that every layer starts from DRAM as in a
real step instead of from what the previous round left in L3.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import time

import torch

from executor_svc.attention import get_backend, native_kernel
from executor_svc.attention.cpu_backend import CpuAttentionBackend
from executor_svc.attention.reference import make_batch


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--layers", type=int, default=1, help="layers per timed call, each over its own cache copy")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    backends = {
        "cpu": get_backend("cpu"),
        "portable": CpuAttentionBackend(native_kernel.load(portable=True)),
        "torch": get_backend("torch"),
    }
    rng = random.Random(0)
    for dtype in (torch.float32, torch.bfloat16):
        shapes = [(rng.randint(300, 500), 1) for _ in range(64)]
        batch = make_batch(shapes, block_size=a.block_size, num_kv_heads=3, group=3, head_dim=64, dtype=dtype, seed=1)
        # The batch's new tokens are not in the cache yet (their slots hold NaN poison): write them,
        # so every variant computes real attention instead of propagating NaN.
        backends["torch"].write_kv(batch.new_key, batch.new_value, batch.k_cache, batch.v_cache, batch.meta)
        kv_bytes = 2 * sum(seq for seq, _ in shapes) * 3 * 64 * batch.k_cache.element_size() * a.layers
        caches = [(batch.k_cache, batch.v_cache)] + [
            (batch.k_cache.clone(), batch.v_cache.clone()) for _ in range(a.layers - 1)
        ]
        times = {name: [] for name in backends}
        # One metadata per backend: prepare() stashes its plan under the backend's name, and the cpu
        # backend's prefill half is a torch backend, so shared metadata would mix their plans.
        metas = {name: dataclasses.replace(batch.meta, extra={}) for name in backends}
        for name, backend in backends.items():
            backend.prepare(metas[name])
        for _ in range(a.rounds):
            for name, backend in backends.items():
                t = time.perf_counter()
                for k_cache, v_cache in caches:
                    backend.forward(batch.query, k_cache, v_cache, metas[name], batch.scale)
                times[name].append(time.perf_counter() - t)
        ms = {name: 1000 * statistics.median(t) for name, t in times.items()}
        cells = "  ".join(f"{name} {v:.2f} ms ({kv_bytes / v / 1e6:.1f} GB/s)" for name, v in ms.items())
        print(
            f"{str(dtype):15} threads={a.threads} block={a.block_size} layers={a.layers}  {cells}  "
            f"portable/cpu {ms['portable'] / ms['cpu']:.2f}x  torch/cpu {ms['torch'] / ms['cpu']:.2f}x"
        )


if __name__ == "__main__":
    main()
