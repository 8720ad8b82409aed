"""The request scheduler: decides, step by step, which tokens of which requests get computed.

One model of work, no prefill/decode phases: every live request has
num_tokens (prompt + outputs) and num_computed_tokens (KV written); a step
gives scheduled requests tokens to catch up, within a token budget
(max_num_batched_tokens) and a request cap (max_num_seqs).

    prefill chunk:  [ p p p p p p p p p p ]      computed 0, scheduled 6 (budget)
    next step:      [ p p p p p p p p p p ]      computed 6, scheduled 4 -> samples o0
    decode:         [ p p p p p p p p p p o0 ]   computed 10, scheduled 1 -> samples o1

Each schedule(): running requests first, in admission order (preempting the
lowest-priority, latest-arrived running request when a block is missing),
then, if nobody was preempted, waiting requests by (priority, arrival).
schedule() advances num_computed_tokens of the scheduled requests as if the
step ran, and counts the samples the step will produce as pending;
update_from_result() appends the sampled tokens and finishes requests. One
result per plan, in plan order. With overlap scheduling the engine plans step
N+1 while step N runs: a decode then computes the token step N samples
(pending here, the executor's own sample there), and a request that finishes
in step N wastes its slot in step N+1, whose output is dropped.

Structured output: a constrained request's next allowed-token mask depends on
the token in flight, so it is planned in lockstep: never while it has a
sample pending (it sits out the overlapped plan, and only it does). A plan
carries the mask of every constrained request it samples, computed from the
request's matcher, which has consumed exactly its applied output tokens.

The executor holds state for exactly the RUNNING requests (sent whole in
new_requests when admitted, as deltas in cached_requests after). A running
request that stops running (finished, aborted, preempted) is listed in the
finished_request_ids of the next plan that schedules anything (for a
preemption, the plan that preempts it), except after a failed step, whose
requests the executor has already dropped.
"""

from __future__ import annotations

from dataclasses import dataclass

from scheduler_svc.kv_cache_manager import KVCacheManager
from scheduler_svc.request import Request, RequestOutput, RequestStatus
from scheduler_svc.scheduler_config import SchedulerConfig
from scheduler_svc.step_draft import StepDraft
from scheduler_svc.waiting_queue import WaitingQueue
from shared.step_plan import StepPlan, StepResult

_RUNNING = RequestStatus.RUNNING


class RequestTooLong(ValueError):
    """A request's prompt and max_tokens do not fit the model's context."""


@dataclass
class SchedulerStats:
    num_running: int
    num_waiting: int
    kv_blocks_total: int
    kv_blocks_used: int
    kv_blocks_cached_free: int
    prefix_cache_queries_tokens: int
    prefix_cache_hits_tokens: int
    num_preemptions: int
    num_steps: int


class Scheduler:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.kv_cache_manager = _kv_cache_manager(config)
        self.requests: dict[str, Request] = {}  # every live (unfinished) request
        self.running: list[Request] = []  # admission order
        self.waiting = WaitingQueue()
        self._finished_ids: list[str] = []  # for the next non-empty plan
        # step id -> (block id, hash) whose KV that step writes; dropped if the step fails
        self._cached_in_step: dict[int, list[tuple[int, bytes]]] = {}
        # step id -> the requests it scheduled, for plans whose results are not applied yet. Results
        # are matched to these objects, not to ids: a client may reuse an id its aborted request left.
        self._planned: dict[int, dict[str, Request]] = {}
        self._step_id = 0
        self._last_result_step_id = 0  # the newest plan whose result was applied
        self._reset_step_id = 0  # results of plans up to this id predate an executor loss
        self.num_preemptions = 0
        self.num_steps = 0

    # -- requests ----------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already live")
        if request.status != RequestStatus.WAITING or request.output_token_ids or request.block_ids:
            raise ValueError(f"request {request.request_id!r} is not fresh (status {request.status.name})")
        self.check_fits(request)
        self.requests[request.request_id] = request
        self.waiting.push(request)

    def check_fits(self, request: Request) -> None:
        """Raises RequestTooLong where the request's prompt and max_tokens exceed
        the context, which shrinks when an executor comes back with less KV
        memory: a request validated against the old one may no longer fit."""
        if request.num_prompt_tokens + request.max_tokens > self.config.max_model_len:
            raise RequestTooLong(
                f"request {request.request_id!r}: prompt ({request.num_prompt_tokens}) + max_tokens "
                f"({request.max_tokens}) exceeds max_model_len ({self.config.max_model_len})"
            )

    def abort_request(self, request_id: str, status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> bool:
        """Finishes a live request now (blocks freed at once); False if it is not live."""
        if not status.is_finished:
            raise ValueError(f"abort status must be a finished one, got {status.name}")
        request = self.requests.pop(request_id, None)
        if request is None:
            return False
        if request.status == _RUNNING:
            self.running.remove(request)
            self.kv_cache_manager.free(request)
            self._finished_ids.append(request_id)
        else:
            self.waiting.remove(request)
        request.status = status
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_request(self, request_id: str) -> Request | None:
        return self.requests.get(request_id)

    def live_requests(self) -> list[Request]:
        """Running requests in admission order, then waiting ones in admission order."""
        return self.running + list(self.waiting)

    def stats(self) -> SchedulerStats:
        kv = self.kv_cache_manager
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_blocks_total=kv.num_total_blocks,
            kv_blocks_used=kv.num_used_blocks,
            kv_blocks_cached_free=kv.num_cached_free_blocks,
            prefix_cache_queries_tokens=kv.prefix_cache_queries,
            prefix_cache_hits_tokens=kv.prefix_cache_hits,
            num_preemptions=self.num_preemptions,
            num_steps=self.num_steps,
        )

    # -- planning ----------------------------------------------------------

    def schedule(self) -> StepPlan:
        """Plans the next step; scheduled requests count as computed from here on."""
        self._step_id += 1
        draft = StepDraft(budget=self.config.max_num_batched_tokens)
        if not self._schedule_running(draft):
            self._schedule_waiting(draft)  # not after a preemption: memory is short
        draft.count_samples()
        plan = StepPlan(
            step_id=self._step_id,
            new_requests=draft.new_requests,
            cached_requests=draft.cached,
            last_result_step_id=self._last_result_step_id,
            allowed_token_masks=draft.allowed_token_masks(),
        )
        # A plan that schedules nothing need not be sent; the ids and cache entries wait for the next one.
        if plan.num_requests:
            plan.finished_request_ids, self._finished_ids = self._finished_ids, []
            self._planned[plan.step_id] = {r.request_id: r for r in draft.scheduled}
            newly_cached = self.kv_cache_manager.pop_newly_cached()
            if newly_cached:
                self._cached_in_step[plan.step_id] = newly_cached
        return plan

    def _schedule_running(self, draft: StepDraft) -> bool:
        """Gives running requests their tokens, in order, preempting when blocks run out.

        Returns whether anyone was preempted.
        """
        kv = self.kv_cache_manager
        threshold = self.config.long_prefill_token_threshold
        running = self.running
        preempted = False
        i = 0
        while i < len(running) and draft.budget > 0:
            request = running[i]
            num_new = request.num_planned_tokens - request.num_computed_tokens
            if request.num_output_tokens + request.num_pending_samples >= request.max_tokens:
                i += 1  # its last sample is in flight: the request ends with it
                continue
            if request.grammar is not None and request.num_pending_samples:
                i += 1  # lockstep: its next mask needs the token in flight
                continue
            assert num_new > 0, f"running request {request.request_id!r} has nothing to compute"
            if threshold and num_new > threshold:
                num_new = threshold
            if num_new > draft.budget:
                num_new = draft.budget
            while (ids := kv.allocate_slots(request, num_new, is_admission=False)) is None:
                victim = max(reversed(running), key=_victim_key)  # reversed: ties go to the latest admitted
                victim_index = running.index(victim)
                del running[victim_index]
                if draft.undo(victim):
                    # Blocks it would have filled were cached as if the step ran.
                    kv.uncache_blocks_from(victim, victim.num_computed_tokens)
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
                if victim_index < i:
                    i -= 1
            if ids is None:
                continue  # the request preempted itself; running[i] is now the next one
            draft.add_running(request, num_new, ids)
            i += 1
        return preempted

    def _schedule_waiting(self, draft: StepDraft) -> None:
        """Admits waiting requests by (priority, arrival) while budget, seats and memory last."""
        cfg = self.config
        kv = self.kv_cache_manager
        threshold = cfg.long_prefill_token_threshold
        while self.waiting and draft.budget > 0 and len(self.running) < cfg.max_num_seqs:
            request = self.waiting.peek()
            # Preempted while its sample was in flight: that result is applied
            # before the next plan is made, and no plan admits after preempting.
            assert not request.num_pending_samples, f"admitting {request.request_id!r} before its pending sample"
            hit_blocks, num_hit = kv.get_computed_blocks(request)
            num_new = request.num_tokens - num_hit
            if cfg.enable_chunked_prefill:
                if threshold and num_new > threshold:
                    num_new = threshold
                if num_new > draft.budget:
                    num_new = draft.budget
            elif num_new > draft.budget:
                break  # without chunking a prompt runs whole or waits (and so does everyone behind it)
            if kv.allocate_slots(request, num_new, hit_blocks, num_hit, is_admission=True) is None:
                break
            self.waiting.pop()
            request.status = _RUNNING
            request.num_computed_tokens = num_hit
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit
            self.running.append(request)
            draft.add_admitted(request, num_new)

    def _preempt(self, request: Request) -> None:
        """Evicts a running request; it is recomputed later from prompt + outputs."""
        self._requeue(request, RequestStatus.PREEMPTED)
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._finished_ids.append(request.request_id)

    def _requeue(self, request: Request, status: RequestStatus) -> None:
        """Back to the front of the waiting queue, holding nothing; full blocks stay cached."""
        self.kv_cache_manager.free(request)
        request.num_computed_tokens = 0
        request.status = status
        self.waiting.push_front(request)

    # -- results -----------------------------------------------------------

    def update_from_result(self, plan: StepPlan, result: StepResult) -> list[RequestOutput]:
        """Applies the executor's answer to `plan`: one output per sampled token or failed request.

        Finished requests release their blocks now and are listed in the next
        plan's finished_request_ids.
        """
        if result.step_id != plan.step_id:
            raise ValueError(f"result of step {result.step_id} given for plan {plan.step_id}")
        newly_cached = self._cached_in_step.pop(plan.step_id, None)
        planned = self._planned.pop(plan.step_id, {})
        if plan.step_id <= self._reset_step_id:
            return []  # planned for an executor that is gone; its requests were requeued
        self._last_result_step_id = plan.step_id
        self.num_steps += 1
        if result.error:
            return self._fail_step(plan, result, planned, newly_cached)

        kv = self.kv_cache_manager
        requests = self.requests
        all_logprobs = result.logprobs
        outputs = []
        any_finished = False
        for request_id, token_id in result.sampled.items():
            request = planned.get(request_id)
            # Skip requests aborted since the plan (and samples where none was due).
            if request is None or requests.get(request_id) is not request or not request.num_pending_samples:
                continue
            request.num_pending_samples -= 1
            was_running = request.status == _RUNNING  # else preempted while this sample was in flight
            finished = request.append_output_token(token_id)
            logprobs = all_logprobs.get(request_id) if all_logprobs else None
            outputs.append(
                RequestOutput(
                    request_id,
                    [token_id],
                    [logprobs] if logprobs is not None else [],
                    finished,
                    request.status,
                    request.stop_token_id,
                    request.num_cached_tokens,
                    error=request.error,
                )
            )
            if not finished:
                if was_running and (entries := kv.cache_block_completed_by_last_token(request)):
                    # File them under the step in flight that writes the block's last slot.
                    writer = next(step_id for step_id, reqs in self._planned.items() if reqs.get(request_id) is request)
                    self._cached_in_step.setdefault(writer, []).extend(entries)
                continue
            del requests[request_id]
            if was_running:
                any_finished = True
                kv.free(request)
                self._finished_ids.append(request_id)
            else:  # the executor forgot it at its preemption
                self.waiting.remove(request)
        if any_finished:
            self.running = [r for r in self.running if r.status == _RUNNING]
        return outputs

    def _fail_step(
        self,
        plan: StepPlan,
        result: StepResult,
        planned: dict[str, Request],
        newly_cached: list[tuple[int, bytes]] | None,
    ) -> list[RequestOutput]:
        """The step failed (or was refused as stale) and the executor dropped every request in it.

        Requests in failed_request_ids finish aborted with the error; the rest
        of the plan's requests go back to the front of the queue and are
        recomputed. Prefixes this step was to write were never written: uncache
        them. Samples its requests had pending will never come: any plan in
        flight behind this one is refused as stale.
        """
        kv = self.kv_cache_manager
        if newly_cached:
            kv.uncache(newly_cached)
        in_plan = [r.request_id for r in plan.new_requests] + plan.cached_requests.request_ids

        def live(request_id: str) -> Request | None:
            """The live request this step's id stands for; None if it ended (its id may be reused)."""
            request = self.requests.get(request_id)
            return request if request_id not in planned or planned[request_id] is request else None

        for request_id in in_plan:
            if (request := live(request_id)) is not None:
                request.num_pending_samples = 0
        failed = set(result.failed_request_ids)
        # Requests aborted while the step ran are gone from the executor already.
        in_plan_set = set(in_plan)
        self._finished_ids = [rid for rid in self._finished_ids if rid not in in_plan_set]
        outputs = []
        requeue = []
        for request_id in dict.fromkeys(in_plan + result.failed_request_ids):
            request = live(request_id)
            if request is None or request.status != _RUNNING:
                continue
            if request_id not in failed:
                requeue.append(request)
                continue
            kv.free(request)
            request.num_computed_tokens = 0
            request.status = RequestStatus.FINISHED_ABORTED
            del self.requests[request_id]
            if request_id not in in_plan_set:  # not in the step, so the executor still has it
                self._finished_ids.append(request_id)
            outputs.append(
                RequestOutput(
                    request_id=request_id,
                    new_token_ids=[],
                    new_logprobs=[],
                    finished=True,
                    status=request.status,
                    stop_token_id=None,
                    num_cached_tokens=request.num_cached_tokens,
                    error=result.error,
                )
            )
        for request in reversed(requeue):  # reversed: the first ends up in front
            self._requeue(request, RequestStatus.WAITING)
        self.running = [r for r in self.running if r.status == _RUNNING]
        return outputs

    def resize(self, config: SchedulerConfig) -> list[Request]:
        """After an executor loss, the executor came back with a different KV
        capacity: plan for its blocks from now on. A waiting request whose
        prompt + max_tokens no longer fits `config.max_model_len` gets the room
        that is left (it will finish with LENGTH); one whose tokens so far leave
        no room at all is aborted and returned."""
        assert not self.running, f"resize with {len(self.running)} requests running: call reset_for_executor_loss first"
        old = self.kv_cache_manager
        self.config = config
        self.kv_cache_manager = _kv_cache_manager(config)
        # Counters exported as monotonic metrics carry over.
        self.kv_cache_manager.prefix_cache_queries = old.prefix_cache_queries
        self.kv_cache_manager.prefix_cache_hits = old.prefix_cache_hits
        no_room = [r for r in self.waiting if r.num_tokens >= config.max_model_len]
        for request in no_room:
            self.abort_request(request.request_id)
        for request in self.waiting:
            request.cap_max_tokens(config.max_model_len - request.num_prompt_tokens)
        return no_room

    def reset_for_executor_loss(self) -> None:
        """The executor lost all KV and request state: recompute every running request.

        They go back to the front of the waiting queue in their running order
        (each within its priority); the next plans resend them whole (prompt +
        outputs). Results of plans made before this call are ignored.
        """
        for request in reversed(self.running):
            self._requeue(request, RequestStatus.WAITING)
        self.running = []
        for request in self.requests.values():
            request.num_pending_samples = 0  # the plans that would have sampled them are void
        self.kv_cache_manager.reset_prefix_cache()
        self._finished_ids.clear()
        self._cached_in_step.clear()
        self._planned.clear()
        self._reset_step_id = self._step_id


def _kv_cache_manager(config: SchedulerConfig) -> KVCacheManager:
    return KVCacheManager(
        config.block_size,
        config.num_blocks,
        enable_caching=config.enable_prefix_caching,
        watermark_blocks=config.watermark_blocks(config.num_blocks),
        hash_algo=config.hash_algo,
    )


def _victim_key(request: Request) -> tuple[int, float]:
    """Preemption victim = max key: lowest priority (largest value), then latest arrival."""
    return (request.priority, request.arrival_time)
