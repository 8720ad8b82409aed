"""Decode and prefill step time under two CPU GEMM settings, interleaved in one process.

    .venv/bin/python -m bench.cpu_gemm_ab [--setting cpu-gemm|gguf-blocks|dtype|bf16-gemm|bf16-gguf-blocks|gguf-activations|
        decoder-stack|bf16-decoder-stack|bf16-prefill-attention|bf16-prefill-dot|bf16-decode-attention]
        [--rounds 5] [--num-threads 2]
        [--batch-sizes 1,8,16,32,64,128]

--setting cpu-gemm (default) compares --cpu-gemm native (the packed
kernel's float32 panels: both executors run --gguf-blocks off) with torch
(MKL); --setting gguf-blocks compares --gguf-blocks auto (small batches read
the GGUF's Q4_1/Q8_0 blocks) with off (float32 panels only); --setting
dtype compares --dtype bfloat16 (on CPUs without AVX512-BF16: bfloat16
weights and KV, float32 arithmetic) with float32; --setting bf16-gemm
compares that bfloat16 path (--cpu-gemm auto) with torch's own bf16 GEMM
(--cpu-gemm torch, emulated on such CPUs); --setting bf16-gguf-blocks
compares, both in that bfloat16 path, --gguf-blocks auto (1-32 rows read
the GGUF's blocks) with off (bfloat16 blocks only); --setting
gguf-activations compares, in float32, --gguf-activations int8 (every row
count over the GGUF's blocks with int8 activations, AVX512-VNNI) with float;
--setting decoder-stack (bf16-decoder-stack: in the bfloat16 path) compares
--decoder-stack auto (a decode step's layers in one native call) with off;
--setting bf16-prefill-attention compares, in the bfloat16 path, prefill
attention through SDPA in bfloat16 (--prefill-attention sdpa) with the
native kernel, and bf16-prefill-dot the kernel's VDPBF16PS path
(--prefill-attention dot) with it; bf16-decode-attention compares decode
attention through VDPBF16PS (--decode-attention dot) with widening.
Loads the embedded model twice, one executor per value, and times the same
rows as bench.forward_sweep (decode batches at one context, a 64-decode step
at a longer context, an 8 x 256-token prefill), alternating the two
executors round by round so that load from other processes falls on both
alike. Prints the median step time of each and their ratio.
"""

from __future__ import annotations

import argparse
import itertools
import statistics

import torch

from bench.forward_sweep import BLOCK_SIZE, TimedModel, kv_gib_needed, time_row
from executor_svc.config import ExecutorConfig
from executor_svc.model_loader import open_checkpoint
from executor_svc.worker import Worker
from shared.logging import configure_logging

# --setting: (ExecutorConfig field, (value under test, value it is compared with), fields both executors share)
SETTINGS = {
    # float32 panels vs MKL, as before --gguf-blocks (whose default would send 1-32 rows to the block path)
    "cpu-gemm": ("cpu_gemm", ("native", "torch"), {"gguf_blocks": "off"}),
    "gguf-blocks": ("gguf_blocks", ("auto", "off"), {}),
    "dtype": ("dtype", ("bfloat16", "float32"), {}),
    "bf16-gemm": ("cpu_gemm", ("auto", "torch"), {"dtype": "bfloat16"}),
    "bf16-gguf-blocks": ("gguf_blocks", ("auto", "off"), {"dtype": "bfloat16"}),
    "gguf-activations": ("gguf_activations", ("int8", "float"), {}),
    "decoder-stack": ("decoder_stack", ("auto", "off"), {}),
    "bf16-decoder-stack": ("decoder_stack", ("auto", "off"), {"dtype": "bfloat16"}),
    "bf16-prefill-attention": ("prefill_attention", ("sdpa", "native"), {"dtype": "bfloat16"}),
    "bf16-prefill-dot": ("prefill_attention", ("dot", "native"), {"dtype": "bfloat16"}),
    "bf16-decode-attention": ("decode_attention", ("dot", "widen"), {"dtype": "bfloat16"}),
}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--setting", choices=sorted(SETTINGS), default="cpu-gemm")
    p.add_argument("--rounds", type=int, default=5, help="alternations; each times 2 steps per executor and row")
    p.add_argument("--num-threads", type=int, default=2)
    p.add_argument("--batch-sizes", default="1,8,16,32,64,128")
    a = p.parse_args(argv)
    configure_logging("warning", False)
    torch.set_num_threads(a.num_threads)
    rows = [dict(sweep="batch", batch=int(b), context=256, new=1) for b in a.batch_sizes.split(",")]
    rows += [dict(sweep="context", batch=64, context=512, new=1), dict(sweep="prefill", batch=8, context=256, new=256)]
    gib = kv_gib_needed(open_checkpoint(None)[0].config, torch.float32, rows)
    field, (new, old), shared = SETTINGS[a.setting]
    executors = {}
    for gemm in (new, old):
        settings = {"dtype": "float32", **shared, field: gemm}
        worker = Worker(ExecutorConfig(kv_cache_gib=gib, num_threads=a.num_threads, **settings))
        worker.configure(
            block_size=BLOCK_SIZE,
            max_num_batched_tokens=max(r["batch"] * r["new"] for r in rows),
            max_num_seqs=max(r["batch"] for r in rows),
        )
        timed = worker.runner.model = TimedModel(worker.runner.model)
        executors[gemm] = (worker, timed)
    steps, gen = itertools.count(1), torch.Generator().manual_seed(0)
    print(f"--{a.setting}: {new} vs {old}")
    print(f"{'row':22} {new + ' ms':>10} {old + ' ms':>10} {old + '/' + new:>13}")
    for row in rows:
        ms = {gemm: [] for gemm in executors}
        for r in range(a.rounds):
            order = list(executors.items()) if r % 2 == 0 else list(reversed(executors.items()))
            for gemm, (worker, timed) in order:
                ms[gemm].append(1e3 * time_row(worker, timed, row, 2, steps, gen)[0])
        med = {gemm: statistics.median(v) for gemm, v in ms.items()}
        label = f"{row['sweep']} {row['batch']}x{row['context']}"
        print(f"{label:22} {med[new]:10.1f} {med[old]:10.1f} {med[old] / med[new]:12.2f}x", flush=True)


if __name__ == "__main__":
    main()
