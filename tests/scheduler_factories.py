"""Factories for scheduler tests (vLLM's create_scheduler / create_requests idea).

Requests get a deterministic arrival clock; step() runs one plan through the
FakeExecutor and applies its result.
"""

from __future__ import annotations

import itertools

from fake_executor import FakeExecutor, audit, reference_next_token

from scheduler_svc.request import Request
from scheduler_svc.scheduler import Scheduler
from scheduler_svc.scheduler_config import SchedulerConfig
from shared.sampling_params import SamplingParams
from shared.step_plan import StepPlan

VOCAB = 1000
_clock = itertools.count()


def make_scheduler(**overrides) -> Scheduler:
    config = dict(
        block_size=4,
        num_blocks=64,
        max_num_seqs=16,
        max_num_batched_tokens=64,
        max_model_len=128,
        watermark=0.0,
    )
    config.update(overrides)
    return Scheduler(SchedulerConfig(**config))


def make_request(rid: str, prompt, max_tokens: int = 8, **kwargs) -> Request:
    kwargs.setdefault("arrival_time", float(next(_clock)))  # deterministic arrival order
    sampling = kwargs.pop("sampling", SamplingParams(temperature=0.0))
    return Request(rid, list(prompt), sampling, max_tokens=max_tokens, **kwargs)


def expected_outputs(prompt, max_tokens: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(reference_next_token(tokens, VOCAB))
    return tokens[len(prompt) :]


def step(scheduler: Scheduler, executor: FakeExecutor) -> tuple[StepPlan, dict]:
    """One schedule/execute/update round; returns the plan and outputs by request id."""
    plan = scheduler.schedule()
    outputs = scheduler.update_from_result(plan, executor.execute(plan))
    audit(scheduler, executor)
    return plan, {o.request_id: o for o in outputs}


def scheduled_tokens(plan: StepPlan) -> dict[str, int]:
    out = {r.request_id: r.num_scheduled_tokens for r in plan.new_requests}
    out.update(zip(plan.cached_requests.request_ids, plan.cached_requests.num_scheduled_tokens))
    return out
