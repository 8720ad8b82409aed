"""--kv-cache-dtype bfloat16 under float32 weights: twice the blocks, same greedy text."""

from __future__ import annotations

import torch
from tokenizers import Tokenizer

from executor_svc.config import ExecutorConfig
from executor_svc.worker import Worker
from shared.sampling_params import SamplingParams
from shared.step_plan import CachedRequestData, NewRequestData, StepPlan


def greedy(worker: Worker, prompt: list[int], steps: int) -> list[int]:
    runner = worker.runner
    blocks = list(range(1, 1 + (len(prompt) + steps) // 16 + 1))
    out = [
        runner.execute(
            StepPlan(
                1, [NewRequestData("r", prompt, len(prompt), SamplingParams(temperature=0.0), blocks, 0, len(prompt))]
            )
        ).sampled["r"]
    ]
    for step in range(2, steps + 1):
        computed = runner.requests["r"].num_computed_tokens
        plan = StepPlan(step, cached_requests=CachedRequestData(["r"], [[]], [computed], [1]))
        out.append(runner.execute(plan).sampled["r"])
    return out


def test_bfloat16_kv_cache_doubles_capacity_and_keeps_greedy_output(english_prompts):
    workers = [
        Worker(ExecutorConfig(dtype="float32", kv_cache_dtype=kv, kv_cache_gib=0.05)) for kv in ("auto", "bfloat16")
    ]
    infos = [w.configure(16, 256, 8) for w in workers]
    assert workers[1].runner.kv_caches[0][0].dtype == torch.bfloat16
    assert infos[1].num_kv_blocks // 2 == infos[0].num_kv_blocks  # floor rounding may add one
    tok = Tokenizer.from_str(workers[0].tokenizer.tokenizer_json)
    prompt = tok.encode(english_prompts[2]).ids
    assert greedy(workers[0], prompt, 8) == greedy(workers[1], prompt, 8)
