"""Batched sampling: one pass over a step's logits turns them into one token per row.

Transforms, in order (vLLM's order):

    raw logits ──► logprobs (log_softmax of the RAW logits, before anything below)
        │
        ├─ min_tokens: listed ids -> -inf while len(outputs) < min_tokens
        ├─ penalties: repetition (prompt + output tokens), then frequency and
        │  presence (output tokens only)
        ├─ greedy rows: argmax ──────────────────────────────────────────► token
        └─ random rows: / temperature, top-k, top-p, min-p, then sample ─► token

Returned logprobs are the model's raw distribution (vLLM's "raw_logprobs"):
they ignore penalties, temperature and truncation, so a sampled token that
truncation made certain still reports the model's own logprob.

Sampling is the exponential race: token = argmax_v p_v / E_v with E_v ~ Exp(1)
i.i.d., which picks v with probability p_v. In log space it needs no softmax:
argmax_v (logit_v / T - log E_v), masked tokens being -inf. For a seeded row
E_v = -log(u_v) where u_v is a counter-based hash of (seed, output position, v),
so the draw depends on nothing else: not on batch order or size, not on the
previous draws, and a request recomputed after preemption redraws the same
tokens. Unseeded rows draw E from torch's global generator.

Batch invariance (--deterministic, docs/determinism.md): every step is per
row, and the only sums over a row are log_softmax, logsumexp and cumsum
(`RowOps`); max, topk/sort values, argmax (first index among ties) and the
threshold comparisons are exact whatever order they run in. torch's row sums
are per row on CPU; on CUDA they are not (logsumexp's reduction and a single
row's cumsum split differently by the row count), so --deterministic there
passes `RowOps.triton()`, whose kernels sum each row in one fixed order, and
reports the top logprobs by a stable sort (equal logprobs by token id)
instead of topk, whose order among ties depends on its algorithm.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from executor_svc import fused_ops
from shared.sampling_params import MAX_LOGPROBS, SamplingParams
from shared.step_plan import TokenLogprobs

_MASK32 = 0xFFFFFFFF
# lowbias32 (Chris Wellons' hash-prospector), a bijection on 32-bit integers.
# The integers live in int64 lanes; a multiplier >= 2**31 is replaced by the
# same value minus 2**32 (equal modulo 2**32), so every product of a 32-bit lane
# and a multiplier has magnitude < 2**63 and never overflows int64.
_MUL1 = 0x7FEB352D
_MUL2 = 0x846CA68B - (1 << 32)
# Distinct odd salts keep the row keys and the token keys unrelated.
_SALT_KEY1, _SALT_KEY2, _SALT_VOCAB = 0x9E3779B9, 0x85EBCA6B, 0xC2B2AE35
# Top-p looks for the nucleus among each row's this many most likely tokens and
# sorts the whole row only when they hold less than top_p of the mass.
_TOP_P_CANDIDATES = 4096
# Temperatures below this sample greedily (as vLLM): dividing by them could
# overflow the logits to inf, and the draw would be an argmax anyway.
_GREEDY_BELOW_TEMPERATURE = 1e-5


def _top_by_topk(x: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    top = x.topk(n, dim=-1)
    return top.values, top.indices


def _top_by_stable_sort(x: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The n largest per row, equal values in token-id order: one answer, whatever the algorithm."""
    values, indices = x.sort(dim=-1, descending=True, stable=True)
    return values[:, :n], indices[:, :n]


@dataclass(frozen=True)
class RowOps:
    """The sampler's reductions over each row of a float32 [rows, V] tensor."""

    log_softmax: Callable[[torch.Tensor], torch.Tensor] = lambda x: x.log_softmax(dim=-1)
    logsumexp: Callable[[torch.Tensor], torch.Tensor] = lambda x: x.logsumexp(dim=-1, keepdim=True)  # [rows, 1]
    cumsum: Callable[[torch.Tensor], torch.Tensor] = lambda x: x.cumsum(dim=-1)
    top: Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]] = _top_by_topk  # (values, ids) [rows, n]

    @staticmethod
    def triton() -> RowOps:
        """Batch-invariant on CUDA (triton_invariant/rows.py); imports triton."""
        from executor_svc.triton_invariant import rows

        return RowOps(rows.log_softmax, rows.logsumexp, rows.cumsum, _top_by_stable_sort)


def _mix32_(x: torch.Tensor) -> torch.Tensor:
    """lowbias32, in place, on an int64 tensor the caller owns holding values in [0, 2**32)."""
    x ^= x >> 16
    x.mul_(_MUL1).bitwise_and_(_MASK32)
    x ^= x >> 15
    x.mul_(_MUL2).bitwise_and_(_MASK32)
    x ^= x >> 16
    return x


def seeded_uniform(
    seed_lo: torch.Tensor, seed_hi: torch.Tensor, positions: torch.Tensor, vocab_keys: torch.Tensor
) -> torch.Tensor:
    """Uniform noise in (0, 1), [S, V] float32, a pure function of (seed, position, v).

    seed_lo/seed_hi/positions: [S] int64 in [0, 2**32); vocab_keys: [V] from
    `vocab_keys(V)`. A 32-bit row key folds all three inputs through four hash
    rounds (two (seed, position) pairs share a key with probability 2**-32);
    one round per element then mixes it with the token's key.
    """
    key = _mix32_(_mix32_(_mix32_(positions ^ _SALT_KEY1) ^ seed_lo) ^ seed_hi)
    key = _mix32_(key ^ _SALT_KEY2)
    x = _mix32_(key[:, None] ^ vocab_keys[None, :])
    # 23 bits + 0.5 is exact in float32 and strictly inside (0, 1): u = 1 would
    # give E = 0 and an infinite score for a masked token.
    x >>= 9
    return (x.to(torch.float32) + 0.5) * (1.0 / (1 << 23))


def vocab_keys(vocab_size: int, device) -> torch.Tensor:
    """[V] int64: a hashed (hence distinct: _mix32_ is a bijection) key per token id."""
    return _mix32_(_mix32_(torch.arange(vocab_size, dtype=torch.int64, device=device) ^ _SALT_VOCAB))


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
    top_p: torch.Tensor | None  # [R] float32 in (0, 1], 1 = off (random rows)
    min_p: torch.Tensor | None  # [R] float32 in [0, 1], 0 = off (random rows)
    # Seeded random rows: indices into random_rows, and the hash inputs.
    seeded: torch.Tensor | None  # [S] int64
    seed_lo: torch.Tensor | None  # [S] int64, low 32 bits of the seed
    seed_hi: torch.Tensor | None  # [S] int64, high 32 bits (seeds are taken modulo 2**64)
    seed_positions: torch.Tensor | None  # [S] int64 = len(output tokens) of the row
    all_seeded: bool
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


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [B] int64
    logprobs: list[TokenLogprobs | None]  # per row; None where not asked


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
        top_p=tensor([p.top_p for p in rp], torch.float32) if any(p.top_p < 1.0 for p in rp) else None,
        min_p=tensor([p.min_p for p in rp], torch.float32) if any(p.min_p > 0.0 for p in rp) else None,
        seeded=tensor(seeded, torch.int64) if seeded else None,
        seed_lo=tensor([s & _MASK32 for s in seeds], torch.int64) if seeded else None,
        seed_hi=tensor([s >> 32 for s in seeds], torch.int64) if seeded else None,
        seed_positions=tensor([num_outputs[rand[j]] for j in seeded], torch.int64) if seeded else None,
        all_seeded=len(seeded) == len(rand),
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


def apply_min_tokens_and_penalties(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """The batch's logits [B, V] after min_tokens masking and penalties.

    Returns `logits` itself when neither applies, else a contiguous copy: only
    the touched (row, token) entries are gathered, changed and written back.
    """
    if md.min_tokens_index is None and md.penalty_index is None:
        return logits
    logits = logits.clone(memory_format=torch.contiguous_format)
    flat = logits.view(-1)
    if md.min_tokens_index is not None:
        flat.index_fill_(0, md.min_tokens_index, -math.inf)
    if md.penalty_index is not None:
        values, r, counts = flat[md.penalty_index], md.repetition_penalty, md.penalty_counts
        values = torch.where(values > 0, values / r, values * r)
        values = values - md.frequency_penalty * counts - md.presence_penalty * (counts > 0).float()
        flat[md.penalty_index] = values
    return logits


def _nucleus_threshold(sorted_desc: torch.Tensor, lse: torch.Tensor, top_p: torch.Tensor, ops: RowOps):
    """Smallest logit of each row's nucleus, given its leading sorted logits.

    Rank i (0 = most likely) belongs to the nucleus iff the mass of ranks < i is
    below p: the minimal set whose mass reaches p; rank 0 always belongs.
    Returns (threshold [R, 1], mass of the given ranks [R]).
    """
    probs = (sorted_desc - lse).exp()
    cumulative = ops.cumsum(probs)
    n_keep = ((cumulative - probs) < top_p[:, None]).sum(dim=-1, keepdim=True)
    return sorted_desc.gather(1, n_keep - 1), cumulative[:, -1]


def _top_p_threshold(logits: torch.Tensor, top_p: torch.Tensor, ops: RowOps) -> torch.Tensor:
    """[R, 1] nucleus threshold per row (-inf where top_p = 1), of the already top-k'd logits.

    Usually the nucleus lies within the row's _TOP_P_CANDIDATES best tokens and
    a partial topk suffices; rows where it does not are sorted in full. Which
    path a row takes depends only on that row, so its result does too.
    """
    vocab_size = logits.shape[1]
    lse = ops.logsumexp(logits)
    candidates = logits.topk(min(vocab_size, _TOP_P_CANDIDATES), dim=-1).values
    threshold, mass = _nucleus_threshold(candidates, lse, top_p, ops)
    if candidates.shape[1] < vocab_size:
        short = ((mass < top_p) & (top_p < 1.0)).nonzero().squeeze(1)  # host sync
        if short.numel():
            full = logits[short].sort(dim=-1, descending=True).values
            threshold[short] = _nucleus_threshold(full, lse[short], top_p[short], ops)[0]
    # top_p = 1 keeps everything even where rounding pushes the cumsum past 1.
    return threshold.masked_fill((top_p >= 1.0)[:, None], -math.inf)


def argmax(x: torch.Tensor) -> torch.Tensor:
    """Each row's first largest index (or first NaN's), as torch.argmax: native
    on float32 CPU (torch's argmax over a row of logits is ~9x slower than its
    max), torch elsewhere."""
    if x.dim() == 2 and x.dtype == torch.float32 and fused_ops.available(x):
        tokens = fused_ops.argmax_rows(x)
        if tokens is not None:
            return tokens
    return x.argmax(dim=-1)


class Sampler:
    """Stateless apart from a cache of the vocabulary hash keys per (V, device).
    `ops`: the row reductions (torch's by default; RowOps.triton() for
    --deterministic on CUDA)."""

    def __init__(self, ops: RowOps | None = None) -> None:
        self._vocab_keys: dict[tuple[int, str], torch.Tensor] = {}
        self.ops = ops or RowOps()

    def __call__(self, logits: torch.Tensor, md: SamplingMetadata) -> SamplerOutput:
        if logits.shape != (md.num_rows, md.vocab_size):
            raise ValueError(
                f"logits shape {tuple(logits.shape)} does not match the metadata's ({md.num_rows}, {md.vocab_size})"
            )
        if md.needs_only_argmax:
            return SamplerOutput(argmax(logits), [None] * md.num_rows)
        logits = logits.float()  # never modified in place: the caller's tensor stays intact
        logprobs = None if md.logprob_rows is None else self.ops.log_softmax(logits[md.logprob_rows])
        logits = apply_min_tokens_and_penalties(logits, md)
        if md.all_greedy:
            tokens = argmax(logits)
        elif md.all_random:
            tokens = self._sample_random(logits, md)
        else:
            tokens = argmax(logits)
            tokens[md.random_rows] = self._sample_random(logits[md.random_rows], md)
        return SamplerOutput(tokens, self._logprobs_result(logprobs, tokens, md, self.ops))

    def _sample_random(self, logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        """logits: [R, V], the random rows only. Truncations mask tokens to -inf."""
        logits = logits / md.temperature[:, None]
        if md.top_k is not None:
            # Threshold at each row's k-th largest value; ties at the threshold stay in.
            kth = logits.topk(md.max_top_k, dim=-1).values
            threshold = kth.gather(1, (md.top_k.clamp(max=md.max_top_k) - 1)[:, None])
            threshold.masked_fill_((md.top_k >= md.vocab_size)[:, None], -math.inf)
            logits = logits.masked_fill(logits < threshold, -math.inf)
        # top-p and min-p as one mask: min-p compares each probability with the
        # row's largest, and neither that ratio nor the largest changes under top-p.
        threshold = None
        if md.top_p is not None:
            threshold = _top_p_threshold(logits, md.top_p, self.ops)
        if md.min_p is not None:
            # p_v >= min_p * p_max  <=>  logit_v >= logit_max + log(min_p); min_p = 0 keeps all.
            min_p_threshold = logits.max(dim=-1, keepdim=True).values + md.min_p.log()[:, None]
            threshold = min_p_threshold if threshold is None else torch.maximum(threshold, min_p_threshold)
        if threshold is not None:
            logits = logits.masked_fill(logits < threshold, -math.inf)
        # Exponential race in log space: argmax_v logit_v - log E_v.
        return argmax(logits - self._log_exponential(logits, md))

    def _log_exponential(self, logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        """log E, E ~ Exp(1) i.i.d., [R, V]: the global generator, or the hash for seeded rows.

        E = -log(u) with u uniform: on CPU, torch.rand plus two logs is about
        twice as fast as exponential_(). u = 0 gives E = inf: a score of -inf,
        which only removes that token from the race.
        """
        if md.seeded is None:
            return torch.rand_like(logits).log_().neg_().log_()
        key = (md.vocab_size, str(logits.device))
        if key not in self._vocab_keys:
            self._vocab_keys[key] = vocab_keys(md.vocab_size, logits.device)
        seeded = seeded_uniform(md.seed_lo, md.seed_hi, md.seed_positions, self._vocab_keys[key])
        seeded = seeded.log_().neg_().log_()
        if md.all_seeded:
            return seeded
        noise = torch.rand_like(logits).log_().neg_().log_()
        noise[md.seeded] = seeded
        return noise

    @staticmethod
    def _logprobs_result(
        logprobs: torch.Tensor | None, tokens: torch.Tensor, md: SamplingMetadata, ops: RowOps
    ) -> list[TokenLogprobs | None]:
        """Python results from the raw log_softmax [L, V] of the rows asking."""
        result: list[TokenLogprobs | None] = [None] * md.num_rows
        if logprobs is None:
            return result
        sampled = logprobs.gather(1, tokens[md.logprob_rows][:, None]).squeeze(1).tolist()
        top_values = top_ids = None
        if md.max_num_logprobs > 0:
            values, ids = ops.top(logprobs, md.max_num_logprobs)
            top_values, top_ids = values.tolist(), ids.tolist()
        for j, row in enumerate(md.logprob_rows.tolist()):
            n = md.num_logprobs[row]
            pairs = list(zip(top_ids[j][:n], top_values[j][:n])) if n else []
            result[row] = TokenLogprobs(logprob=sampled[j], top=pairs)
        return result
