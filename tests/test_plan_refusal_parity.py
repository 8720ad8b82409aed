"""ModelRunner and the fake executor apply plans with the same request table:
each plan test_request_table.py's table refuses, both refuse with the same
PlanError (the runner as a failed step that drops the plan's requests, the
fake by raising it: there a refused plan is a scheduler bug). A finished id
neither holds is no refusal: the runner logs it, the fake's audit fails."""

from __future__ import annotations

import pytest
import structlog
import torch
from fake_executor import FakeExecutor
from test_request_table import BLOCK, NUM_BLOCKS, REFUSED, VOCAB, cached, new

from executor_svc.model_runner import ModelRunner
from executor_svc.request_table import PlanError
from shared.step_plan import StepPlan


class _StubModel:
    """Hidden size 4; every logit row prefers token 5."""

    def __call__(self, input_ids, positions, kv_caches, meta):
        return torch.zeros(input_ids.shape[0], 4)

    def compute_logits(self, hidden):
        logits = torch.zeros(hidden.shape[0], VOCAB)
        logits[:, 5] = 1.0
        return logits

    def greedy_tokens(self, hidden):
        return self.compute_logits(hidden).argmax(-1)


class _StubBackend:
    def prepare(self, meta):
        pass


def executors() -> tuple[ModelRunner, FakeExecutor]:
    """A runner on a stub model and a fake executor, each holding "a" as held_a() does."""
    kv = [(torch.zeros(NUM_BLOCKS, BLOCK, 1, 4), torch.zeros(NUM_BLOCKS, BLOCK, 1, 4))]
    runner = ModelRunner(_StubModel(), kv, BLOCK, VOCAB, torch.device("cpu"), _StubBackend())
    fake = FakeExecutor(BLOCK, NUM_BLOCKS, VOCAB)
    first = StepPlan(1, [new("a", [1, 2, 3], [1])])
    assert not runner.execute(first).error and not fake.execute(first).error
    return runner, fake


@pytest.mark.parametrize(("plan", "message"), REFUSED.values(), ids=REFUSED.keys())
def test_the_runner_and_the_fake_executor_refuse_the_same_plan_with_the_same_error(plan, message):
    runner, fake = executors()
    with pytest.raises(PlanError) as refused:
        fake.execute(plan)
    result = runner.execute(plan)
    assert str(refused.value) == message
    assert result.error == f"PlanError: {message}" and not result.sampled
    scheduled = [r.request_id for r in plan.new_requests] + plan.cached_requests.request_ids
    assert result.failed_request_ids == scheduled and not set(scheduled) & set(runner.requests)


def test_a_finished_id_not_held_is_logged_by_the_runner_and_fails_the_fakes_audit():
    runner, fake = executors()
    plan = StepPlan(2, cached_requests=cached(("a", [], 3, 1)), finished_request_ids=["ghost"])
    with structlog.testing.capture_logs() as logs:
        result = runner.execute(plan)
    assert not result.error and list(result.sampled) == ["a"]
    assert [(e["log_level"], e["request_ids"]) for e in logs if e["event"] == "finished_ids_unknown"] == [
        ("warning", ["ghost"])
    ]
    with pytest.raises(AssertionError, match=r"told to forget requests it does not hold: \['ghost'\]"):
        fake.execute(plan)
