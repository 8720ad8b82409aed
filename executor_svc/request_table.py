"""The executor's live requests, and the one place a step plan is applied to them.

A plan carries only deltas (shared/step_plan.py): a request crosses the wire
whole once, in new_requests (first time, or resumed after a preemption), then
each step names it in cached_requests with the blocks appended to its table
and how many tokens to compute. The table keeps each request's tokens, block
table and computed count between steps, so it can check every delta against
what it holds. Torch-free: ModelRunner builds its tensors from the table's
states, and tests/fake_executor.py runs the scheduler's tests on the same
table, so both accept and refuse exactly the same plans.

Applying a plan, in this order:

    1. cached_requests arrays aligned                       (else PlanError)
    2. forget finished_request_ids (finished, aborted, preempted); an id
       not held is ignored, forgetting is idempotent, and reported
    3. add new requests, 4. extend cached requests' block tables
    5. check each scheduled request and the step as a whole (else PlanError)

The scheduled tokens count as computed only once the forward pass has
written their KV (`mark_computed`), and a sampled token joins its request's
tokens only once it is drawn (`append_sampled`): the next decode step
computes the token this executor sampled in the previous one.

A refused plan may leave the table partly updated; the caller then drops
every request the plan schedules (`drop_failed_step`), as for any failed
step, and the scheduler recomputes or aborts them. After a failed step,
plans the scheduler made before it saw the failure are refused as stale
(overlap scheduling sends step N+1 while step N runs).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from shared.sampling_params import SamplingParams
from shared.step_plan import StepPlan
from shared.token_mask import mask_width_bytes


class PlanError(ValueError):
    """The plan contradicts the executor's state: a scheduler/executor desync."""


@dataclass
class RequestState:
    request_id: str
    token_ids: list[int]  # prompt + outputs, including this executor's own samples
    num_prompt_tokens: int
    sampling: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]


@dataclass
class StepBatch:
    """One step's scheduled requests, as the table has applied its plan."""

    # (state, num_scheduled) in plan order: new requests, then cached ones.
    rows: list[tuple[RequestState, int]] = field(default_factory=list)
    # Indices into rows of the requests that sample: their scheduled tokens
    # reach the end of their known tokens (a mid-prompt chunk samples nothing).
    sample_rows: list[int] = field(default_factory=list)
    # Block id -> the request whose scheduled tokens write into it this step.
    written_blocks: dict[int, str] = field(default_factory=dict)
    # Finished ids the table did not hold (the scheduler promises none).
    unknown_finished_ids: list[str] = field(default_factory=list)

    @property
    def sampling_states(self) -> list[RequestState]:
        return [self.rows[i][0] for i in self.sample_rows]


def scheduled_request_ids(plan: StepPlan) -> list[str]:
    return [r.request_id for r in plan.new_requests] + list(plan.cached_requests.request_ids)


class RequestTable:
    """Live requests by id, for a KV cache of `num_blocks` blocks of `block_size` tokens.

    Invariants between steps: every block id held is in 1..num_blocks-1
    (block 0 is the null block), no request holds a block twice, every token
    id is in the vocabulary, 0 < num_prompt_tokens <= len(token_ids) and
    0 <= num_computed_tokens.
    Each is checked where the plan adds it, so a step checks only its deltas.
    """

    def __init__(
        self, block_size: int, num_blocks: int, vocab_size: int, state_type: type[RequestState] = RequestState
    ) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.vocab_size = vocab_size
        self._state_type = state_type  # the fake executor's states carry its fingerprints too
        self.requests: dict[str, RequestState] = {}  # never rebound: callers may hold it
        self.last_failed_step_id = 0

    def clear(self) -> None:
        """Forgets every request and every failure (a new scheduler handshook)."""
        self.requests.clear()
        self.last_failed_step_id = 0

    def forget(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            self.requests.pop(rid, None)

    def refuse_if_stale(self, plan: StepPlan) -> str:
        """Why the plan is refused as stale ("" if it is current); a stale plan's requests are forgotten.

        A stale plan was sent before the scheduler saw a failed step: it may
        name requests the failure dropped, or hit prefix blocks it left
        unwritten. None of it runs; the scheduler recomputes its requests.
        """
        if plan.last_result_step_id >= self.last_failed_step_id:
            return ""
        self.forget(plan.finished_request_ids + scheduled_request_ids(plan))
        return f"stale plan: made before step {self.last_failed_step_id} failed; its requests will be recomputed"

    def drop_failed_step(self, plan: StepPlan) -> list[str]:
        """The step failed (or was refused): forgets every request it schedules; returns their ids."""
        ids = scheduled_request_ids(plan)
        self.forget(ids)
        self.last_failed_step_id = plan.step_id
        return ids

    def apply(self, plan: StepPlan) -> StepBatch:
        """Applies the plan's request deltas; PlanError if it contradicts the table or itself."""
        cached = plan.cached_requests
        lengths = {
            "request_ids": len(cached.request_ids),
            "new_block_ids": len(cached.new_block_ids),
            "num_computed_tokens": len(cached.num_computed_tokens),
            "num_scheduled_tokens": len(cached.num_scheduled_tokens),
        }
        if len(set(lengths.values())) > 1:  # zip below would silently drop the extra entries
            raise PlanError(
                "cached_requests arrays must be aligned, one entry per request; got "
                + ", ".join(f"{k}: {n}" for k, n in lengths.items())
            )
        batch = StepBatch()
        for rid in plan.finished_request_ids:
            if self.requests.pop(rid, None) is None:
                batch.unknown_finished_ids.append(rid)
        in_step: set[str] = set()
        for new in plan.new_requests:
            rid = new.request_id
            self._check_once(rid, in_step, plan.step_id)
            if rid in self.requests:
                raise PlanError(f"new request {rid!r} is already known")
            if not 0 < new.num_prompt_tokens <= len(new.token_ids):
                raise PlanError(
                    f"new request {rid!r}: num_prompt_tokens {new.num_prompt_tokens} is not in 1..{len(new.token_ids)}"
                )
            if new.num_computed_tokens < 0:
                raise PlanError(f"new request {rid!r}: num_computed_tokens {new.num_computed_tokens} is negative")
            # Checked here, not by the embedding lookup: a clear error, before any state changes on the device.
            if not 0 <= min(new.token_ids) <= max(new.token_ids) < self.vocab_size:
                bad = next(t for t in new.token_ids if not 0 <= t < self.vocab_size)
                raise PlanError(
                    f"new request {rid!r}: token id {bad} is outside the vocabulary (0..{self.vocab_size - 1})"
                )
            self._check_blocks(rid, [], new.block_ids)
            state = self._state_type(
                rid,
                list(new.token_ids),
                new.num_prompt_tokens,
                new.sampling,
                list(new.block_ids),
                new.num_computed_tokens,
            )
            self.requests[rid] = state
            batch.rows.append((state, new.num_scheduled_tokens))
        for rid, new_blocks, num_computed, num_scheduled in zip(
            cached.request_ids, cached.new_block_ids, cached.num_computed_tokens, cached.num_scheduled_tokens
        ):
            self._check_once(rid, in_step, plan.step_id)
            state = self.requests.get(rid)
            if state is None:
                raise PlanError(f"cached request {rid!r} is unknown to the executor")
            if num_computed != state.num_computed_tokens:
                raise PlanError(
                    f"request {rid!r}: plan says {num_computed} computed tokens, executor has {state.num_computed_tokens}"
                )
            self._check_blocks(rid, state.block_ids, new_blocks)
            state.block_ids.extend(new_blocks)
            batch.rows.append((state, num_scheduled))
        for i, (state, num_scheduled) in enumerate(batch.rows):
            end = self._check_scheduled(state, num_scheduled, batch.written_blocks)
            if end == len(state.token_ids):
                batch.sample_rows.append(i)
        self._check_masks(plan, batch)
        return batch

    def mark_computed(self, batch: StepBatch) -> None:
        """The step's forward pass wrote the KV of every scheduled token."""
        for state, n in batch.rows:
            state.num_computed_tokens += n

    def append_sampled(self, batch: StepBatch, tokens: list[int]) -> None:
        """The tokens drawn for batch.sample_rows, in that order, join their requests' tokens."""
        assert len(tokens) == len(batch.sample_rows), f"{len(tokens)} tokens for {len(batch.sample_rows)} samples"
        for state, token in zip(batch.sampling_states, tokens):
            state.token_ids.append(token)

    # -- checks --------------------------------------------------------------

    @staticmethod
    def _check_once(rid: str, in_step: set[str], step_id: int) -> None:
        if rid in in_step:
            raise PlanError(f"request {rid!r} is scheduled twice in step {step_id}")
        in_step.add(rid)

    def _check_blocks(self, rid: str, held: list[int], added: list[int]) -> None:
        if not added:  # most decode steps: nothing to check, and `held` is never walked
            return
        for b in added:
            if not 0 < b < self.num_blocks:
                raise PlanError(f"request {rid!r}: block id {b} is out of range 1..{self.num_blocks - 1}")
        if len(set(added)) != len(added) or not set(added).isdisjoint(held):
            raise PlanError(f"request {rid!r}: its block table would hold a block twice")

    def _check_scheduled(self, state: RequestState, num_scheduled: int, written: dict[int, str]) -> int:
        """Checks one scheduled request and claims the blocks it writes; returns its end token."""
        rid, bs, start = state.request_id, self.block_size, state.num_computed_tokens
        end = start + num_scheduled
        if num_scheduled <= 0 or end > len(state.token_ids):
            raise PlanError(
                f"request {rid!r}: scheduling {num_scheduled} tokens from {start} but only "
                f"{len(state.token_ids)} are known"
            )
        if -(-end // bs) > len(state.block_ids):
            raise PlanError(f"request {rid!r}: {len(state.block_ids)} blocks cannot hold {end} tokens")
        # Two requests writing one block in one step would overwrite each other's KV.
        for b in state.block_ids[start // bs : -(-end // bs)]:
            other = written.setdefault(b, rid)
            if other != rid:
                raise PlanError(f"block {b} is written by both {other!r} and {rid!r} in one step")
        return end

    def _check_masks(self, plan: StepPlan, batch: StepBatch) -> None:
        """A mask for a request that does not sample this step means the scheduler lost track of it."""
        masks = plan.allowed_token_masks
        if not masks:
            return
        extra = set(masks) - {s.request_id for s in batch.sampling_states}
        if extra:
            raise PlanError(f"allowed-token masks for requests that do not sample this step: {sorted(extra)}")
        width = mask_width_bytes(self.vocab_size)
        for rid, mask in masks.items():
            if len(mask) != width:
                raise PlanError(
                    f"request {rid!r}: allowed-token mask of {len(mask)} bytes; a {self.vocab_size}-token "
                    f"vocabulary takes {width}"
                )
