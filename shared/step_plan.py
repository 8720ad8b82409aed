"""The step protocol as plain dataclasses: what one step asks and answers.

Both services convert to and from protobuf only at their gRPC edge
(`shared/step_codec.py`); everything behind the edge sees these types.

Token arithmetic for one request in one step:

    token_ids:  [ p0 p1 p2 p3 p4 p5 | o0 o1 ]      prompt (6) + outputs so far (2)
                 \\___ computed ___/ \\sched/
                  num_computed_tokens = 6, num_scheduled_tokens = 2
    The step computes KV for tokens [num_computed, num_computed + num_scheduled).
    If that range reaches the end of the known tokens, the step samples one new
    token for the request (its logits come from the last scheduled token only).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request the executor has no state for (first time, or resumed)."""

    request_id: str
    token_ids: list[int]  # prompt + outputs generated so far
    num_prompt_tokens: int
    sampling: SamplingParams
    block_ids: list[int]  # the whole block table
    num_computed_tokens: int  # prefix-cache hits
    num_scheduled_tokens: int


@dataclass
class CachedRequestData:
    """Requests the executor already holds; entry i of each list belongs to request_ids[i]."""

    request_ids: list[str] = field(default_factory=list)
    new_block_ids: list[list[int]] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)
    num_scheduled_tokens: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.request_ids)


@dataclass
class StepPlan:
    step_id: int
    new_requests: list[NewRequestData] = field(default_factory=list)
    cached_requests: CachedRequestData = field(default_factory=CachedRequestData)
    # Forget these before running the step (finished, aborted or preempted).
    finished_request_ids: list[str] = field(default_factory=list)
    # The newest step whose result the scheduler had applied when it made this
    # plan. With overlap scheduling a plan leaves before the result of the step
    # ahead of it; if that step failed, the executor refuses this plan as stale.
    last_result_step_id: int = 0
    # Structured output: request id -> packed allowed-token bitmask for the
    # sample this step draws for it (layout in shared/token_mask.py); only
    # constrained requests that sample this step have one.
    allowed_token_masks: dict[str, bytes] = field(default_factory=dict)

    @property
    def num_requests(self) -> int:
        return len(self.new_requests) + len(self.cached_requests)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(r.num_scheduled_tokens for r in self.new_requests) + sum(self.cached_requests.num_scheduled_tokens)


@dataclass
class TokenLogprobs:
    logprob: float  # the sampled token's
    top: list[tuple[int, float]]  # (token id, logprob), most likely first


@dataclass
class StepResult:
    step_id: int
    # request id -> sampled token, for requests whose scheduled tokens reached
    # the end of their known tokens.
    sampled: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)
    execute_time_ns: int = 0
    error: str = ""  # non-empty: the step failed, nothing was sampled
    failed_request_ids: list[str] = field(default_factory=list)
