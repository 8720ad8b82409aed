"""Scheduler behaviour, driven through FakeExecutor.

The fake executor checks the plan protocol and the KV content of every
prefix a request reads, and samples reference_next_token(tokens), so a
request's outputs are known in advance: expected_outputs().
"""

from __future__ import annotations

import pytest
from fake_executor import FakeExecutor, audit, run_steps
from scheduler_factories import VOCAB, expected_outputs, make_request, make_scheduler, scheduled_tokens, step

from scheduler_svc.request import RequestStatus
from scheduler_svc.scheduler_config import SchedulerConfig, SchedulerPolicy
from shared.sampling_params import SamplingParams
from shared.step_plan import StepResult

# -- configuration and requests ------------------------------------------------


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"block_size": 0}, "--block-size"),
        ({"num_blocks": 1}, "num_blocks"),
        ({"max_num_seqs": 0}, "--max-num-seqs"),
        ({"max_num_batched_tokens": 0}, "--max-num-batched-tokens"),
        ({"watermark": 1.0}, "--watermark"),
        ({"long_prefill_token_threshold": -1}, "long_prefill_token_threshold"),
        ({"hash_algo": "md5"}, "--hash-algo"),
        ({"enable_chunked_prefill": False, "max_num_batched_tokens": 64}, "chunked prefill"),
        (
            {"enable_chunked_prefill": False, "max_num_batched_tokens": 128, "long_prefill_token_threshold": 8},
            "long_prefill_token_threshold",
        ),
        ({"num_blocks": 32}, "KV cache too small"),  # 31 blocks * 4 < 128
        ({"num_blocks": 33, "watermark": 0.1}, "watermark"),  # 32 blocks but 3 reserved
    ],
)
def test_config_validation(overrides, message):
    with pytest.raises(ValueError, match=message):
        make_scheduler(**overrides)


def test_one_sequence_always_fits_and_the_cap_is_the_check():
    policy = SchedulerPolicy(block_size=4, watermark=0.05)
    assert policy.watermark_blocks(101) == 5  # 100 usable blocks
    assert policy.max_sequence_len(101) == 95 * 4
    config = SchedulerConfig.for_executor(policy, num_blocks=101, model_max_len=1000)
    assert config.max_model_len == 380 and config.watermark == 0.05
    assert SchedulerConfig.for_executor(policy, 101, 100).max_model_len == 100  # the model's own limit
    unchunked = SchedulerPolicy(block_size=4, enable_chunked_prefill=False, max_num_batched_tokens=64)
    assert SchedulerConfig.for_executor(unchunked, 101, 1000).max_model_len == 64
    with pytest.raises(ValueError, match="KV cache too small"):
        SchedulerConfig(block_size=4, watermark=0.05, num_blocks=101, max_model_len=381)


def test_add_request_validation():
    scheduler = make_scheduler(max_model_len=16)
    scheduler.add_request(make_request("a", [1, 2], max_tokens=14))
    with pytest.raises(ValueError, match="already live"):
        scheduler.add_request(make_request("a", [1, 2]))
    with pytest.raises(ValueError, match="max_model_len"):
        scheduler.add_request(make_request("b", [1, 2, 3], max_tokens=14))
    with pytest.raises(ValueError, match="empty"):
        make_request("c", [])
    with pytest.raises(ValueError, match="max_tokens"):
        make_request("c", [1], max_tokens=0)
    with pytest.raises(ValueError, match="min_tokens"):
        make_request("c", [1], max_tokens=2, min_tokens=3)


def test_stop_on_eos_and_stop_token_ids_after_min_tokens():
    r = make_request("r", [1], max_tokens=10, eos_token_ids=frozenset({2}), stop_token_ids=frozenset({3}), min_tokens=2)
    assert r.append_output_token(2) is False, "EOS before min_tokens must not stop"
    assert r.append_output_token(5) is False
    assert r.append_output_token(3) is True
    assert (r.status, r.stop_token_id, r.is_finished) == (RequestStatus.FINISHED_STOPPED, 3, True)
    r = make_request("r", [1], max_tokens=10, eos_token_ids=frozenset({2}))
    assert r.append_output_token(2) is True and r.stop_token_id == 2


def test_ignore_eos_still_honours_stop_token_ids_and_max_tokens():
    r = make_request(
        "r", [1], max_tokens=3, eos_token_ids=frozenset({2}), stop_token_ids=frozenset({3}), ignore_eos=True
    )
    assert r.append_output_token(2) is False
    assert r.append_output_token(2) is False
    assert r.append_output_token(2) is True
    assert (r.status, r.stop_token_id) == (RequestStatus.FINISHED_LENGTH, None)
    r = make_request("r", [1], max_tokens=3, stop_token_ids=frozenset({3}), ignore_eos=True)
    assert r.append_output_token(3) is True and r.status == RequestStatus.FINISHED_STOPPED


def test_stop_token_at_max_tokens_counts_as_stop():
    r = make_request("r", [1], max_tokens=1, eos_token_ids=frozenset({2}))
    assert r.append_output_token(2) is True
    assert (r.status, r.stop_token_id) == (RequestStatus.FINISHED_STOPPED, 2)


def test_status_order_matches_proto():
    assert [s.value for s in RequestStatus] == [1, 2, 3, 4, 5, 6]
    assert [s.is_finished for s in RequestStatus] == [False, False, False, True, True, True]


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


# -- end to end -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides",
    [
        {"enable_prefix_caching": True},
        {"enable_prefix_caching": False},
        {"enable_prefix_caching": True, "num_blocks": 13, "max_model_len": 48},
        {"enable_prefix_caching": False, "num_blocks": 13, "max_model_len": 48},
        {
            "enable_prefix_caching": True,
            "enable_chunked_prefill": False,
            "num_blocks": 13,
            "max_model_len": 48,
            "max_num_batched_tokens": 48,
        },
        {"enable_prefix_caching": True, "hash_algo": "blake2b", "max_num_batched_tokens": 7},
    ],
)
def test_outputs_match_reference_across_cache_settings_and_memory_pressure(overrides):
    scheduler = make_scheduler(**overrides)
    executor = FakeExecutor.for_scheduler(scheduler, VOCAB)
    shared = [9, 8, 7, 6, 5, 4, 3, 2]
    prompts = {f"r{i}": shared[: 4 + i % 5] + [i] * (1 + i % 7) for i in range(12)}
    for i, (rid, prompt) in enumerate(prompts.items()):
        scheduler.add_request(make_request(rid, prompt, max_tokens=20 + i % 5, priority=i % 3))
    tokens = run_steps(scheduler, executor)
    for i, (rid, prompt) in enumerate(prompts.items()):
        assert tokens[rid] == expected_outputs(prompt, 20 + i % 5), rid
    stats = scheduler.stats()
    if scheduler.config.num_blocks == 13:
        assert stats.num_preemptions > 0, "the tiny KV cache should have forced preemptions"
    if scheduler.config.enable_prefix_caching:
        assert stats.prefix_cache_hits_tokens > 0
    assert stats.kv_blocks_used == 0


def test_request_reaching_max_model_len_finishes_with_length():
    scheduler = make_scheduler(max_model_len=16)
    executor = FakeExecutor.for_scheduler(scheduler, VOCAB)
    r = make_request("r", range(10), max_tokens=6)
    scheduler.add_request(r)
    run_steps(scheduler, executor)
    assert (r.num_tokens, r.status) == (16, RequestStatus.FINISHED_LENGTH)


def test_outputs_carry_logprobs_stop_ids_and_cached_tokens():
    scheduler = make_scheduler()
    executor = FakeExecutor.for_scheduler(scheduler, VOCAB)
    prompt = [1, 2, 3, 4, 5]
    first = expected_outputs(prompt, 1)[0]
    scheduler.add_request(make_request("warm", prompt, max_tokens=1))
    step(scheduler, executor)
    scheduler.add_request(
        make_request("r", prompt, max_tokens=5, eos_token_ids=frozenset({first}), sampling=SamplingParams(logprobs=2))
    )
    _, outputs = step(scheduler, executor)
    out = outputs["r"]
    assert out.new_token_ids == [first] and out.finished and out.stop_token_id == first
    assert out.status == RequestStatus.FINISHED_STOPPED
    assert out.num_cached_tokens == 4
    assert len(out.new_logprobs) == 1 and len(out.new_logprobs[0].top) == 2


def test_stats_and_live_requests():
    scheduler = make_scheduler(max_num_seqs=1)
    executor = FakeExecutor.for_scheduler(scheduler, VOCAB)
    scheduler.add_request(make_request("a", range(9), max_tokens=3))
    scheduler.add_request(make_request("b", range(9), max_tokens=3))
    step(scheduler, executor)
    stats = scheduler.stats()
    assert (stats.num_running, stats.num_waiting, stats.num_steps) == (1, 1, 1)
    assert (stats.kv_blocks_total, stats.kv_blocks_used, stats.kv_blocks_cached_free) == (63, 3, 0)
    assert (stats.prefix_cache_queries_tokens, stats.prefix_cache_hits_tokens) == (9, 0)
    assert [r.request_id for r in scheduler.live_requests()] == ["a", "b"]
    run_steps(scheduler, executor)
    stats = scheduler.stats()
    assert (stats.prefix_cache_queries_tokens, stats.prefix_cache_hits_tokens) == (18, 8)
    assert stats.kv_blocks_used == 0 and stats.kv_blocks_cached_free > 0


def test_result_for_another_plan_is_rejected():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", [1], max_tokens=2))
    plan = scheduler.schedule()
    with pytest.raises(ValueError, match="step"):
        scheduler.update_from_result(plan, StepResult(step_id=plan.step_id + 1))
