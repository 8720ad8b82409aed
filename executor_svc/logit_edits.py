"""Per-request edits of the logits before sampling: logit bias and structured-output masks.

Applied to a step's [B, V] logits before the sampler sees them, so every
sampling transform (penalties, temperature, top-k/p, min-p, greedy argmax)
and the returned logprobs work on the edited distribution, as in vLLM where
the grammar bitmask is applied to the logits before its sampler.

    logits ──► + logit_bias (rows with a bias) ──► -inf where the row's
               allowed-token bitmask has a 0 bit (constrained rows) ──► sampler

Nothing is built or copied when no row has a bias or a mask: unconstrained
batches pay one emptiness check.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from shared.sampling_params import SamplingParams
from shared.token_mask import mask_width_bytes


@dataclass
class LogitEdits:
    bias_index: torch.Tensor | None  # [K] int64 flat row * V + token
    bias_values: torch.Tensor | None  # [K] float32
    mask_rows: torch.Tensor | None  # [M] int64 batch rows with a mask
    allowed: torch.Tensor | None  # [M, V] bool, True = may be sampled


def build_logit_edits(
    params: list[SamplingParams], masks: list[bytes | None], vocab_size: int, device
) -> LogitEdits | None:
    """Edits for one step's sampling rows (batch order); None when there are none.

    masks[i] is row i's packed bitmask (shared/token_mask.py) or None.
    """
    if any(not 0 <= t < vocab_size for p in params for t, _ in p.logit_bias):
        raise ValueError(f"logit_bias token ids outside [0, {vocab_size})")
    bias = [(i * vocab_size + t, b) for i, p in enumerate(params) for t, b in p.logit_bias]
    mask_rows = [i for i, m in enumerate(masks) if m is not None]
    if not bias and not mask_rows:
        return None
    edits = LogitEdits(None, None, None, None)
    if bias:
        edits.bias_index = torch.tensor([k for k, _ in bias], dtype=torch.int64, device=device)
        edits.bias_values = torch.tensor([b for _, b in bias], dtype=torch.float32, device=device)
    if mask_rows:
        width = mask_width_bytes(vocab_size)
        if any(len(masks[i]) != width for i in mask_rows):
            raise ValueError(f"allowed-token masks must be {width} bytes for a {vocab_size}-token vocabulary")
        packed = np.frombuffer(b"".join(masks[i] for i in mask_rows), dtype=np.uint8).reshape(len(mask_rows), width)
        allowed = np.unpackbits(packed, axis=1, bitorder="little")[:, :vocab_size].astype(bool)
        edits.mask_rows = torch.tensor(mask_rows, dtype=torch.int64, device=device)
        edits.allowed = torch.from_numpy(allowed).to(device)
    return edits


def apply_logit_edits(logits: torch.Tensor, edits: LogitEdits) -> torch.Tensor:
    """A new [B, V] tensor: the logits plus bias, masked; `logits` itself is left intact."""
    logits = logits.clone(memory_format=torch.contiguous_format)
    if edits.bias_index is not None:
        logits.view(-1).index_add_(0, edits.bias_index, edits.bias_values.to(logits.dtype))
    if edits.mask_rows is not None:
        rows = logits[edits.mask_rows]
        rows.masked_fill_(~edits.allowed, -math.inf)
        logits[edits.mask_rows] = rows
    return logits
