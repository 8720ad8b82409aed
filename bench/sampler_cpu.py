"""Median time of one Sampler call (metadata build excluded and included).

    .venv/bin/python bench/sampler_cpu.py [--batch 64] [--vocab 49152] [--iters 20] [--threads N]

Wall time, plus the process's CPU time, which a busy shared machine inflates
less (with one thread the two agree when the machine is idle).

Cases: all greedy (the argmax fast path); all temperature + top_p; temperature +
top_p with repetition/presence/frequency penalties over a 512-token prompt and
128 outputs; the same as seeded rows; greedy with top-5 logprobs.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from executor_svc.sampler import Sampler, build_sampling_metadata
from shared.sampling_params import SamplingParams

CASES = {
    "all greedy": SamplingParams(temperature=0.0),
    "temperature + top_p": SamplingParams(temperature=0.8, top_p=0.95),
    "temperature + top_k": SamplingParams(temperature=0.8, top_k=50),
    "top_p + penalties": SamplingParams(
        temperature=0.8, top_p=0.95, repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.5
    ),
    "top_p + penalties, seeded": SamplingParams(
        temperature=0.8, top_p=0.95, repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.5, seed=7
    ),
    "greedy + logprobs=5": SamplingParams(temperature=0.0, logprobs=5),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--threads", type=int, default=0, help="torch threads; 0 = torch's default")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(args.batch, args.vocab, generator=gen) * 3
    prompts = [torch.randint(args.vocab, (512,), generator=gen).tolist() for _ in range(args.batch)]
    outputs = [torch.randint(args.vocab, (128,), generator=gen).tolist() for _ in range(args.batch)]
    sampler = Sampler()
    print(
        f"B={args.batch} V={args.vocab} threads={torch.get_num_threads()} iters={args.iters} "
        f"logits ~ N(0, 3^2), prompts 512 + outputs 128 tokens"
    )
    for name, params in CASES.items():
        call, cpu, total = [], [], []
        for _ in range(args.iters):
            t0 = time.perf_counter()
            md = build_sampling_metadata([params] * args.batch, prompts, outputs, args.vocab, "cpu")
            t1, c1 = time.perf_counter(), time.process_time()
            sampler(logits, md)
            t2, c2 = time.perf_counter(), time.process_time()
            call.append(t2 - t1)
            cpu.append(c2 - c1)
            total.append(t2 - t0)
        print(
            f"{name:28s} sampler {statistics.median(call) * 1e3:7.1f} ms wall "
            f"{statistics.median(cpu) * 1e3:7.1f} ms cpu   "
            f"with metadata {statistics.median(total) * 1e3:7.1f} ms wall"
        )


if __name__ == "__main__":
    main()
