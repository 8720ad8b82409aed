"""Scheduler behaviour: configuration, request validation and stop conditions, and whole
runs against the reference outputs. Plans: test_scheduler_plans.py; preemption:
test_scheduler_preemption.py; failed steps: test_scheduler_failures.py.

Driven through FakeExecutor, which checks the plan protocol and the KV content
of every prefix a request reads, and samples reference_next_token(tokens), so
a request's outputs are known in advance: expected_outputs().
"""

from __future__ import annotations

import pytest
from fake_executor import FakeExecutor, run_steps
from scheduler_factories import VOCAB, expected_outputs, make_request, make_scheduler, step

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
