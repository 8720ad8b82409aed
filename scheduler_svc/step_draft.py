"""The step plan being drawn up in one Scheduler.schedule() call.

A request counts as computed as soon as it is added (the plan carries its
count from before), so the next schedule() sees the step as done. A running
request preempted later in the same call is taken back out with undo(), which
reverses exactly what add_running() did: the plan never carries a request the
executor is told to forget, and the budget and the request's computed count
are as if it had never been added.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from scheduler_svc.request import Request
from shared.step_plan import CachedRequestData, NewRequestData


@dataclass
class StepDraft:
    budget: int  # tokens left this step
    cached: CachedRequestData = field(default_factory=CachedRequestData)  # running requests
    new_requests: list[NewRequestData] = field(default_factory=list)  # admitted this step
    scheduled: list[Request] = field(default_factory=list)  # both of the above

    def add_running(self, request: Request, num_tokens: int, new_block_ids: list[int]) -> None:
        cached = self.cached
        cached.request_ids.append(request.request_id)
        cached.new_block_ids.append(new_block_ids)
        cached.num_computed_tokens.append(request.num_computed_tokens)
        cached.num_scheduled_tokens.append(num_tokens)
        request.num_computed_tokens += num_tokens
        self.budget -= num_tokens
        self.scheduled.append(request)

    def add_admitted(self, request: Request, num_tokens: int) -> None:
        self.new_requests.append(
            NewRequestData(
                request_id=request.request_id,
                token_ids=list(request.all_token_ids),
                num_prompt_tokens=request.num_prompt_tokens,
                sampling=request.sampling,
                block_ids=list(request.block_ids),
                num_computed_tokens=request.num_computed_tokens,
                num_scheduled_tokens=num_tokens,
            )
        )
        request.num_computed_tokens += num_tokens
        self.budget -= num_tokens
        self.scheduled.append(request)

    def undo(self, request: Request) -> bool:
        """Takes a running request back out (it is being preempted); False if it was not in."""
        cached = self.cached
        if request.request_id not in cached.request_ids:  # O(n), preemptions only
            return False
        i = cached.request_ids.index(request.request_id)
        num_tokens = cached.num_scheduled_tokens[i]
        del cached.request_ids[i], cached.new_block_ids[i], cached.num_computed_tokens[i]
        del cached.num_scheduled_tokens[i]
        request.num_computed_tokens -= num_tokens
        self.budget += num_tokens
        self.scheduled.remove(request)
        return True

    def count_samples(self) -> None:
        """The plan is final: a request whose tokens it computes to the end will get a sample."""
        for request in self.scheduled:
            if request.num_computed_tokens == request.num_planned_tokens:
                request.num_pending_samples += 1

    def allowed_token_masks(self) -> dict[str, bytes]:
        """Allowed-token masks of the constrained requests this plan samples (after count_samples).

        A constrained request is planned in lockstep (never with a sample
        pending), so its matcher has consumed exactly its applied outputs.
        """
        masks = {}
        for request in self.scheduled:
            if request.grammar is not None and request.num_pending_samples:
                assert request.num_pending_samples == 1 and request.grammar.num_tokens == request.num_output_tokens, (
                    f"{request.request_id!r}: constrained request planned out of lockstep"
                )
                masks[request.request_id] = request.grammar.bitmask()
        return masks
