"""Decode attention's K/V read rate against the machine's copy bandwidth, float32 and bfloat16 KV.

    .venv/bin/python -m bench.kv_read_bandwidth [--threads 2] [--rounds 7] [--contexts 256,512,1024,2048]
        [--batch 64] [--dtypes float32,bfloat16] [--baseline-commit REV] [--dot]

Per context: one layer's decode attention over `--batch` decodes (SmolLM2's
9 heads / 3 KV heads, head_dim 64, block size 16, blocks scattered), through
the CPU backend, with queries and outputs in the cache's dtype (a bfloat16
model's, or float32). GB/s is
the K and V bytes the call must read over its median time; "of copy" divides
it by the copy bandwidth measured in the same run: a 512 MiB float32 tensor
copied by torch on `--threads` threads, counted as bytes read + bytes
written (STREAM's convention for Copy), median of the rounds.

Each timed call walks several copies of the cache (at least 256 MiB in all),
so that its reads come from DRAM as in a model step, not from L3.

`--baseline-commit REV` also builds the decode kernel and CPU backend as
they were at REV (its executor_svc tree from `git archive`) and times them
interleaved with the current ones, round by round, so before/after ratios share the machine's load.

`--dot` also times, on the bfloat16 rows, the decode route "dot" (K/V
multiplied as raw bf16 pairs by VDPBF16PS, --decode-attention dot; its
AVX-512F emulation on CPUs without AVX512-BF16, which only checks that it
runs), interleaved with the widening kernel ("now"), and prints now/dot,
the dot route's speed-up.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import io
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import torch

from bench.membw import copy_bandwidth
from executor_svc.attention import native_kernel
from executor_svc.attention.cpu_backend import CpuAttentionBackend
from executor_svc.attention.reference import make_batch
from executor_svc.native_build import load_library
from executor_svc.native_signatures import bind

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
MIN_BYTES = 256 << 20


def baseline_backend(rev: str, folder: str):
    """The CPU backend and decode kernel of commit `rev`, built from its own
    sources (the backend module is loaded from there too: it decides how the
    kernel is called). The kernel is typed from today's signature table, whose
    parameters are pointers and ints either way."""
    tar = subprocess.run(["git", "archive", rev, "executor_svc"], capture_output=True, check=True).stdout
    tarfile.open(fileobj=io.BytesIO(tar)).extractall(folder)
    attention = Path(folder) / "executor_svc" / "attention"
    lib = load_library(str(attention / "native" / "paged_decode.c"))
    assert lib is not None, f"the decode kernel of {rev} did not build"
    spec = importlib.util.spec_from_file_location("baseline_cpu_backend", attention / "cpu_backend.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    kernel = bind(lib, "attention/native/paged_decode.c", ("paged_decode_attention",)).paged_decode_attention
    return module.CpuAttentionBackend(kernel)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--contexts", default="256,512,1024,2048")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--baseline-commit", default=None)
    p.add_argument("--dot", action="store_true", help="also time the bf16 dot decode route on bfloat16 rows")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    backends = {"now": CpuAttentionBackend(native_kernel.load())}
    with tempfile.TemporaryDirectory() as folder:
        if a.baseline_commit:
            backends = {"before": baseline_backend(a.baseline_commit, folder), **backends}
        copy = copy_bandwidth(a.rounds)
        print(f"copy bandwidth (read + write, {a.threads} threads): {copy / 1e9:.1f} GB/s")
        for context in (int(c) for c in a.contexts.split(",")):
            for dtype in (getattr(torch, d) for d in a.dtypes.split(",")):
                dot = {}
                if a.dot and dtype == torch.bfloat16:
                    dot["dot"] = CpuAttentionBackend(native_kernel.load(), decode_route="dot")
                run({**backends, **dot}, context, dtype, a, copy)


def run(backends: dict, context: int, dtype: torch.dtype, a, copy: float) -> None:
    shapes = [(context - 1, 1)] * a.batch
    batch = make_batch(shapes, block_size=BLOCK, num_kv_heads=KV_HEADS, group=HEADS // KV_HEADS, head_dim=HEAD_DIM,
                       dtype=dtype, seed=1)  # fmt: skip
    next(iter(backends.values())).write_kv(batch.new_key, batch.new_value, batch.k_cache, batch.v_cache, batch.meta)
    layer_bytes = 2 * a.batch * context * KV_HEADS * HEAD_DIM * batch.k_cache.element_size()
    copies = max(1, -(-MIN_BYTES // (2 * batch.k_cache.numel() * batch.k_cache.element_size())))
    caches = [(batch.k_cache, batch.v_cache)] + [
        (batch.k_cache.clone(), batch.v_cache.clone()) for _ in range(copies - 1)
    ]
    metas = {name: dataclasses.replace(batch.meta, extra={}) for name in backends}
    for name, backend in backends.items():
        backend.prepare(metas[name])
    outs = {n: b.forward(batch.query, *caches[0], metas[n], batch.scale) for n, b in backends.items()}
    ref = next(iter(outs.values()))
    diff = max((o - ref).abs().max().item() for o in outs.values())
    times = {name: [] for name in backends}
    for _ in range(a.rounds):
        for name, backend in backends.items():
            t = time.perf_counter()
            for k_cache, v_cache in caches:
                backend.forward(batch.query, k_cache, v_cache, metas[name], batch.scale)
            times[name].append((time.perf_counter() - t) / copies)
    cells = []
    for name, t in times.items():
        sec = statistics.median(t)
        rate = layer_bytes / sec
        cells.append(f"{name} {1000 * sec:7.2f} ms {rate / 1e9:5.1f} GB/s ({rate / copy:4.2f} of copy)")
    ratio = ""
    for slow, fast in (("before", "now"), ("now", "dot")):  # the speed-up of the second
        if slow in times and fast in times:
            ratio += f"  {slow}/{fast} {statistics.median(times[slow]) / statistics.median(times[fast]):.2f}x"
    dt = "bfloat16" if dtype == torch.bfloat16 else "float32"
    print(f"context {context:5} {dt:8} batch {a.batch}  " + "  ".join(cells) + f"{ratio}  max|diff| {diff:.1e}")


if __name__ == "__main__":
    main()
