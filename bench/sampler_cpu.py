"""Median time of one Sampler call (metadata build excluded and included).

    .venv/bin/python bench/sampler_cpu.py [--batch 64] [--vocab 49152] [--iters 20] [--threads N] [--logits model]
        [--against-torch]

In a process set up with the executor's heap (executor_svc/heap.py).
Wall time, plus the process's CPU time, which a busy shared machine inflates
less (with one thread the two agree when the machine is idle).

Logits: `random` (default), N(0, 3^2) per token, a flat distribution whose
top-p nucleus holds thousands of tokens; `model`, the embedded model's own
next-token logits over stdlib module docstrings (bench/bf16_quant_quality.py's
texts, bfloat16, about a minute to compute), whose nucleus at temperature 0.8
/ top-p 0.95 held a median 18 tokens (90th percentile 288): what served
requests see. Each iteration takes the next `--batch` rows of them.

Cases: all greedy (the argmax fast path); temperature alone; temperature +
top_p; + top_k; top_k + top_p, seeded; temperature + top_p with
repetition/presence/frequency penalties over a 512-token prompt and 128
outputs; the same as seeded rows; greedy with top-5 logprobs.

--against-torch also runs each call on torch's logsumexp and topk
(RowOps.torch_only(): the sampler before they went native), alternating
call by call, and prints that time and its ratio to the default's.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from executor_svc.heap import keep_freed_memory
from executor_svc.row_ops import RowOps
from executor_svc.sampler import Sampler, build_sampling_metadata
from shared.sampling_params import SamplingParams

CASES = {
    "all greedy": SamplingParams(temperature=0.0),
    "temperature 1.0": SamplingParams(temperature=1.0),
    "temperature + top_p": SamplingParams(temperature=0.8, top_p=0.95),
    "temperature + top_k": SamplingParams(temperature=0.8, top_k=50),
    "top_k + top_p, seeded": SamplingParams(temperature=0.8, top_k=40, top_p=0.95, seed=3),
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
    ap.add_argument("--logits", choices=("random", "model"), default="random")
    ap.add_argument(
        "--against-torch",
        action="store_true",
        help="also time the sampler on torch's logsumexp and topk (RowOps.torch_only), alternating call by call",
    )
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    if args.logits == "model":
        pool = model_logits()
        args.vocab = pool.shape[1]
    else:
        pool = torch.randn(args.batch, args.vocab, generator=gen) * 3
    prompts = [torch.randint(args.vocab, (512,), generator=gen).tolist() for _ in range(args.batch)]
    outputs = [torch.randint(args.vocab, (128,), generator=gen).tolist() for _ in range(args.batch)]
    samplers = {"sampler": Sampler()}
    if args.against_torch:
        samplers["torch ops"] = Sampler(RowOps.torch_only())
    print(
        f"B={args.batch} V={args.vocab} threads={torch.get_num_threads()} iters={args.iters} "
        f"logits {'~ N(0, 3^2)' if args.logits == 'random' else f'of the model ({pool.shape[0]} positions)'}, "
        "prompts 512 + outputs 128 tokens"
    )
    for name, params in CASES.items():
        call = {k: [] for k in samplers}
        cpu, total = [], []
        for i in range(args.iters):
            first = i * args.batch % max(1, pool.shape[0] - args.batch + 1)
            logits = pool[first : first + args.batch].contiguous()
            t0 = time.perf_counter()
            md = build_sampling_metadata([params] * args.batch, prompts, outputs, args.vocab, "cpu")
            md_s = time.perf_counter() - t0
            # Alternate which sampler goes first, so that drift on a shared machine falls on both.
            for k in list(samplers)[:: 1 if i % 2 else -1]:
                t1, c1 = time.perf_counter(), time.process_time()
                samplers[k](logits.clone(), md)
                t2, c2 = time.perf_counter(), time.process_time()
                call[k].append(t2 - t1)
                if k == "sampler":
                    cpu.append(c2 - c1)
                    total.append(md_s + t2 - t1)
        line = (
            f"{name:28s} sampler {statistics.median(call['sampler']) * 1e3:7.1f} ms wall "
            f"{statistics.median(cpu) * 1e3:7.1f} ms cpu   "
            f"with metadata {statistics.median(total) * 1e3:7.1f} ms wall"
        )
        if args.against_torch:
            theirs = statistics.median(call["torch ops"])
            line += f"   torch ops {theirs * 1e3:7.1f} ms ({theirs / statistics.median(call['sampler']):.2f}x)"
        print(line)


def model_logits(tokens_per_text: int = 128) -> torch.Tensor:
    """[positions, vocab] float32: the embedded model's next-token logits over
    bf16_quant_quality's texts, in bfloat16 as served by default on CPUs with it."""
    from tokenizers import Tokenizer

    from bench.bf16_quant_quality import logits_by_position, texts
    from executor_svc.attention import get_backend
    from executor_svc.model_loader import load_model

    loaded = load_model(None, torch.bfloat16, "cpu", get_backend("cpu"), packed_gemm=True, gguf_blocks=True)
    tokenizer = Tokenizer.from_str(loaded.tokenizer.tokenizer_json)
    docs = [tokenizer.encode(t, add_special_tokens=False).ids[:tokens_per_text] for t in texts()]
    rows = torch.cat([logits_by_position(loaded.model, ids, 32, torch.bfloat16) for ids in docs])
    return rows[torch.randperm(rows.shape[0], generator=torch.Generator().manual_seed(0))]


if __name__ == "__main__":
    # The executor's heap (executor_svc/heap.py). Without it a call's fresh 12.6 MB
    # tensors could be mapped and faulted in anew each time, depending on the
    # process's allocation history: temperature 1.0 at 64 rows took 9.6-11.7 ms
    # in one tree and 3.0-3.5 ms in another with the same sampler code.
    keep_freed_memory(steps_on_main_thread=True)
    main()
