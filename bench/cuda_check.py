"""The serving engine on a CUDA GPU, end to end: correct against Hugging Face, and how fast.

    python -m bench.cuda_check [--out-dir DIR]
    python -m bench.cuda_check --cpu-smoke     # a tiny model on CPU: does the script itself run?

Needs a CUDA device (exits 2 without one) except with --cpu-smoke, whose
figures mean nothing. The tests run the CUDA path's Triton kernels in
Triton's interpreter only; bench/gpu_check.py checks the --deterministic
kernels on hardware; this script checks what a user of a GPU runs: real
scheduler and executor processes with `--device cuda` and otherwise default
flags (Triton attention, the KV cache sized from memory measured around a
profiling step, `--gpu-memory-utilization` 0.9).

Nothing can be downloaded on the lent GPU machine and the embedded GGUF is
too large to carry there, so the model is a random Llama of
SmolLM2-135M-Instruct's shape (30 layers, hidden 576, 9 query and 3 KV
heads, 49,152 tokens, tied embeddings) saved as a Hugging Face folder with a
word-level tokenizer; prompts are token ids. The reference is transformers
running the same folder on the same GPU in the same dtype.

1. Parity, float32 and bfloat16 (decodes replayed from CUDA graphs, the
   default), and bfloat16 with --enforce-eager: 12 prompts (5-700 tokens)
   sent together, greedy, 32 tokens each, with logprobs. Tokens must equal
   transformers' greedy tokens up to a position where its top-2 logit gap
   is below the dtype's noise (then the continuations may part; reported);
   each token's logprob within the dtype's tolerance of transformers' while
   they agree. The same prompts again (now prefix-cache hits) are held to
   the same standard.
2. Throughput: the headline workload's shape (prompts 64-512, outputs
   32-256, ignore_eos, greedy) at 64 and 512 requests in bfloat16, output
   tokens per second, with graphs and with --enforce-eager.
3. --deterministic (bfloat16): a request alone, amid 11 and amid 63 others
   gives the same tokens, and graphs the same tokens and logprobs as
   --enforce-eager; the 64-request throughput beside the default's.
Every run must have captured CUDA graphs exactly where asked.

Prints a line per check, writes JSON to --out-dir, ends "ALL OK" (exit 0)
or lists the failures (exit 1).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from bench import driver, workloads
from pagedserve_client import Client
from tests.servers import Servers

SMOLLM2_SHAPE = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    max_position_embeddings=2048,
    rope_theta=100000.0,
    # Wide enough that greedy choices are rarely near ties, narrow enough
    # that 30 layers of attention do not collapse onto one key.
    initializer_range=0.05,
)
SMOKE_SHAPE = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, max_position_embeddings=1024
)
# Logit gap under which two greedy choices count as a tie, and the largest
# allowed |logprob| difference while tokens agree, per dtype.
TIE_GAP = {"float32": 1e-3, "bfloat16": 0.25}
LOGPROB_TOL = {"float32": 2e-3, "bfloat16": 0.25}
NEW_TOKENS = 32
# (label, dtype, executor flags beyond --model/--device): the defaults in both
# dtypes, then bfloat16 without CUDA graphs for their speed-up and parity.
RUNS = (
    ("float32", "float32", []),
    ("bfloat16", "bfloat16", []),
    ("bfloat16 --enforce-eager", "bfloat16", ["--enforce-eager"]),
)


def save_model(folder: str, smoke: bool) -> int:
    """The random model and a word-level tokenizer of its vocabulary; returns the vocabulary size."""
    from tests.model_utils import save_tiny_model_with_tokenizer

    hf = save_tiny_model_with_tokenizer(folder, "llama_tied", **(SMOKE_SHAPE if smoke else SMOLLM2_SHAPE))
    return hf.config.vocab_size


def hf_greedy(folder: str, dtype: str, device: str, prompts: list[list[int]]) -> list[dict]:
    """transformers' greedy tokens, per-step log-softmax and top-2 gaps for each prompt.

    The whole sequence runs again at every step, without transformers' KV
    cache: slower, but the same call in every transformers version, and no
    generate() logic (EOS, min_new_tokens) between the logits and the choice."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype)).to(device).eval()
    out = []
    with torch.inference_mode():
        for prompt in prompts:
            ids, rows = torch.tensor([prompt], device=device), []
            for _ in range(NEW_TOKENS):
                logits = model(input_ids=ids, use_cache=False).logits[0, -1].float()
                rows.append(logits)
                ids = torch.cat([ids, logits.argmax().view(1, 1)], dim=1)
            logits = torch.stack(rows)
            top2 = logits.topk(2, dim=-1).values
            out.append(
                dict(
                    tokens=ids[0, len(prompt) :].tolist(),
                    logprobs=torch.log_softmax(logits, dim=-1).cpu(),
                    gaps=(top2[:, 0] - top2[:, 1]).tolist(),
                )
            )
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return out


def ours(target: str, prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    """(tokens, logprobs) of each prompt, all sent together."""

    def one(prompt):
        with Client(target) as c:
            (done,) = c.complete(token_ids=prompt, max_tokens=NEW_TOKENS, ignore_eos=True, temperature=0.0, logprobs=1)
        return done.token_ids, [lp.logprob for lp in done.logprobs]

    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, prompts))


def compare(label: str, dtype: str, mine, ref) -> tuple[dict, list[str]]:
    """Per prompt: tokens agreeing, where they part and HF's gap there, the largest logprob error."""
    rows, failures = [], []
    for i, ((tokens, logprobs), r) in enumerate(zip(mine, ref)):
        agree = next((k for k, (a, b) in enumerate(zip(tokens, r["tokens"])) if a != b), len(tokens))
        err = max((abs(logprobs[k] - r["logprobs"][k, tokens[k]].item()) for k in range(agree)), default=0.0)
        gap = r["gaps"][agree] if agree < len(tokens) else None
        rows.append(dict(prompt=i, agree=agree, gap_at_split=gap, max_logprob_err=err))
        if len(tokens) != NEW_TOKENS:
            failures.append(f"{label} prompt {i}: {len(tokens)} tokens, asked for {NEW_TOKENS}")
        if gap is not None and gap >= TIE_GAP[dtype]:
            failures.append(f"{label} prompt {i}: parts from transformers at token {agree} where its gap is {gap:.4f}")
        if err > LOGPROB_TOL[dtype]:
            failures.append(f"{label} prompt {i}: logprob off by {err:.4f} (tolerance {LOGPROB_TOL[dtype]})")
    summary = dict(
        prompts=len(rows),
        full_agreement=sum(r["agree"] == NEW_TOKENS for r in rows),
        max_logprob_err=max(r["max_logprob_err"] for r in rows),
        rows=rows,
    )
    return summary, failures


def throughput(target: str, num_requests: int, vocab: int, seed: int) -> dict:
    reqs = workloads.uniform_workload(num_requests, (64, 512), (32, 256), vocab, seed=seed)
    run = driver.run_requests(target, reqs)
    errors = [r.error for r in run.records if r.error]
    return dict(
        requests=num_requests,
        errors=errors[:3],
        output_tokens=run.output_tokens,
        duration_s=run.duration_s,
        output_tok_per_s=run.output_tokens / run.duration_s,
    )


def startup_facts(servers: Servers) -> list[str]:
    """The executor's log lines that say where it runs and how large its KV cache is."""
    keys = ("device", "kv_cache", "num_blocks", "memory", "attention", "cuda_graphs")
    return [line[:400] for line in servers.logs("executor").splitlines() if any(k in line for k in keys)][:20]


def graphs_as_asked(label: str, device: str, eager: bool, servers: Servers) -> list[str]:
    """A failure unless the executor captured CUDA graphs exactly where asked (never on CPU)."""
    log = servers.logs("executor")
    captured, failed = "cuda_graphs_captured" in log, "cuda_graphs_failed" in log
    if failed or captured != (device == "cuda" and not eager):
        return [f"{label}: CUDA graphs captured={captured} failed={failed}, expected {not eager} on {device}"]
    return []


def device_for(cpu_smoke: bool) -> str | None:
    """The device: cpu for --cpu-smoke, else cuda, or None (said why) without a GPU."""
    if not cpu_smoke and not torch.cuda.is_available():
        print("no CUDA device (use --cpu-smoke to check the script on CPU)")
        return None
    return "cpu" if cpu_smoke else "cuda"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out-dir", default="bench/results")
    p.add_argument("--cpu-smoke", action="store_true")
    args = p.parse_args(argv)
    device = device_for(args.cpu_smoke)
    if device is None:
        return 2
    if device == "cuda":
        print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    result, failures = dict(device=device), []
    folder = tempfile.mkdtemp(prefix="cuda-check-")
    vocab = save_model(folder, args.cpu_smoke)
    rng = random.Random(0)
    lengths = [5, 17, 40, 64, 100, 130, 200, 256, 333, 400, 512, 700]
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]
    base = ["--model", folder, "--device", device]
    if args.cpu_smoke:
        base += ["--kv-cache-gib", "0.05"]
    scale = 0.125 if args.cpu_smoke else 1  # request counts for --cpu-smoke

    refs: dict[str, list[dict]] = {}
    for label, dtype, flags in RUNS:
        t0 = time.perf_counter()
        with Servers(executor_args=[*base, "--dtype", dtype, *flags]) as s:
            started = time.perf_counter() - t0
            first = ours(s.public_addr, prompts)
            again = ours(s.public_addr, prompts)
            facts = startup_facts(s)
            failures += graphs_as_asked(label, device, "--enforce-eager" in flags, s)
            tput = {}
            if dtype == "bfloat16":
                for n in (64, 512):
                    tput[n] = throughput(s.public_addr, max(2, int(n * scale)), vocab, seed=n)
        if dtype not in refs:
            refs[dtype] = hf_greedy(folder, dtype, device, prompts)
        ref = refs[dtype]
        summary, bad = compare(label, dtype, first, ref)
        # Cached prompts run other kernels (prefill attention over cached
        # blocks), so they are held to the same standard, not to equal bits.
        cached, bad_cached = compare(f"{label} (prefix-cache hits)", dtype, again, ref)
        failures += bad + bad_cached
        same = sum(a[0] == b[0] for a, b in zip(first, again))
        result[label] = dict(
            startup_s=started,
            parity=summary,
            parity_cached=cached,
            same_tokens_cached=same,
            startup_log=facts,
            throughput=tput,
        )
        print(
            f"{label}: servers up in {started:.1f} s; {summary['full_agreement']}/{summary['prompts']} prompts "
            f"match transformers for all {NEW_TOKENS} tokens; max |logprob err| {summary['max_logprob_err']:.2e}; "
            f"partings {[(r['prompt'], r['agree'], r['gap_at_split']) for r in summary['rows'] if r['agree'] < NEW_TOKENS]}; "
            f"again as cache hits: {same}/{len(prompts)} identical, {cached['full_agreement']} match transformers",
            flush=True,
        )
        for line in facts:
            print(f"  executor: {line}")
        for n, t in tput.items():
            print(
                f"  throughput {n} requests: {t['output_tok_per_s']:.0f} output tok/s "
                f"({t['output_tokens']} tokens in {t['duration_s']:.1f} s) errors {t['errors']}",
                flush=True,
            )
            failures += [f"{label} throughput {n}: {e}" for e in t["errors"]]
    graphs, eager = result["bfloat16"]["throughput"], result["bfloat16 --enforce-eager"]["throughput"]
    result["graphs_over_eager"] = {n: graphs[n]["output_tok_per_s"] / eager[n]["output_tok_per_s"] for n in graphs}
    print(f"CUDA graphs / --enforce-eager, output tok/s: {result['graphs_over_eager']}", flush=True)

    # --deterministic: batch invariance through the real servers, its cost,
    # and that replaying graphs changes no bit of it.
    det = [*base, "--dtype", "bfloat16", "--deterministic"]
    with Servers(executor_args=det) as s:
        failures += graphs_as_asked("--deterministic", device, False, s)
        together = ours(s.public_addr, prompts)
        alone = ours(s.public_addr, prompts[5:6])[0]
        crowd = [prompts[5]] + [[rng.randrange(3, vocab) for _ in range(rng.randint(20, 300))] for _ in range(63)]
        amid = ours(s.public_addr, crowd)[0]
        det_tput = throughput(s.public_addr, max(2, int(64 * scale)), vocab, seed=64)
    with Servers(executor_args=[*det, "--enforce-eager"]) as s:
        eager_together = ours(s.public_addr, prompts)
    invariant = alone == amid == together[5]
    same_as_eager = together == eager_together
    if not invariant:
        failures.append("--deterministic: a request alone, amid 63 others and amid the 11 others differed")
    if not same_as_eager:
        failures.append("--deterministic: tokens or logprobs differ between graphs and --enforce-eager")
    base_tput = result["bfloat16"]["throughput"][64]["output_tok_per_s"]
    result["deterministic"] = dict(
        invariant=invariant,
        same_as_eager=same_as_eager,
        throughput=det_tput,
        ratio_to_default=det_tput["output_tok_per_s"] / base_tput,
    )
    print(
        f"--deterministic: alone == amid 63 others == amid 11: {invariant}; graphs == --enforce-eager, "
        f"tokens and logprobs of 12 prompts: {same_as_eager}; 64 requests {det_tput['output_tok_per_s']:.0f} "
        f"output tok/s ({result['deterministic']['ratio_to_default']:.2f}x the default's)",
        flush=True,
    )

    result["failures"] = failures
    os.makedirs(args.out_dir, exist_ok=True)
    path = os.path.join(args.out_dir, f"cuda_check-{time.strftime('%Y%m%d-%H%M%S')}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1, default=str)
    print(f"wrote {path}")
    print("\n".join(["FAILURES:", *failures]) if failures else "ALL OK")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
