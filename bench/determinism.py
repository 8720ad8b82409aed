"""Where a token's numbers depend on its batch, and what --deterministic costs.

    .venv/bin/python -m bench.determinism [--dtypes float32,bfloat16] [--threads 2] [--rounds 7] [--skip-e2e]

In process, over the embedded SmolLM2-135M (Q4_1 GGUF; bfloat16 = its
weights rounded to bfloat16, run as the executor runs them on CPUs without
AVX512-BF16: float32 arithmetic over bfloat16 weights and KV). For each
dtype, in the default mode and in --deterministic:

1. Variance, op by op. Each op computes the same row alone and inside other
   batch shapes; "same" counts the shapes whose row is bit-identical to the
   row computed alone, max|d| is the largest difference:
   - the linear layers (layer 0's qkv, gate_up, down; the LM head): row 0
     of M random rows for M = 1 .. 2,048 (the routes: GGUF blocks up to 32
     rows, float32 panels 2-256, bfloat16 blocks up to 512, MKL beyond, or
     the kernel beyond too where it measured faster at start-up, as in the
     served executor), and
     at 1 vs 2 threads;
   - RMSNorm: each row of 64 alone vs in the batch;
   - attention: every token of a 300-token request decoded one at a time vs
     prefilled in one chunk, in chunks of 7 and 64, and through SDPA;
   - the sampler's reductions (log_softmax, logsumexp) of one row alone vs in 8.
2. End to end (tests/plan_driver.py drives ModelRunner as the scheduler
   would): 4 requests (2 greedy, 2 seeded top-k/top-p), 10 tokens each with
   logprobs, alone vs batched vs chunked prefill (budget 32 and 64) vs
   preempted and recomputed: requests with identical tokens, with
   bit-identical logprobs, and the largest logprob difference.
3. Cost per kernel, default vs deterministic route, interleaved rounds,
   medians: the four linears of a layer plus the head at M rows, one
   layer's attention for prefill and decode batches, and whole steps
   (ModelRunner.execute) of decodes, prefills and a long chunk.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch

from executor_svc import fused_ops
from executor_svc.attention import get_backend
from executor_svc.attention.reference import make_batch
from executor_svc.kv_cache import allocate_kv_caches
from executor_svc.model_loader import load_model
from executor_svc.model_runner import ModelRunner
from executor_svc.packed_linear import linear
from shared.sampling_params import SamplingParams
from tests.plan_driver import Job, PlanDriver

ROWS = (1, 2, 8, 32, 33, 256, 257, 512, 513, 1024, 2048)
ATTN_CASES = {
    "prefill 7 x 292": [(0, 292)] * 7,
    "prefill 1 x 1024": [(0, 1024)],
    "chunk 4 x (200 cached + 300)": [(200, 300)] * 4,
    "64 decodes at 400": [(400, 1)] * 64,
    "64 decodes + 2 x 512 prefill": [(400, 1)] * 64 + [(0, 512)] * 2,
}


def _load(dtype: torch.dtype, deterministic: bool):
    backend = get_backend("cpu", deterministic)
    loaded = load_model(
        None,
        dtype,
        "cpu",
        backend,
        with_tokenizer=False,
        packed_gemm=True,
        gguf_blocks=True,
        native_rows=not deterministic,
        batch_invariant=deterministic,
    )
    return loaded.model, backend


def _linears(model) -> dict:
    layer = model.layers[0]
    out = {name: (getattr(layer, f"{name}_weight"), layer.packed[name]) for name in ("qkv", "gate_up", "down")}
    out["head"] = (model._tied_head if model._tied_head is not None else model.embed_tokens, model._head_packed)
    return out


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def variance_linears(model, det: bool) -> list[str]:
    lines = []
    gen = torch.Generator().manual_seed(0)
    for name, (weight, packed) in _linears(model).items():
        packed = dataclasses.replace(packed, batch_invariant=det)
        x = torch.randn(max(ROWS), weight.shape[1], generator=gen)
        alone = linear(x[:1], weight, None, packed)[0]
        diffs = [_diff(linear(x[:m], weight, None, packed)[0], alone) for m in ROWS]
        torch.set_num_threads(1)
        one_thread = linear(x[:300], weight, None, packed)
        torch.set_num_threads(2)
        threads = _diff(one_thread, linear(x[:300], weight, None, packed))
        differ = [m for m, d in zip(ROWS, diffs) if d]
        lines.append(
            f"  linear {name:8} same {len(ROWS) - len(differ)}/{len(ROWS)} (differ at M={differ or '-'}) "
            f"max|d| {max(diffs):.1e}; 1 vs 2 threads at 300 rows max|d| {threads:.1e}"
        )
    return lines


def variance_rms_norm(model) -> str:
    x = torch.randn(64, model.config.hidden_size) * 3
    w = model.layers[0].input_norm
    full = fused_ops.rms_norm(x, w, 1e-5)
    same = sum(torch.equal(fused_ops.rms_norm(x[i : i + 1].clone(), w, 1e-5)[0], full[i]) for i in range(64))
    return f"  rms_norm (fused) same {same}/64 rows"


def _attend(backend, shapes_chunks, dtype, seq_len):
    """Every token of one request of seq_len tokens, computed in the given chunk sizes (1 = decoded)."""
    base = make_batch([(0, seq_len)], block_size=16, num_kv_heads=3, group=3, head_dim=64, dtype=dtype, seed=3)
    out = torch.empty_like(base.query)
    start = 0
    k_cache, v_cache = base.k_cache.clone(), base.v_cache.clone()
    for n in shapes_chunks:
        n = min(n, seq_len - start)
        meta = dataclasses.replace(
            base.meta,
            num_tokens=n,
            slot_mapping=base.meta.slot_mapping[start : start + n],
            query_start_loc=torch.tensor([0, n], dtype=torch.int32),
            seq_lens=torch.tensor([start + n], dtype=torch.int32),
            max_query_len=n,
            max_seq_len=start + n,
            query_lens_cpu=[n],
            seq_lens_cpu=[start + n],
            extra={},
        )
        backend.prepare(meta)
        backend.write_kv(base.new_key[start : start + n], base.new_value[start : start + n], k_cache, v_cache, meta)
        out[start : start + n] = backend.forward(base.query[start : start + n], k_cache, v_cache, meta, base.scale)
        start += n
        if start == seq_len:
            return out


def variance_attention(dtype: torch.dtype, det: bool, seq_len: int = 300) -> list[str]:
    cpu = get_backend("cpu", det)
    decoded = _attend(cpu, [1] * seq_len, dtype, seq_len)
    lines = []
    for label, backend, chunks in (
        ("one prefill", cpu, [seq_len]),
        ("chunks of 7", cpu, [7] * seq_len),
        ("chunks of 64", cpu, [64] * seq_len),
        ("SDPA one prefill", get_backend("torch"), [seq_len]),
    ):
        if det and backend is not cpu:
            continue  # deterministic mode never runs SDPA
        out = _attend(backend, chunks, dtype, seq_len)
        same = sum(torch.equal(out[t], decoded[t]) for t in range(seq_len))
        lines.append(
            f"  attention {label:17} vs decoded: same {same}/{seq_len} tokens, max|d| {_diff(out, decoded):.1e}"
        )
    return lines


def variance_sampler() -> str:
    x = torch.randn(8, 49152) * 5
    ok = {}
    for name, f in (("log_softmax", lambda t: t.log_softmax(-1)), ("logsumexp", lambda t: t.logsumexp(-1))):
        full = f(x)
        ok[name] = sum(torch.equal(f(x[i : i + 1].clone())[0], full[i]) for i in range(8))
    return (
        "  sampler " + ", ".join(f"{k} same {v}/8 rows" for k, v in ok.items()) + " (torch " + torch.__version__ + ")"
    )


def end_to_end(model, backend, dtype: torch.dtype) -> list[str]:
    kv = allocate_kv_caches(model.config, 400, 16, dtype, torch.device("cpu"))
    runner = ModelRunner(model, kv, 16, model.config.vocab_size, torch.device("cpu"), backend)
    driver = PlanDriver(runner, 16)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(100, 40000, (n,), generator=gen).tolist() for n in (9, 40, 120, 270)]
    params = [
        SamplingParams(temperature=0.0, logprobs=1),
        SamplingParams(temperature=0.8, top_k=40, top_p=0.9, seed=11, logprobs=1),
    ]

    def jobs(arrive=(0, 0, 0, 0)):
        return [Job(f"r{i}", p, 10, params[i % 2], arrive=arrive[i]) for i, p in enumerate(prompts)]

    alone = {}
    for j in jobs():
        alone.update(driver.run([j]))
    lines = []
    for label, kw in (
        ("batched, staggered", dict(jobs=jobs((0, 1, 3, 6)))),
        ("chunked prefill, budget 32", dict(jobs=jobs(), token_budget=32)),
        ("chunked prefill, budget 64", dict(jobs=jobs((0, 0, 2, 2)), token_budget=64)),
        ("preempted + recomputed", dict(jobs=jobs(), preempt={"r0": 4, "r1": 6, "r2": 3, "r3": 9})),
    ):
        out = driver.run(**kw)
        tokens = sum(out[r].tokens == alone[r].tokens for r in alone)
        bits = sum([lp.logprob for lp in out[r].logprobs] == [lp.logprob for lp in alone[r].logprobs] for r in alone)
        worst = (
            max(
                abs(a.logprob - b.logprob)
                for r in alone
                for a, b in zip(out[r].logprobs, alone[r].logprobs)
                if out[r].tokens[: len(alone[r].tokens)] == alone[r].tokens
            )
            if tokens
            else float("nan")
        )
        lines.append(
            f"  e2e {label:27} requests with the same tokens {tokens}/4, bit-identical logprobs "
            f"{bits}/4, max|d logprob| (same-token requests) {worst:.1e}"
        )
    return lines


def _timed(fns: dict, rounds: int) -> dict:
    times = {k: [] for k in fns}
    for r in range(rounds):
        for k in list(fns) if r % 2 else list(reversed(list(fns))):
            t = time.perf_counter()
            fns[k]()
            times[k].append(time.perf_counter() - t)
    return {k: 1e3 * statistics.median(v) for k, v in times.items()}


def cost_linears(model, rounds: int) -> list[str]:
    lines = []
    lin = _linears(model)
    for m in (1, 64, 300, 512, 1024, 2048):
        x = {n: torch.randn(m, w.shape[1]) for n, (w, _) in lin.items()}

        def run(det, x=x):
            return lambda: [
                linear(x[n], w, None, dataclasses.replace(p, batch_invariant=det)) for n, (w, p) in lin.items()
            ]

        ms = _timed({"default": run(False), "det": run(True)}, rounds)
        lines.append(
            f"  linears of one layer + head, M={m:5}: default {ms['default']:8.2f} ms  "
            f"deterministic {ms['det']:8.2f} ms  ratio {ms['det'] / ms['default']:.2f}x"
        )
    return lines


def cost_attention(dtype: torch.dtype, rounds: int) -> list[str]:
    lines = []
    backends = {"default": get_backend("cpu"), "det": get_backend("cpu", True)}
    for name, shapes in ATTN_CASES.items():
        b = make_batch(shapes, block_size=16, num_kv_heads=3, group=3, head_dim=64, dtype=dtype, seed=1)
        backends["default"].write_kv(b.new_key, b.new_value, b.k_cache, b.v_cache, b.meta)
        metas = {n: dataclasses.replace(b.meta, extra={}) for n in backends}
        for n, be in backends.items():
            be.prepare(metas[n])
        fns = {
            n: (lambda be=be, n=n, b=b, metas=metas: be.forward(b.query, b.k_cache, b.v_cache, metas[n], b.scale))
            for n, be in backends.items()
        }
        ms = _timed(fns, rounds)
        lines.append(
            f"  attention {name:30}: default {ms['default']:8.2f} ms  deterministic {ms['det']:8.2f} ms  "
            f"ratio {ms['det'] / ms['default']:.2f}x"
        )
    return lines


STEP_CASES = {
    "64 decodes at context 256": [(255, 1)] * 64,
    "prefill 4 x 256": [(0, 256)] * 4,
    "chunk of 512 after 512 cached": [(512, 512)],
    "32 decodes + prefill 256": [(255, 1)] * 32 + [(0, 256)],
}


def cost_steps(dtype: torch.dtype, rounds: int) -> list[str]:
    """Whole steps (ModelRunner.execute: forward, LM head, sampling), default vs deterministic models."""
    from shared.step_plan import NewRequestData, StepPlan

    runners = {}
    for det in (False, True):
        model, backend = _load(dtype, det)
        kv = allocate_kv_caches(model.config, 1200, 16, dtype, torch.device("cpu"))
        runners[det] = ModelRunner(model, kv, 16, model.config.vocab_size, torch.device("cpu"), backend)
    gen = torch.Generator().manual_seed(0)
    lines, step = [], iter(range(1, 1 << 30))
    for name, shapes in STEP_CASES.items():

        def plan(shapes=shapes):
            blocks, reqs = iter(range(1, 1200)), []
            for i, (cached, new) in enumerate(shapes):
                n = cached + new
                reqs.append(
                    NewRequestData(
                        f"s{i}",
                        torch.randint(100, 40000, (n,), generator=gen).tolist(),
                        n,
                        SamplingParams(temperature=0.0),
                        [next(blocks) for _ in range(-(-n // 16))],
                        cached,
                        new,
                    )
                )
            return StepPlan(step_id=next(step), new_requests=reqs)

        def run(det):
            def go():
                runners[det].reset()
                runners[det].execute(plan())

            return go

        ms = _timed({"default": run(False), "det": run(True)}, rounds)
        lines.append(
            f"  step {name:30}: default {ms['default']:8.1f} ms  deterministic {ms['det']:8.1f} ms  "
            f"ratio {ms['det'] / ms['default']:.2f}x"
        )
    return lines


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--skip-e2e", action="store_true")
    p.add_argument("--skip-cost", action="store_true")
    p.add_argument("--only-steps", action="store_true", help="only the whole-step costs")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    if a.only_steps:
        for name in a.dtypes.split(","):
            print(f"\n{name}: whole steps, default vs deterministic ({a.threads} threads, medians of {a.rounds})")
            with torch.inference_mode():
                for line in cost_steps(getattr(torch, name), a.rounds):
                    print(line, flush=True)
        return
    print(variance_sampler(), flush=True)
    for name in a.dtypes.split(","):
        dtype = getattr(torch, name)
        for det in (False, True):
            print(f"\n{name}, {'--deterministic' if det else 'default mode'}", flush=True)
            with torch.inference_mode():
                model, backend = _load(dtype, det)
                for line in variance_linears(model, det):
                    print(line, flush=True)
                print(variance_rms_norm(model), flush=True)
                for line in variance_attention(dtype, det):
                    print(line, flush=True)
                if not a.skip_e2e:
                    for line in end_to_end(model, backend, dtype):
                        print(line, flush=True)
        if not a.skip_cost:
            print(f"\n{name}: cost, default vs deterministic ({a.threads} threads, medians of {a.rounds})", flush=True)
            with torch.inference_mode():
                for line in cost_linears(model, a.rounds) + cost_attention(dtype, a.rounds):
                    print(line, flush=True)
                del model, backend
                for line in cost_steps(dtype, a.rounds):
                    print(line, flush=True)


if __name__ == "__main__":
    main()
