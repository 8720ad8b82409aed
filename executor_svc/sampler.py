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
redraws the same tokens. Unseeded rows draw E from torch's global generator
(on CPU: a row key from it, hashed per token as seeded rows are, in one
native pass, fused_ops.race_rows).

Only the tokens that survive truncation can win, so on CPU a batch whose
random rows all truncate (top-k or top-p) races each row's leading tokens
(top_p.FIRST_CANDIDATES, or its top_k if more) and draws noise for those
alone; a row whose survivors reach beyond them races its whole row. A token's
noise is the same in either race, so a seeded row's token does not depend on
which one it ran in (docs/optimization_log.md has what these two measured).

Batch invariance (--deterministic, docs/determinism.md): every step is per
row, and the only sums over a row are log_softmax, logsumexp and cumsum
(`RowOps`, row_ops.py); max, topk/sort values, argmax (first index among ties)
and the threshold comparisons are exact whatever order they run in. On CPU
the row sums are per row (logsumexp, the leading top-k and the temperature
in native passes, one thread a row; the rest torch's); on CUDA they are
not, so --deterministic there passes `RowOps.triton()` (row_ops.py says why
and what it changes).

Per-step inputs (`SamplingMetadata`, `build_sampling_metadata`) are built in
sampling_metadata.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from executor_svc import fused_ops, top_p
from executor_svc.row_ops import RowOps
from executor_svc.sampling_metadata import SamplingMetadata, build_sampling_metadata
from executor_svc.seeded_noise import seeded_uniform, vocab_keys
from shared.step_plan import TokenLogprobs

__all__ = ["RowOps", "Sampler", "SamplerOutput", "SamplingMetadata", "argmax", "build_sampling_metadata"]


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
        tempered = fused_ops.temper_rows(logits, md.temperature) if logits.device.type == "cpu" else None
        logits = (
            tempered
            if tempered is not None
            else (logits / md.temperature[:, None]).clamp_(max=torch.finfo(logits.dtype).max)
        )
        best = None  # each row's leading tokens, sorted: (values, ids)
        if md.every_random_row_truncated and logits.device.type == "cpu":
            width = min(md.vocab_size, max(top_p.FIRST_CANDIDATES, md.max_top_k))
            best = self.ops.leading(logits, width)
        top_k_threshold = None
        if md.top_k is not None:
            # Threshold at each row's k-th largest value; ties at the threshold stay in.
            kth = best[0] if best is not None else self.ops.leading(logits, md.max_top_k)[0]
            top_k_threshold = kth.gather(1, (md.top_k.clamp(max=md.max_top_k) - 1)[:, None])
            top_k_threshold.masked_fill_((md.top_k >= md.vocab_size)[:, None], -math.inf)
        # top-p and min-p as one mask: min-p compares each probability with the
        # row's largest, and neither that ratio nor the largest changes under top-p.
        threshold = None
        if md.top_p is not None:
            leading = None
            if best is not None:
                leading = best[0]
                if top_k_threshold is not None:
                    leading = leading.masked_fill(leading < top_k_threshold, -math.inf)
            threshold = top_p.threshold(logits, md.top_p, self.ops, top_k_threshold, leading)
        if md.min_p is not None:
            # p_v >= min_p * p_max  <=>  logit_v >= logit_max + log(min_p); min_p = 0 keeps all.
            row_max = best[0][:, :1] if best is not None else logits.max(dim=-1, keepdim=True).values
            min_p_threshold = row_max + md.min_p.log()[:, None]
            threshold = min_p_threshold if threshold is None else torch.maximum(threshold, min_p_threshold)
        if top_k_threshold is not None:
            threshold = top_k_threshold if threshold is None else torch.maximum(threshold, top_k_threshold)
        if best is not None:
            return self._race(logits, *best, threshold, md)
        if threshold is not None:
            logits = logits.masked_fill(logits < threshold, -math.inf)
        return self._race_whole_rows(logits, md)

    def _race_whole_rows(self, logits: torch.Tensor, md: SamplingMetadata, rows=None) -> torch.Tensor:
        """The exponential race over every token of each row: argmax_v logit_v - log E_v.
        `rows` [R] picks which random rows these are (default: all).

        Unseeded rows race natively on CPU (fused_ops.race_rows: hashed
        uniforms under a row key drawn from torch's global generator, one pass
        over the row); seeded rows always race on torch's logs of their hashed
        uniforms, as _race_leading does, so that a seeded row draws the same
        token whichever race it runs in.
        """
        seeded = self._seeded_rows(md, rows)
        if (
            logits.device.type != "cpu"
            or not fused_ops.available(logits)
            or (seeded is not None and seeded.numel() == logits.shape[0])
        ):
            return argmax(logits - self._log_exponential(logits, md, rows=rows))
        keys = torch.randint(0, 1 << 32, (logits.shape[0],), dtype=torch.int64)
        tokens = fused_ops.race_rows(logits, keys)  # seeded rows among them are raced again below
        if tokens is None:
            return argmax(logits - self._log_exponential(logits, md, rows=rows))
        if seeded is not None and seeded.numel():
            chosen = seeded if rows is None else rows[seeded]
            tokens[seeded] = argmax(logits[seeded] - self._log_exponential(logits[seeded], md, rows=chosen))
        return tokens

    @staticmethod
    def _seeded_rows(md: SamplingMetadata, rows) -> torch.Tensor | None:
        """Which of `rows` (random rows; all when None) are seeded, as positions in it."""
        if md.seeded is None or rows is None:
            return md.seeded
        seeded = torch.zeros(md.random_rows.numel(), dtype=torch.bool, device=md.seeded.device)
        seeded[md.seeded] = True
        return seeded[rows].nonzero().squeeze(1)

    def _race(
        self,
        logits: torch.Tensor,
        values: torch.Tensor,
        ids: torch.Tensor,
        threshold: torch.Tensor,
        md: SamplingMetadata,
    ) -> torch.Tensor:
        """The exponential race of each row's tokens at or above `threshold` [R, 1],
        over its leading tokens (`values` [R, W] sorted descending, their `ids`) where
        they hold every such token, else (a row with a longer nucleus, or a NaN)
        over the whole row. Each token's noise is the one the whole-row race would
        draw for it (seeded rows: the same hash of its id), and ties go to the
        smallest id as argmax's do, so a seeded row's token does not depend on the
        race it ran in."""
        fits = ~values[:, 0].isnan()
        if values.shape[1] < md.vocab_size:
            # Tokens beyond the leading W are <= values[:, -1]: all out iff the threshold is above it.
            fits &= (threshold > values[:, -1:]).squeeze(1)
        if bool(fits.all()):  # host sync
            return self._race_leading(values, ids, threshold, md, None)
        tokens = torch.empty(values.shape[0], dtype=torch.int64, device=values.device)
        inside, beyond = fits.nonzero().squeeze(1), (~fits).nonzero().squeeze(1)
        if inside.numel():
            tokens[inside] = self._race_leading(values[inside], ids[inside], threshold[inside], md, inside)
        # `logits` is this call's own tempered copy: every row's may be masked in place.
        rest, floor = (logits, threshold) if not inside.numel() else (logits[beyond], threshold[beyond])
        tokens[beyond] = self._race_whole_rows(rest.masked_fill_(rest < floor, -math.inf), md, beyond)
        return tokens

    def _race_leading(self, values, ids, threshold, md: SamplingMetadata, rows: torch.Tensor | None) -> torch.Tensor:
        """The race among each row's leading tokens at or above its threshold; ties to the smallest id."""
        running = values >= threshold
        scores = values.masked_fill(~running, -math.inf) - self._log_exponential(values, md, ids, rows)
        top = scores.max(dim=-1, keepdim=True).values
        return torch.where(running & (scores == top), ids, md.vocab_size).amin(dim=-1)

    def _log_exponential(
        self, logits: torch.Tensor, md: SamplingMetadata, ids: torch.Tensor | None = None, rows=None
    ) -> torch.Tensor:
        """log E, E ~ Exp(1) i.i.d., shaped as `logits` [R, V]: the global generator,
        or the hash for seeded rows. `rows` [R] picks which random rows these are
        (default: all); with `ids` [R, W], the noise of those tokens only.

        E = -log(u) with u uniform: on CPU, torch.rand plus two logs is about
        twice as fast as exponential_(). u = 0 gives E = inf: a score of -inf,
        which only removes that token from the race.
        """
        if md.seeded is None:
            return torch.rand_like(logits).log_().neg_().log_()
        seeded, seed_lo, seed_hi, positions = md.seeded, md.seed_lo, md.seed_hi, md.seed_positions
        if rows is not None:
            slot = torch.full((md.random_rows.numel(),), -1, dtype=torch.int64, device=logits.device)
            slot[md.seeded] = torch.arange(md.seeded.numel(), device=logits.device)
            slot = slot[rows]
            seeded = (slot >= 0).nonzero().squeeze(1)
            slot = slot[seeded]
            seed_lo, seed_hi, positions = seed_lo[slot], seed_hi[slot], positions[slot]
        key = (md.vocab_size, str(logits.device))
        if key not in self._vocab_keys:
            self._vocab_keys[key] = vocab_keys(md.vocab_size, logits.device)
        keys = self._vocab_keys[key] if ids is None else self._vocab_keys[key][ids[seeded]]
        noise = seeded_uniform(seed_lo, seed_hi, positions, keys).log_().neg_().log_()
        if seeded.numel() == logits.shape[0]:
            return noise
        everyone = torch.rand_like(logits).log_().neg_().log_()
        everyone[seeded] = noise
        return everyone

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
