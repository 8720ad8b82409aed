"""KV memory on CUDA: what the card has left once the largest step has run.

vLLM's recipe (its GPU worker's determine_available_memory): before any KV
cache exists, run the largest step the scheduler may send on dummy requests,
the forward pass, then logits and the sampler for one row per request, and
measure what it took:

    KV budget = total x --gpu-memory-utilization - baseline - peak activations - non-torch

    baseline          torch's allocations before the step: weights, rope tables,
                      buffers an attention backend keeps between steps
    peak activations  torch's allocation peak during the step above the baseline,
                      less the step's own temporary KV blocks
    non-torch         (total - free) - torch.cuda.memory_reserved(): the CUDA
                      context, NCCL's buffers, loaded kernels, other processes

Non-torch memory is measured after the step because the step creates much of
it (NCCL sets up its buffers at the first all-reduce). Other processes count
too: the fraction caps the card's use, not only this process's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import time
from typing import TYPE_CHECKING

import structlog
import torch

from executor_svc.kv_cache import GIB, allocate_kv_caches
from executor_svc.model_runner import ModelRunner
from shared.sampling_params import MAX_LOGPROBS, SamplingParams

if TYPE_CHECKING:
    from executor_svc.model import LlamaForCausalLM
    from executor_svc.tensor_parallel import TPGroup

log = structlog.get_logger(__name__)


def kv_budget_bytes(
    total_bytes: int, utilization: float, baseline_bytes: int, peak_activation_bytes: int, non_torch_bytes: int
) -> int:
    """What the utilisation cap leaves for KV; <= 0 when nothing is left."""
    return int(total_bytes * utilization) - baseline_bytes - peak_activation_bytes - non_torch_bytes


def dummy_prompt_lengths(max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int) -> list[int]:
    """Prompt lengths of the profiling step: the scheduler's token budget over as many requests as it allows.

    The first request is as long as one may be (the largest attention); the
    others share the remaining tokens evenly. Each request samples one row,
    so the sampler sees its widest batch.
    """
    tokens = max(1, min(max_num_batched_tokens, max_num_seqs * max_model_len))
    num_seqs = max(1, min(max_num_seqs, tokens))
    first = min(max_model_len, tokens - (num_seqs - 1))
    if num_seqs == 1:
        return [first]
    base, extra = divmod(tokens - first, num_seqs - 1)
    return [first] + [base + 1] * extra + [base] * (num_seqs - 1 - extra)


def dummy_sampling_params(num_rows: int, vocab_size: int) -> list[SamplingParams]:
    """Every sampler path at once, as the peak is what they hold together: all
    truncations, penalties and logprobs, seeded rows beside unseeded ones, and
    one greedy row, so the random rows are gathered into their own copy."""
    widest = SamplingParams(
        temperature=0.5,
        top_p=0.9,
        top_k=vocab_size - 1,
        min_p=0.05,
        repetition_penalty=1.1,
        logprobs=min(MAX_LOGPROBS, vocab_size),
    )
    params = [dataclasses.replace(widest, seed=i if i % 2 else None) for i in range(num_rows)]
    if num_rows > 1:
        params[-1] = dataclasses.replace(widest, temperature=0.0)
    return params


def profile_run(
    model: LlamaForCausalLM,
    block_size: int,
    kv_dtype: torch.dtype,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    max_model_len: int,
    tp: TPGroup | None = None,
) -> int:
    """Runs the largest step (ModelRunner.profile_run) on dummy requests over a
    temporary KV cache; returns that cache's bytes. A rank cannot tell how far
    the others got, so any failure here ends the tensor-parallel job, as in a step."""
    cfg, device = model.config, model.embed_tokens.device
    lengths = dummy_prompt_lengths(max_num_batched_tokens, max_num_seqs, max_model_len)
    num_blocks = 1 + sum(-(-n // block_size) for n in lengths)
    with tp.fatal_on_error("the memory-profiling step") if tp else contextlib.nullcontext():
        kv_caches = allocate_kv_caches(cfg, num_blocks, block_size, kv_dtype, device, model.tp_size)
        runner = ModelRunner(model, kv_caches, block_size, cfg.vocab_size, device, model.attn_backend, tp)
        runner.profile_run(lengths, dummy_sampling_params(len(lengths), cfg.vocab_size))
    return sum(k.nbytes + v.nbytes for k, v in kv_caches)


def cuda_kv_budget(
    model: LlamaForCausalLM,
    block_size: int,
    kv_dtype: torch.dtype,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    max_model_len: int,
    utilization: float,
    tp: TPGroup | None = None,
) -> int:
    """This rank's KV budget on CUDA, measured around `profile_run`; <= 0 when nothing is left."""
    device = model.embed_tokens.device
    torch.cuda.synchronize(device)
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    baseline = torch.cuda.memory_allocated(device)
    start = time.perf_counter()
    try:
        dummy_kv = profile_run(model, block_size, kv_dtype, max_num_batched_tokens, max_num_seqs, max_model_len, tp)
    except torch.OutOfMemoryError as e:
        raise ValueError(
            f"a step of {max_num_batched_tokens} tokens over {max_num_seqs} requests does not fit in GPU memory "
            "beside the weights: lower the scheduler's --max-num-batched-tokens or --max-num-seqs"
        ) from e
    peak = torch.cuda.max_memory_allocated(device)
    # Hand the step's cached blocks back to the card, for the KV cache to take.
    gc.collect()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    non_torch = (total - free) - torch.cuda.memory_reserved(device)
    peak_activation = max(0, peak - baseline - dummy_kv)
    budget = kv_budget_bytes(total, utilization, baseline, peak_activation, non_torch)
    log.info(
        "memory_profile",
        rank=tp.rank if tp else 0,
        seconds=round(time.perf_counter() - start, 2),
        total_gib=round(total / GIB, 3),
        utilization=utilization,
        baseline_gib=round(baseline / GIB, 3),
        peak_activation_gib=round(peak_activation / GIB, 3),
        non_torch_gib=round(non_torch / GIB, 3),
        kv_budget_gib=round(budget / GIB, 3),
    )
    return budget
