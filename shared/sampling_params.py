"""Per-request sampling settings as the executor applies them.

The scheduler validates the public request and builds one of these; it crosses
the wire once, with the request's first step plan. Defaults mean "off".
"""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_LOGPROBS = 20


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # 1 = off
    top_k: int = 0  # <= 0 = off
    min_p: float = 0.0  # 0 = off
    repetition_penalty: float = 1.0  # 1 = off; applies to prompt and output tokens
    presence_penalty: float = 0.0  # applies to output tokens only
    frequency_penalty: float = 0.0  # applies to output tokens only
    seed: int | None = None  # None = the executor's global generator
    logprobs: int | None = None  # None = none; N = sampled token's + top N
    min_tokens: int = 0
    # Masked (logit -inf) while the request has fewer than min_tokens outputs:
    # the model's EOS ids (unless ignore_eos) and the request's stop token ids.
    min_tokens_masked_ids: tuple[int, ...] = field(default_factory=tuple)
    # Added to the logits before every sample: (token id, bias) pairs, ids distinct.
    logit_bias: tuple[tuple[int, float], ...] = field(default_factory=tuple)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
