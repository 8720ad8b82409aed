"""Each GEMM a bfloat16 model's linear layers can take, timed side by side at each row count.

    .venv/bin/python -m bench.bf16_gemm [--rows 1,2,4,8,16,32,64,128,256,512,2048] [--reps 9]
        [--num-threads 2] [--gguf-kind Q4_1] [--emulated-dot] [--no-onednn]

The candidates of bf16_gemm_routes.py (what `--cpu-gemm auto` measures at
start-up on a CPU with AVX512-BF16 or AMX, logged as `bf16_linear_route`),
on random weights of SmolLM2-135M's four linear shapes (qkv, o, gate+up,
down), each with 30 copies so that every call reads its weights from DRAM as
a decode step does (the 30 layers): "blocks" (the native kernel over BF16
blocks, float32 arithmetic), "gguf" (over Q4_1/Q8_0 blocks), "dot"
(VDPBF16PS over the BF16 blocks), "gguf_dot" (VDPBF16PS over Q4_1 blocks),
"onednn" (oneDNN's bf16 GEMM), and
"torch" (F.linear in bf16, what a bf16 model without PagedServe's kernels
runs). Per row count: the median time of one pass over the 30 layers'
four linears, candidates alternated within each repetition, GFLOP/s, and
which route start-up calibration would pick from these medians.

On a CPU without AVX512-BF16 there is no VDPBF16PS: `--emulated-dot` times
the kernel's emulation instead (its arithmetic in AVX-512F FMAs, always
slower than "blocks"), and oneDNN and torch emulate bf16; such figures show
the script works, not what the dot kernel does.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench.report import cpu_description
from executor_svc import bf16_gemm_routes, onednn_linear, packed_linear

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
LAYERS = 30


def layer_gemms(args) -> list[dict[str, dict[str, object]]]:
    """LAYERS x {shape: {candidate: gemm}}; "torch" added beside the routes' candidates."""
    kernel = packed_linear.kernel()
    dot = kernel.bf16_dot_native or args.emulated_dot
    onednn = onednn_linear.available() and not args.no_onednn
    layers = []
    for i in range(LAYERS):
        gemms = {}
        for name, (out_f, in_f) in SHAPES.items():
            found = bf16_gemm_routes.candidates(out_f, in_f, gguf_kind=args.gguf_kind, dot=dot, onednn=onednn, seed=i)
            weight = (torch.randn(out_f, in_f) / in_f**0.5).to(torch.bfloat16)
            found["torch"] = lambda x, w=weight: torch.nn.functional.linear(x.to(torch.bfloat16), w).float()
            gemms[name] = found
        layers.append(gemms)
    return layers


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="1,2,4,8,16,32,64,128,256,512,2048")
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--num-threads", type=int, default=2)
    p.add_argument("--gguf-kind", choices=["Q4_1", "Q8_0", "none"], default="Q4_1")
    p.add_argument(
        "--emulated-dot", action="store_true", help="time the dot kernel's emulation where VDPBF16PS is absent"
    )
    p.add_argument("--no-onednn", action="store_true")
    args = p.parse_args(argv)
    args.gguf_kind = None if args.gguf_kind == "none" else args.gguf_kind
    torch.set_num_threads(args.num_threads)
    kernel = packed_linear.kernel()
    assert kernel is not None, "the packed kernel needs x86 AVX-512 and a C compiler"
    print(f"CPU: {cpu_description()}; VDPBF16PS kernel: {'native' if kernel.bf16_dot_native else 'absent'}")
    layers = layer_gemms(args)
    names = list(layers[0]["qkv"])
    flops_per_row = 2 * LAYERS * sum(o * i for o, i in SHAPES.values())
    print(f"{'rows':>6} " + " ".join(f"{n + ' ms':>11}" for n in names) + "  best GFLOP/s  route")
    for rows in (int(r) for r in args.rows.split(",")):
        xs = {i: torch.randn(rows, i) for i in {i for _, i in SHAPES.values()}}
        runs = {n: [] for n in names}
        for rep in range(args.reps + 1):
            for n in names:
                start = time.perf_counter()
                for gemms in layers:
                    for shape, (_, in_f) in SHAPES.items():
                        gemms[shape][n](xs[in_f])
                if rep:
                    runs[n].append(time.perf_counter() - start)
        median = {n: statistics.median(r) for n, r in runs.items()}
        # The routes' rule, over these medians (torch is no route).
        pick = bf16_gemm_routes.winner({n: t for n, t in median.items() if n != "torch"})
        cells = " ".join(f"{median[n] * 1e3:>11.2f}" for n in names)
        print(f"{rows:>6} {cells}  {flops_per_row * rows / min(median.values()) / 1e9:>12.1f}  {pick}")


if __name__ == "__main__":
    main()
