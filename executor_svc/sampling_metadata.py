"""Sampling metadata: a step's per-request SamplingParams turned into the batch tensors the sampler reads.

Built once per step on the host and moved to the logits' device; optional
tensors stay None when no row needs them, so the sampler skips that work.
Bad parameters and out-of-vocabulary token ids raise ValueError here.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch

from executor_svc.seeded_noise import MASK32
from shared.sampling_params import MAX_LOGPROBS, SamplingParams

# Temperatures below this sample greedily (as vLLM): dividing by them could
# overflow the logits to inf, and the draw would be an argmax anyway.
_GREEDY_BELOW_TEMPERATURE = 1e-5


@dataclass
class SamplingMetadata:
    """Per-step sampling inputs; rows are in batch order, tensors on the logits' device.

    Fields marked "random rows" are indexed by position in `random_rows`, not by
    batch row. Optional tensors are None when no row needs them, so the common
    cases skip that work entirely.
    """

    num_rows: int
    vocab_size: int
    all_greedy: bool
    all_random: bool
    random_rows: torch.Tensor  # [R] int64 batch rows that sample (temperature >= 1e-5)
    temperature: torch.Tensor  # [R] float32 (random rows)
    top_k: torch.Tensor | None  # [R] int64 in [1, V], V = off (random rows)
    max_top_k: int  # largest top_k < V among random rows; 0 when top_k is None
    every_random_row_truncated: bool  # each random row has top_k < V or top_p < 1 (False with none)
    top_p: torch.Tensor | None  # [R] float32 in (0, 1], 1 = off (random rows)
    min_p: torch.Tensor | None  # [R] float32 in [0, 1], 0 = off (random rows)
    # Seeded random rows: indices into random_rows, and the hash inputs.
    seeded: torch.Tensor | None  # [S] int64
    seed_lo: torch.Tensor | None  # [S] int64, low 32 bits of the seed
    seed_hi: torch.Tensor | None  # [S] int64, high 32 bits (seeds are taken modulo 2**64)
    seed_positions: torch.Tensor | None  # [S] int64 = len(output tokens) of the row
    # Penalties, sparse: one entry per distinct (row, token) the penalties touch,
    # i.e. prompt tokens of rows with a repetition penalty and output tokens of
    # rows with any penalty. Entries carry their row's factors.
    penalty_index: torch.Tensor | None  # [N] int64 flat index row * V + token
    penalty_counts: torch.Tensor | None  # [N] float32 occurrences in the row's output
    repetition_penalty: torch.Tensor | None  # [N] float32
    presence_penalty: torch.Tensor | None  # [N] float32
    frequency_penalty: torch.Tensor | None  # [N] float32
    min_tokens_index: torch.Tensor | None  # [M] int64 flat row * V + token, set to -inf
    num_logprobs: list[int | None]  # per batch row, as requested
    logprob_rows: torch.Tensor | None  # [L] int64 batch rows asking for logprobs
    max_num_logprobs: int  # max N over logprob_rows; 0 when none ask

    @property
    def needs_only_argmax(self) -> bool:
        return (
            self.all_greedy
            and self.penalty_index is None
            and self.min_tokens_index is None
            and self.logprob_rows is None
        )


def _validate(p: SamplingParams, vocab_size: int) -> None:
    if p.temperature < 0 or not math.isfinite(p.temperature):
        raise ValueError(f"temperature must be finite and >= 0, got {p.temperature}")
    if not 0.0 < p.top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {p.top_p}")
    if not 0.0 <= p.min_p <= 1.0:
        raise ValueError(f"min_p must be in [0, 1], got {p.min_p}")
    if p.repetition_penalty <= 0:
        raise ValueError(f"repetition_penalty must be > 0, got {p.repetition_penalty}")
    if p.logprobs is not None and not 0 <= p.logprobs <= min(MAX_LOGPROBS, vocab_size):
        raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {p.logprobs}")
    if any(not 0 <= t < vocab_size for t in p.min_tokens_masked_ids):
        raise ValueError(f"min_tokens_masked_ids outside [0, {vocab_size}): {p.min_tokens_masked_ids}")


def _flat_token_index(token_lists: list[list[int]], rows: list[int], vocab_size: int) -> torch.Tensor:
    """CPU int64 [sum of lengths]: row * V + token for every token of the given rows."""
    tokens = torch.tensor(list(itertools.chain.from_iterable(token_lists[r] for r in rows)), dtype=torch.int64)
    if tokens.numel() and not (0 <= int(tokens.min()) and int(tokens.max()) < vocab_size):
        raise ValueError(f"token ids outside [0, {vocab_size}) in a penalised prompt or output")
    lengths = torch.tensor([len(token_lists[r]) for r in rows], dtype=torch.int64)
    return torch.repeat_interleave(torch.tensor(rows, dtype=torch.int64), lengths) * vocab_size + tokens


def _penalty_entries(
    params: list[SamplingParams], prompt_token_ids: list[list[int]], output_token_ids: list[list[int]], vocab_size: int
):
    """(index, counts, repetition, presence, frequency) on CPU, or None when no row is penalised."""
    pen_rows = [
        i
        for i, p in enumerate(params)
        if p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
    ]
    if not pen_rows:
        return None
    rep_rows = [i for i in pen_rows if params[i].repetition_penalty != 1.0]
    flat_prompt = _flat_token_index(prompt_token_ids, rep_rows, vocab_size)
    flat_output = _flat_token_index(output_token_ids, pen_rows, vocab_size)
    # sort + unique_consecutive: torch.unique is ~100x slower on CPU at this size.
    flat, order = torch.sort(torch.cat([flat_prompt, flat_output]))
    index, inverse = torch.unique_consecutive(flat, return_inverse=True)
    counts = torch.zeros(index.numel(), dtype=torch.float32)
    counts.index_add_(0, inverse, (order >= flat_prompt.numel()).float())  # output occurrences
    rows = index // vocab_size

    def per_entry(name):
        return torch.tensor([getattr(p, name) for p in params], dtype=torch.float32)[rows]

    return (
        index,
        counts,
        per_entry("repetition_penalty"),
        per_entry("presence_penalty"),
        per_entry("frequency_penalty"),
    )


def build_sampling_metadata(
    params: list[SamplingParams],
    prompt_token_ids: list[list[int]],
    output_token_ids: list[list[int]],
    vocab_size: int,
    device,
) -> SamplingMetadata:
    """One row per request sampling this step, in batch order.

    The output position used by seeded rows is len(output_token_ids[i]): the
    index of the token being sampled within the request's outputs. Prompt and
    output tokens are read only for rows with penalties.
    """
    num_rows = len(params)
    if not num_rows == len(prompt_token_ids) == len(output_token_ids):
        raise ValueError(
            f"{num_rows} params, {len(prompt_token_ids)} prompts, "
            f"{len(output_token_ids)} outputs: need one of each per row"
        )
    for p in params:
        _validate(p, vocab_size)
    num_outputs = [len(o) for o in output_token_ids]

    def tensor(values, dtype):
        return torch.tensor(values, dtype=dtype, device=device)

    rand = [i for i, p in enumerate(params) if p.temperature >= _GREEDY_BELOW_TEMPERATURE]
    rp = [params[i] for i in rand]
    top_k = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in rp]
    used_k = [k for k in top_k if k < vocab_size]
    seeded = [j for j, p in enumerate(rp) if p.seed is not None]
    seeds = [rp[j].seed % (1 << 64) for j in seeded]
    penalties = _penalty_entries(params, prompt_token_ids, output_token_ids, vocab_size)
    index, counts, rep, pres, freq = (t.to(device) for t in penalties) if penalties else (None,) * 5
    masked = [
        i * vocab_size + t
        for i, p in enumerate(params)
        if num_outputs[i] < p.min_tokens
        for t in p.min_tokens_masked_ids
    ]
    lp_rows = [i for i, p in enumerate(params) if p.logprobs is not None]

    return SamplingMetadata(
        num_rows=num_rows,
        vocab_size=vocab_size,
        all_greedy=not rand,
        all_random=len(rand) == num_rows,
        random_rows=tensor(rand, torch.int64),
        temperature=tensor([p.temperature for p in rp], torch.float32),
        top_k=tensor(top_k, torch.int64) if used_k else None,
        max_top_k=max(used_k, default=0),
        every_random_row_truncated=bool(rp) and all(k < vocab_size or p.top_p < 1.0 for k, p in zip(top_k, rp)),
        top_p=tensor([p.top_p for p in rp], torch.float32) if any(p.top_p < 1.0 for p in rp) else None,
        min_p=tensor([p.min_p for p in rp], torch.float32) if any(p.min_p > 0.0 for p in rp) else None,
        seeded=tensor(seeded, torch.int64) if seeded else None,
        seed_lo=tensor([s & MASK32 for s in seeds], torch.int64) if seeded else None,
        seed_hi=tensor([s >> 32 for s in seeds], torch.int64) if seeded else None,
        seed_positions=tensor([num_outputs[rand[j]] for j in seeded], torch.int64) if seeded else None,
        penalty_index=index,
        penalty_counts=counts,
        repetition_penalty=rep,
        presence_penalty=pres,
        frequency_penalty=freq,
        min_tokens_index=tensor(masked, torch.int64) if masked else None,
        num_logprobs=[p.logprobs for p in params],
        logprob_rows=tensor(lp_rows, torch.int64) if lp_rows else None,
        max_num_logprobs=max((params[i].logprobs for i in lp_rows), default=0),
    )
