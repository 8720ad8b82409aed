"""A minimal in-process scheduler that drives a ModelRunner with step plans.

It does what the real scheduler does to a request's numerics, and nothing
else: admission in arrival order under a token budget per step (so a long
prompt is prefilled in chunks of at most `token_budget` tokens, beside
other requests' decodes), block allocation, a prefix-cache hit (a request
that starts on another's computed blocks) and preemption by recompute (the
request is dropped from the runner and later re-sent as new with its
outputs so far as part of its tokens, its blocks fresh). Blocks are never
freed, so a prefix stays valid; the tests size the cache for that.

    driver = PlanDriver(runner, block_size=16)
    out = driver.run([Job("a", prompt, 8, params), Job("b", ..., arrive=3)],
                     token_budget=16, preempt={"a": 4})
    out["a"].tokens, out["a"].logprobs
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from shared.sampling_params import SamplingParams
from shared.step_plan import CachedRequestData, NewRequestData, StepPlan, TokenLogprobs


@dataclass
class Job:
    request_id: str
    prompt: list[int]
    max_tokens: int
    sampling: SamplingParams
    arrive: int = 0  # the step at which it joins the queue
    prefix_of: tuple[str, int] | None = None  # (request id, full blocks) to start on, a prefix-cache hit


@dataclass
class Output:
    tokens: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)


@dataclass
class _Live:
    job: Job
    tokens: list[int]
    blocks: list[int] = field(default_factory=list)
    computed: int = 0
    known: bool = False  # whether the runner holds its state
    new_blocks: list[int] = field(default_factory=list)


class PlanDriver:
    def __init__(self, runner, block_size: int):
        self.runner = runner
        self.block_size = block_size
        self._next_block = itertools.count(1)  # block 0 is the null block
        self._steps = itertools.count(1)
        self._kept: dict[str, _Live] = {}  # every admitted request, for prefix_of

    def run(
        self,
        jobs: list[Job],
        token_budget: int = 1 << 30,
        preempt: dict[str, int] | None = None,
        max_steps: int = 10_000,
    ) -> dict[str, Output]:
        """Runs every job to max_tokens; `preempt` maps a request id to the
        number of its sampled tokens after which it is preempted once."""
        preempt = dict(preempt or {})
        # Forget the previous run's requests but keep the KV: a later prefix_of job reads
        # blocks an earlier run computed, as a scheduler's prefix cache does within one
        # session (runner.reset() zeroes the KV, as on a new scheduler's handshake).
        self.runner.requests.clear()
        outputs = {j.request_id: Output() for j in jobs}
        live: dict[str, _Live] = {}
        finished: list[str] = []
        for step in range(max_steps):
            for j in jobs:
                if j.arrive == step:
                    live[j.request_id] = self._admit(j, live)
            if not live and all(j.arrive <= step for j in jobs):
                return outputs
            batch, budget = [], token_budget
            for state in live.values():
                n = min(len(state.tokens) - state.computed, budget)
                if n <= 0:
                    break
                self._grow(state, state.computed + n)
                batch.append((state, n))
                budget -= n
            if not batch:
                continue
            result = self.runner.execute(self._plan(batch, finished))
            assert not result.error, result.error
            finished = []
            for state, n in batch:
                state.computed += n
                rid = state.job.request_id
                if rid not in result.sampled:
                    continue
                state.tokens.append(result.sampled[rid])
                outputs[rid].tokens.append(result.sampled[rid])
                if rid in result.logprobs:
                    outputs[rid].logprobs.append(result.logprobs[rid])
                done = len(outputs[rid].tokens)
                if done == state.job.max_tokens:
                    finished.append(rid)
                    del live[rid]
                elif preempt.get(rid) == done:
                    del preempt[rid]
                    finished.append(rid)  # the runner forgets it; it is recomputed from scratch
                    state.known, state.computed, state.blocks = False, 0, []
        raise AssertionError(f"jobs not done after {max_steps} steps")

    def _admit(self, job: Job, live: dict[str, _Live]) -> _Live:
        state = _Live(job, list(job.prompt))
        if job.prefix_of is not None:
            rid, num_blocks = job.prefix_of
            source = self._kept[rid]
            shared = num_blocks * self.block_size
            assert source.computed >= shared and source.tokens[:shared] == job.prompt[:shared], "not a valid prefix"
            state.blocks, state.computed = source.blocks[:num_blocks], shared
        self._kept[job.request_id] = state
        return state

    def _grow(self, state: _Live, end: int) -> None:
        while len(state.blocks) * self.block_size < end:
            block = next(self._next_block)
            state.blocks.append(block)
            state.new_blocks.append(block)

    def _plan(self, batch: list[tuple[_Live, int]], finished: list[str]) -> StepPlan:
        plan = StepPlan(step_id=next(self._steps), finished_request_ids=finished, cached_requests=CachedRequestData())
        for state, n in batch:
            if not state.known:
                plan.new_requests.append(
                    NewRequestData(
                        state.job.request_id,
                        list(state.tokens),
                        len(state.job.prompt),
                        state.job.sampling,
                        list(state.blocks),
                        state.computed,
                        n,
                    )
                )
                state.known = True
            else:
                c = plan.cached_requests
                c.request_ids.append(state.job.request_id)
                c.new_block_ids.append(list(state.new_blocks))
                c.num_computed_tokens.append(state.computed)
                c.num_scheduled_tokens.append(n)
            state.new_blocks = []
        return plan
