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
E_v = -log(u_v) where u_v is a counter-based hash of (seed, output position, v)
(seeded_noise.py), so the draw depends on nothing else: not on batch order or
size, not on the previous draws, and a request recomputed after preemption
redraws the same tokens. Unseeded rows draw E from torch's global generator.

Batch invariance (--deterministic, docs/determinism.md): every step is per
row, and the only sums over a row are log_softmax, logsumexp and cumsum
(`RowOps`, row_ops.py); max, topk/sort values, argmax (first index among ties)
and the threshold comparisons are exact whatever order they run in. torch's
row sums are per row on CPU; on CUDA they are not, so --deterministic there
passes `RowOps.triton()` (row_ops.py says why and what it changes).

Per-step inputs (`SamplingMetadata`, `build_sampling_metadata`) are built in
sampling_metadata.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from executor_svc import fused_ops
from executor_svc.row_ops import RowOps
from executor_svc.sampling_metadata import SamplingMetadata, build_sampling_metadata
from executor_svc.seeded_noise import seeded_uniform, vocab_keys
from shared.step_plan import TokenLogprobs

__all__ = ["RowOps", "Sampler", "SamplerOutput", "SamplingMetadata", "argmax", "build_sampling_metadata"]

# Top-p looks for the nucleus among each row's this many most likely tokens and
# sorts the whole row only when they hold less than top_p of the mass.
_TOP_P_CANDIDATES = 4096


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [B] int64
    logprobs: list[TokenLogprobs | None]  # per row; None where not asked


def apply_min_tokens_and_penalties(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """The batch's logits [B, V] after min_tokens masking and penalties.

    Returns `logits` itself when neither applies, else a contiguous copy: only
    the touched (row, token) entries are gathered, changed and written back.
    min_tokens gives way in a row where it would leave no token at all (its
    stop ids cover everything the output constraint allows): that row is
    sampled among the tokens it masked, rather than from nothing. A penalty
    that overflows (a repetition penalty near 0) saturates at float32's
    largest value, not +inf, whose arithmetic would give NaN further on.
    """
    if md.min_tokens_index is None and md.penalty_index is None:
        return logits
    original = logits
    logits = logits.clone(memory_format=torch.contiguous_format)
    flat = logits.view(-1)
    if md.min_tokens_index is not None:
        flat.index_fill_(0, md.min_tokens_index, -math.inf)
        nothing_left = logits.amax(dim=-1, keepdim=True) == -math.inf
        logits = torch.where(nothing_left, original, logits)
        flat = logits.view(-1)
    if md.penalty_index is not None:
        values, r, counts = flat[md.penalty_index], md.repetition_penalty, md.penalty_counts
        values = torch.where(values > 0, values / r, values * r)
        values = values - md.frequency_penalty * counts - md.presence_penalty * (counts > 0).float()
        flat[md.penalty_index] = values.clamp(max=torch.finfo(values.dtype).max)
    return logits


def _nucleus_threshold(sorted_desc: torch.Tensor, lse: torch.Tensor, top_p: torch.Tensor, ops: RowOps):
    """Smallest logit of each row's nucleus, given its leading sorted logits.

    Rank i (0 = most likely) belongs to the nucleus iff the mass of ranks < i is
    below p: the minimal set whose mass reaches p; rank 0 always belongs.
    Returns (threshold [R, 1], mass of the given ranks [R]).
    """
    probs = (sorted_desc - lse).exp()
    cumulative = ops.cumsum(probs)
    # At least rank 0, also where the mass is NaN (a row with no finite logit).
    n_keep = ((cumulative - probs) < top_p[:, None]).sum(dim=-1, keepdim=True).clamp_(min=1)
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
        # A saturated penalty over a temperature below 1 overflows: saturate again.
        logits = (logits / md.temperature[:, None]).clamp_(max=torch.finfo(logits.dtype).max)
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
