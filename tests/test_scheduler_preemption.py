"""Scheduler preemption: whom it evicts when blocks run out, and what a preempted request
leaves behind (its part of the plan undone, its place at the front of the queue).

Driven through FakeExecutor, which checks the plan protocol and the KV content
of every prefix a request reads, and samples reference_next_token(tokens), so
a request's outputs are known in advance: expected_outputs().
"""

from __future__ import annotations

from fake_executor import FakeExecutor, audit, run_steps
from scheduler_factories import VOCAB, expected_outputs, make_request, make_scheduler, scheduled_tokens, step

from scheduler_svc.request import RequestStatus

# -- preemption ---------------------------------------------------------------------


def test_preemption_picks_lowest_priority_then_latest_arrival():
    # 4 usable blocks of 4 tokens; three 4-token prompts use 3, so the next
    # step (each needs a second block) preempts exactly one request.
    scheduler = make_scheduler(num_blocks=5, max_model_len=16)
    executor = FakeExecutor.for_scheduler(scheduler, VOCAB)
    prompts = {"a": [1, 1, 1, 1], "b": [2, 2, 2, 2], "c": [3, 3, 3, 3]}
    for rid, priority in [("a", 0), ("b", 2), ("c", 2)]:
        scheduler.add_request(make_request(rid, prompts[rid], max_tokens=6, priority=priority))
    step(scheduler, executor)
    plan, _ = step(scheduler, executor)
    assert plan.finished_request_ids == ["c"], "c has the lowest priority and arrived last"
    assert scheduled_tokens(plan) == {"a": 1, "b": 1}
    c = scheduler.get_request("c")
    assert (c.status, c.num_preemptions, c.block_ids, c.num_computed_tokens) == (RequestStatus.PREEMPTED, 1, [], 0)
    assert c.output_token_ids == expected_outputs(prompts["c"], 1)
    assert scheduler.stats().num_preemptions == 1

    resumed_plan = None
    while scheduler.has_unfinished_requests():
        plan, _ = step(scheduler, executor)
        resumed_plan = resumed_plan or next((r for r in plan.new_requests if r.request_id == "c"), None)
    assert resumed_plan.token_ids == prompts["c"] + c.output_token_ids[:1], "resent with its outputs"
    assert resumed_plan.num_prompt_tokens == 4
    assert c.output_token_ids == expected_outputs(prompts["c"], 6)
    assert c.num_cached_tokens == 0, "num_cached_tokens is fixed at the first admission"


def test_preempted_request_goes_to_the_front_and_blocks_admissions_that_step():
    # 4 usable blocks; a and b hold two each. w1 (higher priority) and w2
    # (claiming an earlier arrival than a and b) wait because of max_num_seqs.
    scheduler = make_scheduler(num_blocks=5, max_model_len=16, max_num_seqs=2)
    executor = FakeExecutor.for_scheduler(scheduler, VOCAB)
    scheduler.add_request(make_request("a", [1] * 8, max_tokens=4, arrival_time=100.0))
    scheduler.add_request(make_request("b", [2] * 8, max_tokens=4, arrival_time=101.0))
    step(scheduler, executor)
    scheduler.add_request(make_request("w1", [3] * 3, max_tokens=4, priority=-1))
    scheduler.add_request(make_request("w2", [4] * 3, max_tokens=4, arrival_time=50.0))
    plan, _ = step(scheduler, executor)
    assert plan.finished_request_ids == ["b"] and scheduled_tokens(plan) == {"a": 1}
    assert plan.new_requests == [], "no admissions in a step that preempted, though w1 would fit"
    assert [r.request_id for r in scheduler.waiting] == ["w1", "b", "w2"], "b leads its priority class"
    run_steps(scheduler, executor)


def test_preemption_ties_go_to_the_latest_admitted():
    scheduler = make_scheduler(num_blocks=5, max_model_len=16)
    executor = FakeExecutor.for_scheduler(scheduler, VOCAB)
    for rid, token in (("x", 1), ("y", 2)):
        scheduler.add_request(make_request(rid, [token] * 8, max_tokens=4, arrival_time=7.0))
    step(scheduler, executor)
    plan, _ = step(scheduler, executor)
    assert plan.finished_request_ids == ["y"]


def test_preempting_an_already_scheduled_request_undoes_its_part_of_the_plan():
    # 7 usable blocks of 4 tokens; 11 tokens per step, prefill chunks of at most 5.
    scheduler = make_scheduler(
        num_blocks=8, max_model_len=24, max_num_batched_tokens=11, long_prefill_token_threshold=5
    )
    executor = FakeExecutor.for_scheduler(scheduler, VOCAB)
    a_prompt = list(range(20))
    a = make_request("a", a_prompt, max_tokens=4, priority=5)
    scheduler.add_request(a)
    step(scheduler, executor)  # a: tokens 0-4, blocks 1-2
    scheduler.add_request(make_request("b", list(range(50, 60)), max_tokens=4, priority=0))
    scheduler.add_request(make_request("c", [7] * 4, max_tokens=4, priority=0))
    plan, _ = step(scheduler, executor)
    assert scheduled_tokens(plan) == {"a": 5, "b": 5, "c": 1}
    assert (a.block_ids, scheduler.stats().kv_blocks_used) == ([1, 2, 3], 6)  # b: 4-5, c: 6
    # Next: a's chunk 10-14 fills block 3 (cached at planning) and takes block 7;
    # then b needs a block and the victim is a, already in the plan: its
    # tokens go back to the budget, which c behind b then uses.
    plan = scheduler.schedule()
    assert scheduled_tokens(plan) == {"b": 5, "c": 3}
    assert plan.finished_request_ids == ["a"]
    assert plan.cached_requests.new_block_ids == [[7], []], "a's blocks are freed tail first"
    pool = scheduler.kv_cache_manager.block_pool
    assert pool.blocks[3].block_hash is None, "the hash of a block a never got to fill must be dropped"
    assert pool.blocks[2].block_hash is not None, "blocks a filled in earlier steps stay cached"
    assert (a.num_computed_tokens, a.status) == (0, RequestStatus.PREEMPTED)
    scheduler.update_from_result(plan, executor.execute(plan))
    audit(scheduler, executor)
    run_steps(scheduler, executor)
    assert a.output_token_ids == expected_outputs(a_prompt, 4)


def test_num_cached_tokens_is_fixed_at_first_admission():
    # 4 usable blocks: a (2 blocks) and b (2 blocks) fill them; a's next token
    # preempts b, whose full first block stays cached and is hit on resume.
    scheduler = make_scheduler(num_blocks=5, max_model_len=16)
    executor = FakeExecutor.for_scheduler(scheduler, VOCAB)
    scheduler.add_request(make_request("a", [1] * 8, max_tokens=2, priority=0))
    b = make_request("b", [2] * 5, max_tokens=3, priority=1)
    scheduler.add_request(b)
    step(scheduler, executor)
    plan, _ = step(scheduler, executor)
    assert plan.finished_request_ids == ["b"]
    plan, outputs = step(scheduler, executor)
    (resumed,) = plan.new_requests
    assert resumed.num_computed_tokens == 4, "b hits its own cached block"
    assert outputs["b"].num_cached_tokens == 0 and b.num_cached_tokens == 0
    run_steps(scheduler, executor)
    assert b.output_token_ids == expected_outputs([2] * 5, 3)
