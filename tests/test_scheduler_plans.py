"""Scheduler plans: what a plan carries (new requests whole, then deltas; finished ids),
how chunked prefill and the token budget cut the work, and whom it admits first.

Driven through FakeExecutor, which checks the plan protocol and the KV content
of every prefix a request reads, and samples reference_next_token(tokens), so
a request's outputs are known in advance: expected_outputs().
"""

from __future__ import annotations

import pytest
from fake_executor import FakeExecutor, run_steps
from scheduler_factories import VOCAB, expected_outputs, make_request, make_scheduler, scheduled_tokens, step

from scheduler_svc.request import RequestStatus

# -- plans ------------------------------------------------------------------------


def test_new_request_is_sent_whole_then_as_deltas():
    scheduler = make_scheduler()
    executor = FakeExecutor.for_scheduler(scheduler, VOCAB)
    prompt = [5, 6, 7, 8, 9, 10]
    scheduler.add_request(make_request("r", prompt, max_tokens=4))

    plan, outputs = step(scheduler, executor)
    assert plan.step_id == 1 and len(plan.cached_requests) == 0
    (new,) = plan.new_requests
    assert (new.request_id, new.token_ids, new.num_prompt_tokens) == ("r", prompt, 6)
    assert (new.block_ids, new.num_computed_tokens, new.num_scheduled_tokens) == ([1, 2], 0, 6)
    assert outputs["r"].new_token_ids == expected_outputs(prompt, 1)
    assert outputs["r"].num_cached_tokens == 0 and not outputs["r"].finished

    plan, _ = step(scheduler, executor)
    assert plan.step_id == 2 and plan.new_requests == []
    cached = plan.cached_requests
    assert (cached.request_ids, cached.new_block_ids, cached.num_computed_tokens, cached.num_scheduled_tokens) == (
        ["r"],
        [[]],
        [6],
        [1],
    )
    plan, _ = step(scheduler, executor)
    assert plan.cached_requests.new_block_ids == [[]]  # position 7 still fits block 2
    plan, outputs = step(scheduler, executor)
    assert plan.cached_requests.new_block_ids == [[3]]  # position 8 opens block 3
    assert outputs["r"].finished and outputs["r"].status == RequestStatus.FINISHED_LENGTH
    assert scheduler.get_request("r") is None and not scheduler.has_unfinished_requests()


def test_finished_ids_wait_for_a_plan_that_schedules_something():
    scheduler = make_scheduler()
    executor = FakeExecutor.for_scheduler(scheduler, VOCAB)
    scheduler.add_request(make_request("a", [1, 2], max_tokens=1))
    plan, outputs = step(scheduler, executor)
    assert outputs["a"].finished
    empty = scheduler.schedule()
    assert empty.num_requests == 0 and empty.finished_request_ids == []
    scheduler.add_request(make_request("b", [3, 4], max_tokens=1))
    plan, _ = step(scheduler, executor)
    assert plan.finished_request_ids == ["a"]
    assert plan.step_id > empty.step_id


def test_two_requests_with_one_prompt_in_one_step_share_its_blocks():
    scheduler = make_scheduler()
    executor = FakeExecutor.for_scheduler(scheduler, VOCAB)
    prompt = list(range(100, 112))  # 3 full blocks
    scheduler.add_request(make_request("a", prompt, max_tokens=3))
    scheduler.add_request(make_request("b", prompt, max_tokens=3))
    plan, outputs = step(scheduler, executor)
    a, b = plan.new_requests
    # The blocks a fills this step are cached at planning time; b reuses the
    # first two and recomputes its last token.
    assert (a.num_computed_tokens, b.num_computed_tokens) == (0, 8)
    assert b.block_ids[:2] == a.block_ids[:2] and b.block_ids[2] != a.block_ids[2]
    assert b.num_scheduled_tokens == 4
    assert outputs["a"].new_token_ids == outputs["b"].new_token_ids
    assert outputs["b"].num_cached_tokens == 8
    tokens = run_steps(scheduler, executor)
    assert tokens["a"] == tokens["b"] == expected_outputs(prompt, 3)[1:]


# -- chunked prefill and budgets ----------------------------------------------------


def test_chunked_prefill_splits_long_prompt_while_decodes_advance_every_step():
    scheduler = make_scheduler(block_size=16, num_blocks=300, max_num_batched_tokens=512, max_model_len=4096)
    executor = FakeExecutor.for_scheduler(scheduler, VOCAB, verify_kv=False)
    for i in range(3):
        scheduler.add_request(make_request(f"d{i}", [i + 1] * 8, max_tokens=30))
    step(scheduler, executor)  # the three short prompts are prefilled
    long_prompt = [(7 * i) % 997 for i in range(4000)]
    scheduler.add_request(make_request("long", long_prompt, max_tokens=2))

    chunks = []
    while not chunks or sum(chunks) < 4000:
        plan, outputs = step(scheduler, executor)
        tokens = scheduled_tokens(plan)
        assert [tokens[f"d{i}"] for i in range(3)] == [1, 1, 1]
        assert all(len(outputs[f"d{i}"].new_token_ids) == 1 for i in range(3)), "a decode missed a step"
        assert sum(tokens.values()) <= 512
        chunks.append(tokens["long"])
        assert ("long" in outputs) == (sum(chunks) == 4000), "sampled only after the last chunk"
    assert chunks == [509] * 7 + [4000 - 7 * 509]
    assert run_steps(scheduler, executor)["long"] == expected_outputs(long_prompt, 2)[1:]


def test_long_prefill_token_threshold_caps_each_chunk():
    scheduler = make_scheduler(long_prefill_token_threshold=16)
    executor = FakeExecutor.for_scheduler(scheduler, VOCAB)
    scheduler.add_request(make_request("r", range(40), max_tokens=2))
    chunks = [scheduled_tokens(step(scheduler, executor)[0])["r"] for _ in range(3)]
    assert chunks == [16, 16, 8]


@pytest.mark.parametrize("chunked", [True, False])
def test_prompt_that_does_not_fit_the_remaining_budget(chunked):
    scheduler = make_scheduler(max_num_batched_tokens=128, enable_chunked_prefill=chunked)
    executor = FakeExecutor.for_scheduler(scheduler, VOCAB)
    scheduler.add_request(make_request("a", range(100), max_tokens=4))
    scheduler.add_request(make_request("b", range(200, 260), max_tokens=4))
    plan, _ = step(scheduler, executor)
    if chunked:
        assert scheduled_tokens(plan) == {"a": 100, "b": 28}
    else:
        assert scheduled_tokens(plan) == {"a": 100}, "without chunking b waits for a whole-prompt slot"
        plan, _ = step(scheduler, executor)
        assert scheduled_tokens(plan) == {"a": 1, "b": 60}


def test_max_num_seqs_caps_running_requests():
    scheduler = make_scheduler(max_num_seqs=2)
    executor = FakeExecutor.for_scheduler(scheduler, VOCAB)
    for i in range(3):
        scheduler.add_request(make_request(f"r{i}", [i + 1] * 3, max_tokens=2))
    plan, _ = step(scheduler, executor)
    assert sorted(scheduled_tokens(plan)) == ["r0", "r1"]
    assert [r.request_id for r in scheduler.waiting] == ["r2"]


def test_waiting_requests_are_admitted_by_priority_then_arrival():
    scheduler = make_scheduler(max_num_seqs=1)
    executor = FakeExecutor.for_scheduler(scheduler, VOCAB)
    for rid, priority in [("a", 1), ("b", 0), ("c", 1), ("d", 0), ("e", -3)]:
        scheduler.add_request(make_request(rid, [len(rid)] * 3, max_tokens=1, priority=priority))
    order = []
    while scheduler.has_unfinished_requests():
        plan, _ = step(scheduler, executor)
        order += [r.request_id for r in plan.new_requests]
    assert order == ["e", "b", "d", "a", "c"]


def test_pushed_to_front_requests_lead_their_priority_class():
    queue = make_scheduler().waiting
    x, y, z = (make_request(rid, [1], priority=p) for rid, p in [("x", 0), ("y", 1), ("z", 0)])
    v, w = make_request("v", [1], priority=1), make_request("w", [1], priority=1)
    for r in (x, y, z):
        queue.push(r)
    queue.push_front(v)
    queue.push_front(w)  # pushed last: in front of v
    assert [r.request_id for r in queue] == ["x", "z", "w", "v", "y"]
    queue.remove(z)
    assert [queue.pop().request_id for _ in range(len(queue))] == ["x", "w", "v", "y"]
