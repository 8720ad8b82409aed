"""The executor's request table (executor_svc/request_table.py): how a plan's
deltas land, every plan it refuses and why, and, with hypothesis, that any
sequence of valid plans leaves it holding exactly what the plans said.

tests/test_plan_refusal_parity.py runs every refusal case here through
ModelRunner and the fake executor too."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from executor_svc.request_table import PlanError, RequestTable
from shared.sampling_params import SamplingParams
from shared.step_plan import CachedRequestData, NewRequestData, StepPlan
from shared.token_mask import mask_width_bytes, pack_allowed

BLOCK, NUM_BLOCKS, VOCAB = 4, 16, 8
GREEDY = SamplingParams(temperature=0.0)


def new(rid: str, tokens: list[int], blocks: list[int], computed: int = 0, scheduled: int | None = None, prompt=None):
    n = len(tokens) if prompt is None else prompt
    return NewRequestData(
        rid, tokens, n, GREEDY, blocks, computed, len(tokens) - computed if scheduled is None else scheduled
    )


def cached(*rows: tuple[str, list[int], int, int]) -> CachedRequestData:
    """rows of (request id, new block ids, num computed, num scheduled)."""
    return CachedRequestData(*(list(col) for col in zip(*rows))) if rows else CachedRequestData()


def held_a() -> RequestTable:
    """A table holding "a": prompt [1, 2, 3] prefilled in block 1, token 5 sampled (4 tokens, 3 computed)."""
    table = RequestTable(BLOCK, NUM_BLOCKS, VOCAB)
    batch = table.apply(StepPlan(1, [new("a", [1, 2, 3], [1])]))
    table.mark_computed(batch)
    table.append_sampled(batch, [5])
    return table


def test_the_table_imports_neither_torch_nor_protobuf():
    code = "import sys, executor_svc.request_table; print(sorted(m for m in sys.modules if m.split('.')[0] in "
    code += "('torch', 'numpy', 'google', 'grpc', 'pagedserve')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# -- applying plans ---------------------------------------------------------------


def test_a_new_request_is_held_whole_and_samples_when_its_tokens_are_all_scheduled():
    table = RequestTable(BLOCK, NUM_BLOCKS, VOCAB)
    batch = table.apply(StepPlan(1, [new("a", [1, 2, 3, 4, 5], [1, 2]), new("b", [6, 7, 1, 2, 3], [3, 4], 0, 4)]))
    assert [(s.request_id, n) for s, n in batch.rows] == [("a", 5), ("b", 4)]
    assert batch.sample_rows == [0], "b's chunk ends before its prompt does"
    assert batch.written_blocks == {1: "a", 2: "a", 3: "b"}
    a = table.requests["a"]
    assert (a.token_ids, a.block_ids, a.num_computed_tokens) == ([1, 2, 3, 4, 5], [1, 2], 0)
    table.mark_computed(batch)
    table.append_sampled(batch, [6])
    assert (a.token_ids, a.output_token_ids, a.num_computed_tokens) == ([1, 2, 3, 4, 5, 6], [6], 5)
    assert table.requests["b"].num_computed_tokens == 4


def test_a_cached_request_gets_its_appended_blocks_and_decodes_its_own_sample():
    table = held_a()
    batch = table.apply(StepPlan(2, cached_requests=cached(("a", [], 3, 1))))
    assert batch.sample_rows == [0] and batch.written_blocks == {1: "a"}
    table.mark_computed(batch)
    table.append_sampled(batch, [6])
    batch = table.apply(StepPlan(3, cached_requests=cached(("a", [7], 4, 1))))
    a = table.requests["a"]
    assert (a.token_ids, a.block_ids) == ([1, 2, 3, 5, 6], [1, 7]) and batch.written_blocks == {7: "a"}


def test_finished_ids_are_forgotten_before_new_requests_so_a_preempted_request_can_resume_in_one_plan():
    table = held_a()
    batch = table.apply(StepPlan(2, [new("a", [1, 2, 3, 5], [9], prompt=3)], finished_request_ids=["a"]))
    a = table.requests["a"]
    assert (a.block_ids, a.num_computed_tokens, a.output_token_ids) == ([9], 0, [5])
    assert batch.unknown_finished_ids == []


def test_forgetting_a_request_not_held_is_no_refusal_but_is_reported():
    table = held_a()
    batch = table.apply(StepPlan(2, cached_requests=cached(("a", [], 3, 1)), finished_request_ids=["ghost"]))
    assert batch.unknown_finished_ids == ["ghost"] and list(table.requests) == ["a"]


def test_a_plan_made_before_a_failed_step_is_stale_and_its_requests_are_forgotten():
    table = held_a()
    table.apply(StepPlan(2, [new("b", [1], [2])]))
    assert table.drop_failed_step(StepPlan(2, [new("b", [1], [2])])) == ["b"]
    assert list(table.requests) == ["a"] and table.last_failed_step_id == 2
    stale = StepPlan(3, [new("c", [1], [3])], cached(("a", [], 3, 1)), last_result_step_id=1)
    assert table.refuse_if_stale(stale) == "stale plan: made before step 2 failed; its requests will be recomputed"
    assert table.requests == {}, "a, which the stale plan scheduled, is forgotten"
    assert table.refuse_if_stale(StepPlan(4, [new("a", [1], [1])], last_result_step_id=3)) == ""
    table.clear()
    assert table.last_failed_step_id == 0


# -- refused plans ----------------------------------------------------------------
# Each runs after held_a()'s step 1; "a" holds 4 tokens, 3 computed, in block 1.

MASK = pack_allowed([1], VOCAB)
REFUSED = {
    "misaligned cached arrays": (
        StepPlan(2, cached_requests=CachedRequestData(["a"], [[], []], [3], [1])),
        "cached_requests arrays must be aligned, one entry per request; got "
        "request_ids: 1, new_block_ids: 2, num_computed_tokens: 1, num_scheduled_tokens: 1",
    ),
    "new request already held": (StepPlan(2, [new("a", [1], [2])]), "new request 'a' is already known"),
    "no prompt": (
        StepPlan(2, [new("x", [1, 2], [2], prompt=0)]),
        "new request 'x': num_prompt_tokens 0 is not in 1..2",
    ),
    "prompt longer than the tokens": (
        StepPlan(2, [new("x", [1, 2], [2], prompt=3)]),
        "new request 'x': num_prompt_tokens 3 is not in 1..2",
    ),
    "negative computed count": (
        StepPlan(2, [new("x", [1, 2], [2], computed=-1, scheduled=2)]),
        "new request 'x': num_computed_tokens -1 is negative",
    ),
    "token past the vocabulary": (
        StepPlan(2, [new("x", [1, VOCAB], [2])]),
        f"new request 'x': token id {VOCAB} is outside the vocabulary (0..{VOCAB - 1})",
    ),
    "negative token": (
        StepPlan(2, [new("x", [-1, 2], [2])]),
        f"new request 'x': token id -1 is outside the vocabulary (0..{VOCAB - 1})",
    ),
    "the null block": (StepPlan(2, [new("x", [1], [0])]), "request 'x': block id 0 is out of range 1..15"),
    "a block past the cache": (
        StepPlan(2, [new("x", [1], [NUM_BLOCKS])]),
        "request 'x': block id 16 is out of range 1..15",
    ),
    "a new block table holding a block twice": (
        StepPlan(2, [new("x", [1, 2, 3, 4, 5], [2, 2])]),
        "request 'x': its block table would hold a block twice",
    ),
    "appending a block already held": (
        StepPlan(2, cached_requests=cached(("a", [1], 3, 1))),
        "request 'a': its block table would hold a block twice",
    ),
    "unknown cached request": (
        StepPlan(2, cached_requests=cached(("ghost", [], 0, 1))),
        "cached request 'ghost' is unknown to the executor",
    ),
    "computed count differs": (
        StepPlan(2, cached_requests=cached(("a", [], 2, 1))),
        "request 'a': plan says 2 computed tokens, executor has 3",
    ),
    "scheduled twice as cached": (
        StepPlan(2, cached_requests=cached(("a", [], 3, 1), ("a", [], 3, 1))),
        "request 'a' is scheduled twice in step 2",
    ),
    "scheduled as new and as cached": (
        StepPlan(2, [new("x", [1], [2])], cached(("x", [], 0, 1))),
        "request 'x' is scheduled twice in step 2",
    ),
    "nothing scheduled": (
        StepPlan(2, cached_requests=cached(("a", [], 3, 0))),
        "request 'a': scheduling 0 tokens from 3 but only 4 are known",
    ),
    "scheduled past the known tokens": (
        StepPlan(2, cached_requests=cached(("a", [], 3, 2))),
        "request 'a': scheduling 2 tokens from 3 but only 4 are known",
    ),
    "too few blocks": (
        StepPlan(2, [new("x", [1, 2, 3, 4, 5], [2])]),
        "request 'x': 1 blocks cannot hold 5 tokens",
    ),
    "one block written by two requests": (
        StepPlan(2, [new("x", [1, 2, 3], [1])], cached(("a", [], 3, 1))),
        "block 1 is written by both 'x' and 'a' in one step",
    ),
    "a mask for a request that does not sample": (
        StepPlan(2, [new("x", [1, 2, 3], [2], 0, 2)], allowed_token_masks={"x": MASK}),
        "allowed-token masks for requests that do not sample this step: ['x']",
    ),
    "a mask of the wrong width": (
        StepPlan(2, cached_requests=cached(("a", [], 3, 1)), allowed_token_masks={"a": MASK * 2}),
        f"request 'a': allowed-token mask of 8 bytes; a {VOCAB}-token vocabulary takes {mask_width_bytes(VOCAB)}",
    ),
}


@pytest.mark.parametrize(("plan", "message"), REFUSED.values(), ids=REFUSED.keys())
def test_the_table_refuses_a_plan_that_contradicts_it_or_itself(plan, message):
    table = held_a()
    with pytest.raises(PlanError) as refused:
        table.apply(plan)
    assert str(refused.value) == message


# -- any valid plan sequence --------------------------------------------------------


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_valid_plan_sequences_keep_the_table_holding_what_they_said(data):
    """A small scheduler drives the table: arrivals, chunked prefill, decodes,
    finishes, preemptions (resent whole, in the plan that forgets them) and
    failed steps; after each step the table holds exactly its running requests."""
    table = RequestTable(BLOCK, NUM_BLOCKS, VOCAB)
    free = list(range(1, NUM_BLOCKS))
    # request id -> [tokens, num prompt tokens, blocks, computed, held by the table]
    live: dict[str, list] = {}
    draw = data.draw
    for step in range(1, draw(st.integers(1, 25)) + 1):
        for i in range(draw(st.integers(0, 2))):
            prompt = draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12))
            live[f"r{step}.{i}"] = [prompt, len(prompt), [], 0, False]
        finished = []
        for rid in draw(st.lists(st.sampled_from(sorted(live)), unique=True)) if live else []:
            tokens, _, blocks, _, held = live[rid]
            if draw(st.booleans()):
                del live[rid]  # finished or aborted
            else:
                live[rid][2:] = [[], 0, False]  # preempted: recomputed from prompt + outputs
            free += blocks
            if held:
                finished.append(rid)
        plan = StepPlan(step, finished_request_ids=finished, last_result_step_id=step - 1)
        scheduled = []
        for rid, (tokens, num_prompt, blocks, computed, held) in live.items():
            if computed == len(tokens) or not draw(st.booleans()):
                continue
            n = draw(st.integers(1, len(tokens) - computed))
            need = -(-(computed + n) // BLOCK) - len(blocks)
            if need > len(free):
                continue
            added = [free.pop(draw(st.integers(0, len(free) - 1))) for _ in range(need)]
            blocks += added
            if held:
                plan.cached_requests.request_ids.append(rid)
                plan.cached_requests.new_block_ids.append(added)
                plan.cached_requests.num_computed_tokens.append(computed)
                plan.cached_requests.num_scheduled_tokens.append(n)
            else:
                plan.new_requests.append(NewRequestData(rid, list(tokens), num_prompt, GREEDY, list(blocks), 0, n))
            scheduled.append((rid, n))
        assert table.refuse_if_stale(plan) == ""
        batch = table.apply(plan)
        c = plan.cached_requests
        rows = [(r.request_id, r.num_scheduled_tokens) for r in plan.new_requests]
        rows += list(zip(c.request_ids, c.num_scheduled_tokens))
        assert [(s.request_id, n) for s, n in batch.rows] == rows and sorted(rows) == sorted(scheduled)
        assert batch.unknown_finished_ids == []
        if scheduled and draw(st.integers(0, 9)) == 0:  # the step fails: the scheduler recomputes its requests
            table.drop_failed_step(plan)
            for rid, _ in scheduled:
                free += live[rid][2]
                live[rid][2:] = [[], 0, False]
            continue
        table.mark_computed(batch)
        samples = [draw(st.integers(0, VOCAB - 1)) for _ in batch.sample_rows]
        table.append_sampled(batch, samples)
        sampled = {batch.rows[i][0].request_id: t for i, t in zip(batch.sample_rows, samples)}
        for rid, n in scheduled:
            entry = live[rid]
            entry[3] += n
            entry[4] = True
            assert (rid in sampled) == (entry[3] == len(entry[0]))
            if rid in sampled:
                entry[0].append(sampled[rid])

        held = {rid: e for rid, e in live.items() if e[4]}
        assert set(table.requests) == set(held)
        for rid, (tokens, num_prompt, blocks, computed, _) in held.items():
            state = table.requests[rid]
            assert (state.token_ids, state.num_prompt_tokens, state.block_ids, state.num_computed_tokens) == (
                tokens,
                num_prompt,
                blocks,
                computed,
            )
        all_blocks = [b for s in table.requests.values() for b in s.block_ids]
        assert len(set(all_blocks)) == len(all_blocks) and set(all_blocks).isdisjoint(free)
        assert all(0 < b < NUM_BLOCKS for b in all_blocks)
