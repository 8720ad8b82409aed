"""Scheduler under aborts, failed steps and executor loss, driven through FakeExecutor."""

from __future__ import annotations

import dataclasses

import pytest
from fake_executor import FakeExecutor, audit, run_steps
from scheduler_factories import VOCAB, expected_outputs, make_request, make_scheduler, step

from scheduler_svc.request import RequestStatus
from shared.step_plan import StepResult

# -- aborts ---------------------------------------------------------------------------


def test_abort_waiting_request():
    scheduler = make_scheduler(max_num_seqs=1)
    executor = FakeExecutor.for_scheduler(scheduler, VOCAB)
    scheduler.add_request(make_request("a", [1, 2, 3], max_tokens=4))
    b = make_request("b", [4, 5, 6], max_tokens=4)
    scheduler.add_request(b)
    step(scheduler, executor)
    assert scheduler.abort_request("b") is True
    assert b.status == RequestStatus.FINISHED_ABORTED and scheduler.get_request("b") is None
    assert scheduler.abort_request("b") is False and scheduler.abort_request("nope") is False
    plan, _ = step(scheduler, executor)
    assert plan.finished_request_ids == [], "the executor never saw b"
    assert scheduler.stats().num_waiting == 0


def test_abort_running_request_frees_blocks_at_once_and_tells_the_executor():
    scheduler = make_scheduler()
    executor = FakeExecutor.for_scheduler(scheduler, VOCAB)
    scheduler.add_request(make_request("a", range(10), max_tokens=8))
    scheduler.add_request(make_request("b", range(20, 25), max_tokens=8))
    step(scheduler, executor)
    used = scheduler.stats().kv_blocks_used
    assert scheduler.abort_request("a", RequestStatus.FINISHED_STOPPED) is True
    assert scheduler.stats().kv_blocks_used == used - 3
    assert scheduler.kv_cache_manager.num_cached_free_blocks == 2, "a's full blocks stay cached"
    plan, _ = step(scheduler, executor)
    assert plan.finished_request_ids == ["a"] and "a" not in executor.requests
    with pytest.raises(ValueError):
        scheduler.abort_request("b", RequestStatus.RUNNING)


def test_abort_while_step_in_flight_drops_its_token():
    scheduler = make_scheduler()
    executor = FakeExecutor.for_scheduler(scheduler, VOCAB)
    scheduler.add_request(make_request("a", [1, 2, 3], max_tokens=8))
    scheduler.add_request(make_request("b", [4, 5, 6], max_tokens=8))
    plan = scheduler.schedule()
    scheduler.abort_request("a")
    result = executor.execute(plan)
    assert "a" in result.sampled
    outputs = scheduler.update_from_result(plan, result)
    assert [o.request_id for o in outputs] == ["b"]
    audit(scheduler, executor)
    plan, _ = step(scheduler, executor)
    assert plan.finished_request_ids == ["a"]


# -- failures and executor loss ---------------------------------------------------------


def test_failed_step_aborts_its_requests_and_uncaches_what_it_filled():
    scheduler = make_scheduler()
    executor = FakeExecutor.for_scheduler(scheduler, VOCAB)
    prompt = list(range(10, 17))  # 7 tokens: block 1 full after the prefill
    scheduler.add_request(make_request("a", prompt, max_tokens=8))
    step(scheduler, executor)
    pool = scheduler.kv_cache_manager.block_pool
    assert len(pool.cached_blocks) == 1
    step(scheduler, executor)  # decode at position 7 fills block 2: cached
    assert len(pool.cached_blocks) == 2
    step(scheduler, executor)  # position 8: block 3
    for _ in range(2):
        step(scheduler, executor)
    executor.fail_next_step("device on fire")
    plan = scheduler.schedule()  # position 11 fills block 3: cached at planning
    assert len(pool.cached_blocks) == 3
    outputs = scheduler.update_from_result(plan, executor.execute(plan))
    assert len(outputs) == 1
    out = outputs[0]
    assert (out.request_id, out.finished, out.status, out.error) == (
        "a",
        True,
        RequestStatus.FINISHED_ABORTED,
        "device on fire",
    )
    assert out.new_token_ids == []
    assert len(pool.cached_blocks) == 2, "the failed step's block must not stay cached"
    assert scheduler.stats().kv_blocks_used == 0 and not scheduler.has_unfinished_requests()
    audit(scheduler, executor)

    scheduler.add_request(make_request("again", prompt + expected_outputs(prompt, 5), max_tokens=2))
    plan, _ = step(scheduler, executor)
    assert plan.finished_request_ids == [], "the executor already dropped a"
    assert plan.new_requests[0].num_computed_tokens == 8, "hits blocks 1-2, not the garbage block 3"


def test_failed_step_requeues_requests_it_does_not_report_failed():
    scheduler = make_scheduler()
    executor = FakeExecutor.for_scheduler(scheduler, VOCAB)
    prompts = {"a": [1, 2, 3], "b": [4, 5, 6], "c": [7, 8, 9]}
    for rid, prompt in prompts.items():
        scheduler.add_request(make_request(rid, prompt, max_tokens=5))
    step(scheduler, executor)
    executor.fail_next_step("bad token", failed_request_ids=["a"])
    plan = scheduler.schedule()
    outputs = scheduler.update_from_result(plan, executor.execute(plan))
    assert [(o.request_id, o.error) for o in outputs] == [("a", "bad token")]
    b, c = scheduler.get_request("b"), scheduler.get_request("c")
    assert (b.status, b.block_ids, b.num_computed_tokens) == (RequestStatus.WAITING, [], 0)
    assert [r.request_id for r in scheduler.waiting] == ["b", "c"], "requeued in their running order"
    audit(scheduler, executor)
    plan, _ = step(scheduler, executor)
    assert plan.finished_request_ids == []
    assert [(r.request_id, r.token_ids) for r in plan.new_requests] == [
        ("b", prompts["b"] + b.output_token_ids[:1]),
        ("c", prompts["c"] + c.output_token_ids[:1]),
    ]
    run_steps(scheduler, executor)
    assert b.output_token_ids == expected_outputs(prompts["b"], 5)
    assert c.output_token_ids == expected_outputs(prompts["c"], 5)


def test_a_sample_where_none_was_due_is_ignored():
    scheduler = make_scheduler(max_num_batched_tokens=4)
    r = make_request("r", range(10), max_tokens=3)
    scheduler.add_request(r)
    plan = scheduler.schedule()  # a 4-token chunk of a 10-token prompt
    assert scheduler.update_from_result(plan, StepResult(step_id=plan.step_id, sampled={"r": 5})) == []
    assert r.output_token_ids == [] and r.num_tokens == 10


def test_abort_during_a_failed_step_does_not_tell_the_executor_to_forget_twice():
    scheduler = make_scheduler()
    executor = FakeExecutor.for_scheduler(scheduler, VOCAB)
    scheduler.add_request(make_request("a", [1, 2, 3], max_tokens=5))
    scheduler.add_request(make_request("b", [4, 5, 6], max_tokens=5))
    step(scheduler, executor)
    plan = scheduler.schedule()
    scheduler.abort_request("a")  # the executor is running a right now
    executor.fail_next_step("boom", failed_request_ids=[])  # b is retried
    assert scheduler.update_from_result(plan, executor.execute(plan)) == []
    plan, _ = step(scheduler, executor)
    assert [r.request_id for r in plan.new_requests] == ["b"]
    assert plan.finished_request_ids == [], "the failed step already dropped a from the executor"


def test_reset_for_executor_loss_recomputes_everything():
    scheduler = make_scheduler(max_num_seqs=3)
    executor = FakeExecutor.for_scheduler(scheduler, VOCAB)
    prompts = {f"r{i}": [i + 1] * (3 + 2 * i) for i in range(4)}
    requests = {rid: make_request(rid, p, max_tokens=6) for rid, p in prompts.items()}
    for r in requests.values():
        scheduler.add_request(r)
    for _ in range(2):
        step(scheduler, executor)
    in_flight = scheduler.schedule()
    stale_result = executor.execute(in_flight)

    scheduler.reset_for_executor_loss()
    assert [r.request_id for r in scheduler.live_requests()] == ["r0", "r1", "r2", "r3"]
    assert all(r.status == RequestStatus.WAITING and not r.block_ids for r in requests.values())
    kv = scheduler.kv_cache_manager
    assert kv.num_free_blocks == kv.num_total_blocks and kv.block_pool.cached_blocks == {}
    assert requests["r0"].num_output_tokens == 2

    executor = FakeExecutor.for_scheduler(scheduler, VOCAB)  # a fresh process
    plan = scheduler.schedule()
    assert plan.finished_request_ids == []
    assert {r.request_id: r.token_ids for r in plan.new_requests} == {
        rid: prompts[rid] + expected_outputs(prompts[rid], 2) for rid in ("r0", "r1", "r2")
    }
    # The lost executor's answer to the old plan arrives late: ignored.
    assert scheduler.update_from_result(in_flight, stale_result) == []
    assert requests["r0"].num_output_tokens == 2
    scheduler.update_from_result(plan, executor.execute(plan))
    audit(scheduler, executor)
    run_steps(scheduler, executor)
    for rid, r in requests.items():
        assert r.output_token_ids == expected_outputs(prompts[rid], 6)


def test_resize_after_executor_loss_plans_for_the_new_capacity():
    scheduler = make_scheduler(num_blocks=64, max_model_len=128)
    executor = FakeExecutor.for_scheduler(scheduler, VOCAB)
    prompts = {"short": [1] * 10, "long": [2] * 40, "huge": [3] * 60}
    requests = {rid: make_request(rid, p, max_tokens=20) for rid, p in prompts.items()}
    for r in requests.values():
        scheduler.add_request(r)
    step(scheduler, executor)
    with pytest.raises(AssertionError, match="requests running"):
        scheduler.resize(dataclasses.replace(scheduler.config, num_blocks=16, max_model_len=56))
    hits = scheduler.kv_cache_manager.prefix_cache_queries

    scheduler.reset_for_executor_loss()
    aborted = scheduler.resize(dataclasses.replace(scheduler.config, num_blocks=16, max_model_len=56))
    assert [r.request_id for r in aborted] == ["huge"]  # 60 tokens: no room left at all
    assert requests["huge"].status == RequestStatus.FINISHED_ABORTED
    assert requests["long"].max_tokens == 16 and requests["short"].max_tokens == 20  # 40 + 16 = 56
    assert scheduler.kv_cache_manager.num_total_blocks == 15  # block 0 is reserved
    assert scheduler.kv_cache_manager.prefix_cache_queries == hits  # monotonic counters carry over
    executor = FakeExecutor.for_scheduler(scheduler, VOCAB)  # the executor that came back
    run_steps(scheduler, executor)
    assert requests["short"].output_token_ids == expected_outputs(prompts["short"], 20)
    assert requests["long"].output_token_ids == expected_outputs(prompts["long"], 16)
    assert requests["long"].status == RequestStatus.FINISHED_LENGTH
