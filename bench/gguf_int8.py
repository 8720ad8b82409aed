"""--gguf-activations int8 against float: every GGUF linear of a decode step, side by side.

    .venv/bin/python -m bench.gguf_int8 [--model PATH.gguf] [--rows 1,2,4,8,16] [--threads 1,2] [--reps 15]

Loads the model as a float32 CPU executor does with its GGUF blocks
(packed GEMM, --gguf-blocks auto) and runs, per row count and thread count,
one pass over every linear the file keeps in Q4_1/Q8_0 blocks (SmolLM2-135M:
30 layers x qkv, o, gate+up, down, and the head), in layer order, so that
each GEMM reads its weights from DRAM as a decode step does. The two routes
over the same blocks alternate pass by pass (which goes first alternates
too): "float" (the block kernel, float32 activations, fused_blocks.h) and
"int8" (activations quantised to int8, VPDPBUSD, int8_blocks.h). Prints the
median pass time and the weights' read rate for each, their ratio, and the
median time per call of each kind of linear.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch

from bench.report import cpu_description
from executor_svc import packed_linear
from executor_svc.attention import get_backend
from executor_svc.model_loader import load_model

ROUTES = ("float", "int8")


def block_linears(model) -> list[tuple[str, torch.Tensor, dict[str, packed_linear.PackedWeight]]]:
    """(kind of linear, weight, {route: PackedWeight}) in a forward's order, for weights kept in Q4_1/Q8_0 blocks."""
    found = []
    for layer in model.layers:
        for name, packed in layer.packed.items():
            found.append((name, getattr(layer, f"{name}_weight"), packed))
    head = model.embed_tokens if model.lm_head is None else model.lm_head
    found.append(("head", head, model._head_packed))
    return [
        (name, weight, {"float": p, "int8": dataclasses.replace(p, int8_rows=1 << 30)})
        for name, weight, p in found
        if p is not None and p.blocks is not None and p.blocks.kind in packed_linear.INT8_KINDS
    ]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="a GGUF file (default: the embedded SmolLM2-135M)")
    p.add_argument("--rows", default="1,2,4,8,16")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--reps", type=int, default=15)
    a = p.parse_args(argv)
    kernel = packed_linear.kernel()
    assert kernel is not None and kernel.int8_native, "needs the packed kernel and AVX512-VNNI"
    loaded = load_model(a.model, torch.float32, "cpu", get_backend("cpu"), packed_gemm=True, gguf_blocks=True)
    linears = block_linears(loaded.model)
    total = sum(p["float"].blocks.nbytes for _, _, p in linears)
    kinds = sorted({(name, p["float"].blocks.kind, tuple(w.shape)) for name, w, p in linears})
    print(f"CPU: {cpu_description()}")
    print(f"{len(linears)} linears in blocks, {total / 1e6:.1f} MB: " + ", ".join(f"{n} {k} {s}" for n, k, s in kinds))
    for threads in (int(t) for t in a.threads.split(",")):
        torch.set_num_threads(threads)
        for rows in (int(r) for r in a.rows.split(",")):
            xs = {w.shape[1]: torch.randn(rows, w.shape[1]) for _, w, _ in linears}
            passes = {r: [] for r in ROUTES}
            calls = {(r, n): [] for r in ROUTES for n, _, _ in kinds}
            for rep in range(a.reps + 1):
                for route in ROUTES if rep % 2 else ROUTES[::-1]:
                    times = []
                    start = time.perf_counter()
                    for name, weight, packed in linears:
                        t = time.perf_counter()
                        packed_linear.linear(xs[weight.shape[1]], weight, None, packed[route])
                        times.append((name, time.perf_counter() - t))
                    if rep:  # the first pass of each warms up
                        passes[route].append(time.perf_counter() - start)
                        for name, dt in times:
                            calls[(route, name)].append(dt)
            med = {r: statistics.median(v) for r, v in passes.items()}
            per_call = "  ".join(
                f"{n} {1e6 * statistics.median(calls[('float', n)]):.0f}/{1e6 * statistics.median(calls[('int8', n)]):.0f}"
                for n, _, _ in kinds
            )
            print(
                f"threads {threads} rows {rows:2}: pass float {1e3 * med['float']:.2f} ms ({total / med['float'] / 1e9:.1f} GB/s)"
                f"  int8 {1e3 * med['int8']:.2f} ms ({total / med['int8'] / 1e9:.1f} GB/s)"
                f"  float/int8 {med['float'] / med['int8']:.2f}x   us per call float/int8: {per_call}"
            )


if __name__ == "__main__":
    main()
