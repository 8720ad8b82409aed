"""One generation request as the scheduler sees it, and what a step reports about it.

A request's tokens only ever grow: the prompt, then one sampled token per step
once its prefill is done.

    all_token_ids:  [ p0 p1 p2 p3 p4 p5 | o0 o1 o2 ]
                     \\____ prompt ____/ \\_ outputs _/
                     \\______ computed ______/ \\__/   <- still to compute (KV not written)
    num_tokens = 9, num_prompt_tokens = 6, num_output_tokens = 3, num_computed_tokens = 8

With overlap scheduling the next step is planned before the sample of the
step in flight is known: that sample is pending, and the next step computes
its KV without the scheduler knowing its id (the executor uses its own).
Right after planning step N+1 while step N runs:

    all_token_ids:  [ p0 p1 p2 p3 p4 p5 | o0 o1 ] [ ?1 ] [ ?2 ]   <- pending: sampled by steps N, N+1
                     \\_____ computed or planned _____/
    num_tokens = 8, num_pending_samples = 2, num_computed_tokens = 9 (step N+1 computes ?1)

The scheduler mutates `num_computed_tokens`, `num_pending_samples`,
`block_ids`, `status` and `num_preemptions` (and caps `max_tokens` when the
context shrinks); the KV cache manager extends `block_hashes`; sampled tokens
enter only through `append_output_token`, which is also the one place stop
conditions are checked.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from scheduler_svc.grammar import GrammarMatcher
from shared.sampling_params import SamplingParams
from shared.step_plan import TokenLogprobs


class RequestStatus(enum.IntEnum):
    """Lifecycle, in order; same numbers as the public proto enum RequestStatus."""

    WAITING = 1
    RUNNING = 2
    PREEMPTED = 3
    FINISHED_STOPPED = 4
    FINISHED_LENGTH = 5
    FINISHED_ABORTED = 6

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


_FINISHED_STOPPED = RequestStatus.FINISHED_STOPPED


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    # Already capped by the caller so that prompt + max_tokens <= max_model_len.
    max_tokens: int
    eos_token_ids: frozenset[int] = frozenset()
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    min_tokens: int = 0
    priority: int = 0  # lower runs first
    arrival_time: float = field(default_factory=time.monotonic)
    # Structured output: this sample's matcher, advanced by append_output_token;
    # None = unconstrained. Its next mask goes with the plan of the next sample.
    grammar: GrammarMatcher | None = None

    # State below is owned by the request and mutated by the scheduler.
    output_token_ids: list[int] = field(init=False, default_factory=list)
    all_token_ids: list[int] = field(init=False)
    num_computed_tokens: int = field(init=False, default=0)  # KV written or planned by a step in flight
    # Samples that planned steps will produce and the scheduler has not received yet.
    num_pending_samples: int = field(init=False, default=0)
    # Prefix-cache hit tokens at the first admission (reported to users); -1 until then.
    num_cached_tokens: int = field(init=False, default=-1)
    block_ids: list[int] = field(init=False, default_factory=list)  # the block table
    # Hashes of the first len(block_hashes) full blocks of all_token_ids. They
    # depend only on token content, so they stay valid across preemptions.
    block_hashes: list[bytes] = field(init=False, default_factory=list)
    status: RequestStatus = field(init=False, default=RequestStatus.WAITING)
    stop_token_id: int | None = field(init=False, default=None)  # EOS or stop id that matched
    num_preemptions: int = field(init=False, default=0)
    error: str = field(init=False, default="")  # why it was aborted from inside (a token the grammar refused)

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError(f"request {self.request_id!r}: prompt must not be empty")
        if self.max_tokens < 1:
            raise ValueError(f"request {self.request_id!r}: max_tokens must be >= 1, got {self.max_tokens}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(
                f"request {self.request_id!r}: min_tokens must be in [0, max_tokens={self.max_tokens}], "
                f"got {self.min_tokens}"
            )
        self.prompt_token_ids = list(self.prompt_token_ids)
        self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_planned_tokens(self) -> int:
        """Tokens known plus those pending: how far steps may be planned."""
        return len(self.all_token_ids) + self.num_pending_samples

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status >= _FINISHED_STOPPED

    def cap_max_tokens(self, limit: int) -> None:
        """Lowers max_tokens to `limit` (the context shrank); the outputs so far must fit under it."""
        assert self.num_output_tokens < limit, (
            f"request {self.request_id!r}: {self.num_output_tokens} outputs leave no room under max_tokens {limit}"
        )
        self.max_tokens = min(self.max_tokens, limit)
        self.min_tokens = min(self.min_tokens, self.max_tokens)

    def append_output_token(self, token_id: int) -> bool:
        """Appends a sampled token; returns True (and sets the finished status) if it ends the request.

        Order as in vLLM: a stop token (EOS unless ignore_eos, or a stop token
        id) ends the request once it has at least min_tokens outputs; then a
        complete structured output (the grammar allows nothing more: STOPPED);
        then max_tokens. A stop token that is also the max_tokens-th output
        counts as a stop, so its id is reported. A token the grammar refuses
        (the executor ignored the mask) aborts the request with `error`.
        """
        assert self.status < _FINISHED_STOPPED, (
            f"request {self.request_id!r} got a token after finishing ({self.status.name})"
        )
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        num_outputs = len(self.output_token_ids)
        grammar = self.grammar
        if grammar is not None and not grammar.consume(token_id):
            self.status = RequestStatus.FINISHED_ABORTED
            self.error = f"sampled token {token_id} is not allowed by the output constraint: {grammar.error}"
            return True
        if num_outputs >= self.min_tokens and (
            token_id in self.stop_token_ids or (not self.ignore_eos and token_id in self.eos_token_ids)
        ):
            self.status = _FINISHED_STOPPED
            self.stop_token_id = token_id
            return True
        if grammar is not None and grammar.is_stopped:
            self.status = _FINISHED_STOPPED
            return True
        if num_outputs >= self.max_tokens:
            self.status = RequestStatus.FINISHED_LENGTH
            return True
        return False


@dataclass(slots=True)
class RequestOutput:
    """What one step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs]  # aligned with new_token_ids; empty when not asked for
    finished: bool
    status: RequestStatus
    stop_token_id: int | None
    num_cached_tokens: int
    error: str = ""  # set when the step failed for this request (then status is FINISHED_ABORTED)
