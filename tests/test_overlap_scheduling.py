"""Overlap scheduling: step N+1 is planned while step N runs.

The scheduler counts the samples of steps in flight as pending, plans their
positions without knowing their ids (the executor feeds back its own), hashes
a block whose last token was pending once that token arrives, and drops the
extra step of a request that finished meanwhile. A failed step makes the plan
behind it stale: the executor refuses it and its requests are recomputed.
"""

from __future__ import annotations

import random

import pytest
import torch
from fake_executor import FakeExecutor, Pipeline, audit, reference_next_token, run_steps

from executor_svc.model_runner import ModelRunner
from scheduler_svc.request import Request, RequestStatus
from scheduler_svc.scheduler import Scheduler
from scheduler_svc.scheduler_config import SchedulerConfig
from shared.sampling_params import SamplingParams
from shared.step_plan import CachedRequestData, NewRequestData, StepPlan

VOCAB = 50
EOS = frozenset({0, 1, 2})


def make_scheduler(num_blocks=64, block_size=4, **overrides) -> Scheduler:
    config = dict(
        num_blocks=num_blocks,
        block_size=block_size,
        max_model_len=64,
        max_num_batched_tokens=32,
        max_num_seqs=8,
        watermark=0.0,
    )
    config.update(overrides)
    return Scheduler(SchedulerConfig(**config))


def request(rid: str, prompt: list[int], max_tokens: int, honour_eos: bool = False) -> Request:
    return Request(rid, prompt, SamplingParams(), max_tokens=max_tokens, eos_token_ids=EOS, ignore_eos=not honour_eos)


def two_steps_in_flight(scheduler: Scheduler, executor: FakeExecutor, fail_second: bool = False):
    """Plans and runs step 1, then plans and runs step 2 before step 1's result is applied.

    Returns ((plan, result) of step 1, (plan, result) of step 2); step 2 fails
    (every request requeued) when asked.
    """
    first = scheduler.schedule()
    first_result = executor.execute(first)
    second = scheduler.schedule()
    if fail_second:
        executor.fail_next_step("boom", failed_request_ids=[])
    return (first, first_result), (second, executor.execute(second))


def random_requests(seed: int, count: int) -> list[Request]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, VOCAB) for _ in range(12)]
    out = []
    for i in range(count):
        prompt = shared[: rng.randint(0, 12)] + [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 20))]
        out.append(request(f"r{i}", prompt, rng.randint(1, 24), honour_eos=rng.random() < 0.5))
    return out


def test_overlap_produces_the_same_tokens_as_lockstep_under_memory_pressure():
    for seed in range(6):
        outputs = {}
        for overlap in (False, True):
            # 24 blocks of 4 tokens for 12 requests of up to 56 tokens: preemptions, prefix hits, chunking.
            scheduler = make_scheduler(num_blocks=24, max_num_batched_tokens=16)
            for req in random_requests(seed, 12):
                scheduler.add_request(req)
            executor = FakeExecutor.for_scheduler(scheduler, VOCAB)
            outputs[overlap] = run_steps(scheduler, executor, overlap=overlap)
            audit(scheduler, executor)
            assert scheduler.kv_cache_manager.num_free_blocks == scheduler.kv_cache_manager.num_total_blocks
        assert outputs[True] == outputs[False], f"seed {seed}: overlap changed the tokens"


def test_next_decode_is_planned_before_the_sample_arrives():
    scheduler = make_scheduler()
    req = request("a", [5, 6, 7, 8, 9, 10], max_tokens=4)
    scheduler.add_request(req)
    executor = FakeExecutor.for_scheduler(scheduler, VOCAB)

    prefill = scheduler.schedule()
    prefill_result = executor.execute(prefill)
    assert req.num_pending_samples == 1
    decode = scheduler.schedule()  # step 1's sample is not known yet
    assert decode.cached_requests.request_ids == ["a"]
    assert decode.cached_requests.num_computed_tokens == [6] and decode.cached_requests.num_scheduled_tokens == [1]
    assert decode.last_result_step_id == 0, "made before any result was applied"
    assert req.num_pending_samples == 2 and req.num_tokens == 6 and req.num_computed_tokens == 7
    decode_result = executor.execute(decode)  # the executor computes its own sample's KV

    (out,) = scheduler.update_from_result(prefill, prefill_result)
    assert out.new_token_ids == [reference_next_token([5, 6, 7, 8, 9, 10], VOCAB)]
    assert req.num_pending_samples == 1 and req.num_tokens == 7
    (out,) = scheduler.update_from_result(decode, decode_result)
    assert out.new_token_ids == [reference_next_token(req.all_token_ids[:-1], VOCAB)]
    assert scheduler.schedule().last_result_step_id == decode.step_id


def test_no_step_is_planned_past_max_tokens():
    scheduler = make_scheduler()
    req = request("a", [5, 6, 7], max_tokens=2)
    scheduler.add_request(req)
    _first, second = scheduler.schedule(), scheduler.schedule()
    assert second.num_requests == 1 and req.num_pending_samples == 2
    third = scheduler.schedule()
    assert third.num_requests == 0, "both samples max_tokens allows are already in flight"


def test_a_block_completed_by_a_pending_sample_is_cached_when_it_arrives():
    scheduler = make_scheduler(block_size=4)
    req = request("a", [5, 6, 7], max_tokens=8)  # the first sample fills block 0
    scheduler.add_request(req)
    executor = FakeExecutor.for_scheduler(scheduler, VOCAB)
    pool = scheduler.kv_cache_manager.block_pool
    (prefill, prefill_result), _ = two_steps_in_flight(scheduler, executor)  # step 2 computes position 3
    assert not pool.cached_blocks, "a block whose last token is unknown cannot be hashed yet"
    scheduler.update_from_result(prefill, prefill_result)
    assert len(pool.cached_blocks) == 1 and pool.blocks[req.block_ids[0]].block_hash == req.block_hashes[0]
    # A request with the same first four tokens hits it, and reads the KV the decode step wrote.
    twin = request("b", req.all_token_ids[:4] + [9], max_tokens=1)
    scheduler.add_request(twin)
    plan = scheduler.schedule()
    assert [r.num_computed_tokens for r in plan.new_requests] == [4]
    executor.execute(plan)  # the fake checks the hit block's KV fingerprints


def test_request_that_stops_in_flight_wastes_one_step_and_frees_everything():
    # Find a prompt whose first sample is EOS under the fake model.
    prompt = next([7, k] for k in range(3, 1000) if reference_next_token([7, k], VOCAB) in EOS)
    scheduler = make_scheduler()
    req = request("a", prompt, max_tokens=10, honour_eos=True)
    scheduler.add_request(req)
    executor = FakeExecutor.for_scheduler(scheduler, VOCAB)
    pipeline = Pipeline(scheduler, executor, depth=2)
    outputs = []
    while scheduler.has_unfinished_requests() or pipeline.in_flight:
        outputs += pipeline.step()
    assert [o.new_token_ids for o in outputs] == [[reference_next_token(prompt, VOCAB)]]
    assert req.status == RequestStatus.FINISHED_STOPPED
    assert executor.num_steps == 2, "the decode planned behind the stopping step ran and was dropped"
    assert scheduler.kv_cache_manager.num_free_blocks == scheduler.kv_cache_manager.num_total_blocks
    assert scheduler._finished_ids == ["a"], "the executor still holds it until the next plan"


def test_failed_step_makes_the_plan_behind_it_stale_and_everyone_recovers():
    scheduler = make_scheduler(block_size=2)
    requests = [request(f"r{i}", [3 + i, 4, 5, 6, 7], max_tokens=6) for i in range(3)]
    for req in requests:
        scheduler.add_request(req)
    executor = FakeExecutor.for_scheduler(scheduler, VOCAB)
    pipeline = Pipeline(scheduler, executor, depth=2)
    pipeline.step()  # step 1 (prefills) sent
    executor.fail_next_step("boom", failed_request_ids=["r0"])
    tokens: dict[str, list[int]] = {}
    errors = []
    while scheduler.has_unfinished_requests() or pipeline.in_flight:
        for out in pipeline.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            errors += [out.request_id] if out.error else []
    assert executor.num_stale_plans == 1
    assert errors == ["r0"] and requests[0].status == RequestStatus.FINISHED_ABORTED
    for req in requests[1:]:
        expected = []
        for _ in range(6):
            expected.append(reference_next_token(req.prompt_token_ids + expected, VOCAB))
        assert tokens[req.request_id] == expected, f"{req.request_id} recomputed to other tokens"
    audit(scheduler, executor)
    assert scheduler.kv_cache_manager.num_free_blocks == scheduler.kv_cache_manager.num_total_blocks


class _StubModel:
    """Hidden size 4; every logit row prefers token 5. Fails while `fail` is set."""

    def __init__(self):
        self.fail = False

    def __call__(self, input_ids, positions, kv_caches, meta):
        if self.fail:
            raise RuntimeError("kernel exploded")
        return torch.zeros(input_ids.shape[0], 4)

    def compute_logits(self, hidden):
        logits = torch.zeros(hidden.shape[0], 8)
        logits[:, 5] = 1.0
        return logits

    def greedy_tokens(self, hidden):
        return self.compute_logits(hidden).argmax(-1)


class _StubBackend:
    def prepare(self, meta):
        pass


def test_model_runner_refuses_a_plan_made_before_a_failure_and_forgets_its_requests():
    model = _StubModel()
    kv = [(torch.zeros(16, 4), torch.zeros(16, 4))]
    runner = ModelRunner(model, kv, block_size=4, vocab_size=8, device=torch.device("cpu"), attn_backend=_StubBackend())
    greedy = SamplingParams(temperature=0.0)

    def new(rid, blocks):
        return NewRequestData(rid, [1, 2, 3], 3, greedy, blocks, 0, 3)

    assert runner.execute(StepPlan(1, [new("a", [1])], last_result_step_id=0)).sampled == {"a": 5}
    model.fail = True
    failed = runner.execute(
        StepPlan(2, [new("b", [2])], CachedRequestData(["a"], [[]], [3], [1]), last_result_step_id=1)
    )
    assert failed.error and sorted(failed.failed_request_ids) == ["a", "b"]
    model.fail = False
    # Step 3 left before step 2's result was seen: it names "a", which step 2 dropped.
    stale = runner.execute(
        StepPlan(3, [new("c", [3])], CachedRequestData(["a"], [[]], [4], [1]), last_result_step_id=1)
    )
    assert "stale" in stale.error and stale.failed_request_ids == [] and not stale.sampled
    assert runner.requests == {}, "a stale plan's requests are forgotten, new ones included"
    # Step 4 was made after step 3's result: it runs, with the requests resent whole.
    ok = runner.execute(StepPlan(4, [new("a", [1]), new("c", [3])], last_result_step_id=3))
    assert not ok.error and ok.sampled == {"a": 5, "c": 5}


@pytest.mark.parametrize("abort", [False, True], ids=["live", "aborted"])
def test_failed_step_uncaches_a_block_its_pending_sample_completed(abort):
    # Step 2 computes the KV of position 3, whose token (step 1's sample) completes
    # block 0; applying step 1's result caches that block while step 2 runs. Then
    # step 2 fails with no plan behind it: both samples max_tokens allows are in
    # flight, and the request may have been aborted meanwhile (a stop string).
    scheduler = make_scheduler(block_size=4)
    req = request("a", [5, 6, 7], max_tokens=2)
    scheduler.add_request(req)
    executor = FakeExecutor.for_scheduler(scheduler, VOCAB)
    (first, first_result), (second, second_result) = two_steps_in_flight(scheduler, executor, fail_second=True)
    assert scheduler.schedule().num_requests == 0
    scheduler.update_from_result(first, first_result)
    assert len(scheduler.kv_cache_manager.block_pool.cached_blocks) == 1
    if abort:
        scheduler.abort_request("a", RequestStatus.FINISHED_STOPPED)
    scheduler.update_from_result(second, second_result)
    assert not scheduler.kv_cache_manager.block_pool.cached_blocks, "block 0 holds the failed step's garbage"
    # A request sharing those four tokens must compute them, not hit garbage (the fake checks every slot).
    scheduler.add_request(request("b", req.all_token_ids[:4] + [9], max_tokens=2))
    run_steps(scheduler, executor, overlap=True)
    audit(scheduler, executor)


def test_a_reused_request_id_never_gets_the_aborted_requests_sample():
    scheduler = make_scheduler()
    old = request("x", [5, 6, 7, 8, 9], max_tokens=8)
    scheduler.add_request(old)
    executor = FakeExecutor.for_scheduler(scheduler, VOCAB)
    (first, first_result), (second, second_result) = two_steps_in_flight(scheduler, executor)  # old x decodes in 2
    scheduler.update_from_result(first, first_result)
    scheduler.abort_request("x")  # the client cancels; step 2 still runs it
    new = request("x", [30, 31, 32], max_tokens=3)  # and reuses the id at once
    scheduler.add_request(new)
    third = scheduler.schedule()
    assert third.finished_request_ids == ["x"] and [r.request_id for r in third.new_requests] == ["x"]
    third_result = executor.execute(third)
    assert scheduler.update_from_result(second, second_result) == [], "old x's sample belongs to nobody now"
    (out,) = scheduler.update_from_result(third, third_result)
    assert out.new_token_ids == [reference_next_token([30, 31, 32], VOCAB)]
    run_steps(scheduler, executor, overlap=True)
    expected = []
    for _ in range(3):
        expected.append(reference_next_token([30, 31, 32] + expected, VOCAB))
    assert new.output_token_ids == expected
    audit(scheduler, executor)
