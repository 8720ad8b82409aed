"""Structured output, below the processes: mask packing and application, logit bias, the
step codec, and the scheduler's matcher bookkeeping with the fake executor.

The scheduler tests use a fake grammar (`StepGrammar`): after k tokens only ids
congruent to k mod 7 are allowed, and it is complete after `length` tokens,
so every output can be checked against it and any desync between matcher and
outputs shows. Real grammars (llguidance) are in test_structured_output_e2e.py.
"""

from __future__ import annotations

import asyncio
import math
import time

import pytest
import torch
from fake_executor import FakeExecutor, Pipeline, audit, run_steps
from hypothesis import given, settings
from hypothesis import strategies as st

from executor_svc.logit_edits import apply_logit_edits, build_logit_edits
from scheduler_svc.request import Request, RequestStatus
from scheduler_svc.scheduler import Scheduler
from scheduler_svc.scheduler_config import SchedulerConfig
from shared import step_codec
from shared.sampling_params import SamplingParams
from shared.step_plan import StepPlan
from shared.token_mask import mask_width_bytes, pack_allowed, unpack_allowed

VOCAB = 100
EOS = 0
MOD = 7


# -- packing and applying masks ----------------------------------------------------


@given(st.integers(1, 300).flatmap(lambda v: st.tuples(st.just(v), st.sets(st.integers(0, v - 1)))))
def test_packed_mask_round_trips_and_has_the_uint32_layout(case):
    vocab, allowed = case
    row = pack_allowed(allowed, vocab)
    assert len(row) == mask_width_bytes(vocab) == 4 * math.ceil(vocab / 32)
    assert unpack_allowed(row, vocab) == sorted(allowed)
    words = [int.from_bytes(row[i : i + 4], "little") for i in range(0, len(row), 4)]
    assert {32 * w + b for w, word in enumerate(words) for b in range(32) if word >> b & 1} == allowed


@settings(max_examples=50, deadline=None)
@given(st.data())
def test_masks_and_bias_edit_only_their_rows_and_tokens(data):
    vocab = data.draw(st.integers(1, 70))
    rows = data.draw(st.integers(1, 5))
    logits = torch.randn(rows, vocab)
    original = logits.clone()
    masks = [data.draw(st.none() | st.sets(st.integers(0, vocab - 1), min_size=1)) for _ in range(rows)]
    biases = [
        data.draw(st.dictionaries(st.integers(0, vocab - 1), st.floats(-100, 100), max_size=4)) for _ in range(rows)
    ]
    params = [SamplingParams(logit_bias=tuple(sorted(b.items()))) for b in biases]
    edits = build_logit_edits(params, [None if m is None else pack_allowed(m, vocab) for m in masks], vocab, "cpu")
    if all(m is None for m in masks) and not any(biases):
        assert edits is None
        return
    out = apply_logit_edits(logits, edits)
    assert torch.equal(logits, original), "the caller's logits were modified"
    for r in range(rows):
        for t in range(vocab):
            expected = original[r, t] + biases[r].get(t, 0.0)
            if masks[r] is not None and t not in masks[r]:
                expected = -math.inf
            assert out[r, t].item() == pytest.approx(float(expected), abs=1e-4)


def test_masked_argmax_and_sampling_pick_only_allowed_tokens():
    from executor_svc.sampler import Sampler, build_sampling_metadata

    vocab = 64
    logits = torch.randn(4, vocab)
    logits[:, 5] = 50.0  # the model's clear favourite, disallowed below
    allowed = [{1, 2}, {63}, {5, 7}, {9, 10, 11}]
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, seed=3),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.5, top_p=0.9, seed=4),
    ]
    edits = build_logit_edits(params, [pack_allowed(a, vocab) for a in allowed], vocab, "cpu")
    md = build_sampling_metadata(params, [[1]] * 4, [[]] * 4, vocab, "cpu")
    tokens = Sampler()(apply_logit_edits(logits, edits), md).sampled_token_ids.tolist()
    assert [t in a for t, a in zip(tokens, allowed)] == [True] * 4
    assert tokens[2] == 5


def test_step_codec_carries_masks_and_logit_bias():
    sampling = SamplingParams(logit_bias=((3, -100.0), (9, 2.5)))
    plan = StepPlan(step_id=3, allowed_token_masks={"a": pack_allowed({1, 99}, VOCAB), "b": pack_allowed({0}, VOCAB)})
    back = step_codec.plan_from_proto(step_codec.plan_to_proto(plan))
    assert back.allowed_token_masks == plan.allowed_token_masks
    assert step_codec.sampling_from_proto(step_codec.sampling_to_proto(sampling)) == sampling
    assert step_codec.plan_from_proto(step_codec.plan_to_proto(StepPlan(step_id=4))).allowed_token_masks == {}


# -- scheduler bookkeeping ------------------------------------------------------------


class StepGrammar:
    """Duck-types scheduler_svc.grammar.GrammarMatcher: token k must be = k (mod 7); complete after `length`."""

    def __init__(self, length: int) -> None:
        self.length = length
        self.num_tokens = 0
        self.error = ""

    def bitmask(self) -> bytes:
        return pack_allowed([t for t in range(1, VOCAB) if t % MOD == self.num_tokens % MOD], VOCAB)

    def consume(self, token_id: int) -> bool:
        ok = token_id % MOD == self.num_tokens % MOD and not self.is_stopped
        self.num_tokens += 1
        self.error = "" if ok else f"token {token_id} refused"
        return ok

    @property
    def is_stopped(self) -> bool:
        return self.num_tokens >= self.length


def make_scheduler(num_blocks=64, **overrides) -> Scheduler:
    config = dict(
        num_blocks=num_blocks, block_size=4, max_model_len=64, max_num_batched_tokens=32, max_num_seqs=8, watermark=0.0
    )
    config.update(overrides)
    return Scheduler(SchedulerConfig(**config))


def request(rid: str, prompt, max_tokens: int, grammar_length: int | None = None) -> Request:
    grammar = None if grammar_length is None else StepGrammar(grammar_length)
    return Request(
        rid,
        list(prompt),
        SamplingParams(temperature=0.0),
        max_tokens=max_tokens,
        eos_token_ids=frozenset({EOS}),
        grammar=grammar,
    )


def check_follows_grammar(tokens: list[int]) -> None:
    assert [t % MOD for t in tokens] == [k % MOD for k in range(len(tokens))], tokens


@pytest.mark.parametrize("overlap", [False, True])
def test_constrained_outputs_follow_the_grammar_and_finish_when_complete(overlap):
    s = make_scheduler()
    reqs = [
        request("c0", [3, 4, 5], max_tokens=30, grammar_length=6),
        request("c1", [8, 9], max_tokens=4, grammar_length=9),
        request("u", [3, 4, 5], max_tokens=10),
    ]
    for r in reqs:
        s.add_request(r)
    out = run_steps(s, FakeExecutor.for_scheduler(s, VOCAB), overlap=overlap)
    check_follows_grammar(out["c0"])
    assert len(out["c0"]) == 6 and reqs[0].status == RequestStatus.FINISHED_STOPPED and reqs[0].stop_token_id is None
    check_follows_grammar(out["c1"])
    assert len(out["c1"]) == 4 and reqs[1].status == RequestStatus.FINISHED_LENGTH  # max_tokens mid-structure
    assert all(r.grammar is None or r.grammar.num_tokens == r.num_output_tokens for r in reqs)


def test_constrained_requests_run_in_lockstep_and_unconstrained_ones_are_not_delayed():
    """With overlap, a constrained request sits out every plan made while its sample is in flight;
    the unconstrained request beside it is planned every step, exactly as without it."""

    def run(with_constrained: bool):
        s = make_scheduler()
        s.add_request(request("u", [3, 4, 5], max_tokens=12))
        if with_constrained:
            s.add_request(request("c", [6, 7], max_tokens=12, grammar_length=100))
        pipe = Pipeline(s, FakeExecutor.for_scheduler(s, VOCAB), depth=2)
        plans, tokens = [], {}
        while s.has_unfinished_requests() or pipe.in_flight:
            for o in pipe.step(on_plan=plans.append):
                tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
        return plans, tokens

    alone, tokens_alone = run(False)
    plans, tokens = run(True)
    assert tokens["u"] == tokens_alone["u"]
    steps_with_u = [p.step_id for p in plans if "u" in _ids(p)]
    assert steps_with_u == [p.step_id for p in alone if "u" in _ids(p)]
    with_c = [p for p in plans if "c" in _ids(p)]
    assert len(with_c) == 12
    # Lockstep: never two plans with c in a row (the one behind its pending sample skips it).
    ids = [p.step_id for p in with_c]
    assert all(b - a >= 2 for a, b in zip(ids, ids[1:]))
    assert all(set(p.allowed_token_masks) == ({"c"} if "c" in _ids(p) else set()) for p in plans if p.num_requests)
    check_follows_grammar(tokens["c"])


def _ids(plan: StepPlan) -> set[str]:
    return {r.request_id for r in plan.new_requests} | set(plan.cached_requests.request_ids)


@pytest.mark.parametrize("overlap", [False, True])
def test_matcher_survives_preemption_and_recompute(overlap):
    s = make_scheduler(
        num_blocks=9, max_model_len=24
    )  # 8 usable blocks of 4: the three (20 tokens each) cannot all fit
    reqs = [request(f"c{i}", [10 + i] * 6, max_tokens=14, grammar_length=100) for i in range(3)]
    for r in reqs:
        s.add_request(r)
    out = run_steps(s, FakeExecutor.for_scheduler(s, VOCAB), overlap=overlap)
    assert s.num_preemptions > 0
    for r in reqs:
        check_follows_grammar(out[r.request_id])
        assert len(out[r.request_id]) == 14 and r.grammar.num_tokens == 14


def test_matcher_stays_in_step_after_a_failed_step_and_an_executor_loss():
    s = make_scheduler()
    executor = FakeExecutor.for_scheduler(s, VOCAB)
    reqs = [request("c", [3, 4, 5], max_tokens=10, grammar_length=100), request("u", [5, 6], max_tokens=10)]
    for r in reqs:
        s.add_request(r)
    pipe = Pipeline(s, executor, depth=2)
    tokens: dict[str, list[int]] = {}

    def pump(n):
        for _ in range(n):
            for o in pipe.step():
                tokens.setdefault(o.request_id, []).extend(o.new_token_ids)

    pump(5)
    executor.fail_next_step(failed_request_ids=[])  # nobody aborted: all recomputed
    pump(4)
    assert reqs[0].grammar.num_tokens == reqs[0].num_output_tokens
    # The executor is lost with a plan in flight: its sample is dropped, never consumed.
    s.reset_for_executor_loss()
    pipe.in_flight.clear()
    executor.requests.clear()
    assert reqs[0].grammar.num_tokens == reqs[0].num_output_tokens
    while s.has_unfinished_requests() or pipe.in_flight:
        pump(1)
        audit(s)
    check_follows_grammar(tokens["c"])
    assert len(tokens["c"]) == 10 == reqs[0].grammar.num_tokens


def test_a_token_the_grammar_refuses_aborts_only_that_request_with_an_error():
    s = make_scheduler()
    c, u = request("c", [3, 4, 5], max_tokens=5, grammar_length=100), request("u", [3, 4], max_tokens=5)
    s.add_request(c)
    s.add_request(u)
    executor = FakeExecutor.for_scheduler(s, VOCAB)
    plan = s.schedule()
    plan.allowed_token_masks.clear()  # an executor that ignores the mask samples fp % V
    result = executor.execute(plan)
    result.sampled["c"] = 3  # surely not = 0 (mod 7)
    outs = {o.request_id: o for o in s.update_from_result(plan, result)}
    assert outs["c"].finished and outs["c"].status == RequestStatus.FINISHED_ABORTED
    assert "not allowed by the output constraint" in outs["c"].error
    assert not outs["u"].finished and "c" not in s.requests


# -- llguidance behind GrammarCompiler / GrammarMatcher ----------------------------------


@pytest.fixture(scope="module")
def tiny_compiler():
    """A GrammarCompiler over a 300-token byte-level BPE trained here (llguidance needs byte-level tokens)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from scheduler_svc.grammar import GrammarCompiler

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(['{"name": "Ada", "age": 36}', "hello world", "0123456789 yes no maybe"] * 10, trainer)
    assert tok.token_to_id("<eos>") == EOS
    compiler = GrammarCompiler(tok.to_str(), 300, [EOS], timeout_s=0.2)
    yield compiler, tok


def test_eos_is_allowed_only_where_the_output_is_complete(tiny_compiler):
    from scheduler_svc.grammar import Constraint

    compiler, tok = tiny_compiler
    m = compiler.compile_now(Constraint("regex", "ab?c?")).matcher()
    assert len(m.bitmask()) == mask_width_bytes(300)
    assert unpack_allowed(m.bitmask(), 300) == [tok.token_to_id("a")]  # nothing yet: no EOS
    assert m.consume(tok.token_to_id("a")) and not m.is_stopped
    allowed = unpack_allowed(m.bitmask(), 300)
    assert EOS in allowed and tok.token_to_id("b") in allowed  # "a" is complete, and may go on
    assert m.consume(tok.token_to_id("c")) and m.is_stopped  # nothing may follow "ac"
    assert unpack_allowed(m.bitmask(), 300) == [EOS]
    m = compiler.compile_now(Constraint("choice", ("yes", 'say "no"'))).matcher()
    assert not m.consume(tok.token_to_id("a")) and m.error and m.num_tokens == 1


@pytest.mark.parametrize("choice", ["a\x7fb", 'q"uote\\', "tab\there", "x\x85y", "héllo"])
def test_any_choice_text_compiles_to_exactly_itself(tiny_compiler, choice):
    """Quotes, backslashes and control characters, DEL included (which JSON
    leaves raw and Lark's lexer refuses), are escaped in the choice's literal."""
    from scheduler_svc.grammar import Constraint

    compiler, tok = tiny_compiler
    m = compiler.compile_now(Constraint("choice", (choice, "no"))).matcher()
    assert all(m.consume(t) for t in tok.encode(choice).ids) and m.is_stopped


def test_compiler_caches_shares_and_times_out(tiny_compiler):
    """One compile per distinct constraint (concurrent ones share it), errors cached, a slow one refused."""
    from scheduler_svc.grammar import Constraint, GrammarError, GrammarTimeout

    compiler, _ = tiny_compiler
    calls = []
    real = type(compiler).compile_now.__get__(compiler)

    def counting(c):
        calls.append(c)
        if c.spec == "slow":
            time.sleep(0.5)
        return real(c)

    compiler.compile_now = counting

    async def main():
        a = Constraint("regex", "[0-9]+")
        first, second = await asyncio.gather(compiler.compile(a), compiler.compile(a))
        assert first is second and len(calls) == 1
        for _ in range(2):
            with pytest.raises(GrammarError, match="unclosed"):
                await compiler.compile(Constraint("regex", "(a"))
        assert len(calls) == 2
        with pytest.raises(GrammarTimeout, match="--grammar-compile-timeout"):
            await compiler.compile(Constraint("regex", "slow"))
        await asyncio.sleep(0.5)  # it finished in its worker meanwhile: the next identical request gets it
        assert (await compiler.compile(Constraint("regex", "slow"))).matcher().bitmask()
        assert len(calls) == 3

    asyncio.run(main())


# The embedded model's tokenizer, a grammar whose first mask llguidance 1.9 computes
# for minutes, and beside it a plain request's stand-in: the event loop ticking.
STUCK_GRAMMAR_PROBE = """
import asyncio, sys, time
from executor_svc.model_loader import default_model_path
from executor_svc.tokenizer_info import TokenizerInfo
from scheduler_svc.grammar import Constraint, GrammarCompiler, GrammarTimeout
info = TokenizerInfo.from_gguf(default_model_path())
compiler = GrammarCompiler(info.tokenizer_json, 49152, [2], timeout_s=1.0)
async def main():
    ticks = []
    async def tick():
        while True:
            ticks.append(time.monotonic()); await asyncio.sleep(0.05)
    ticker = asyncio.ensure_future(tick())
    start = time.monotonic()
    try:
        await compiler.compile(Constraint("lark", "start: A B\\nA: /a+/\\nB: /a/"))
        print("compiled")
    except GrammarTimeout:
        print("timeout", time.monotonic() - start < 5, max(b - a for a, b in zip(ticks, ticks[1:])) < 0.5)
    ticker.cancel()
asyncio.run(main())
"""


def test_a_grammar_whose_first_mask_never_ends_is_refused_and_blocks_nothing():
    """Its first mask is computed while compiling, so the compile timeout
    refuses it and the event loop (the scheduler's step loop) runs on; the
    stuck thread is a daemon, so the process still exits."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", STUCK_GRAMMAR_PROBE], capture_output=True, text=True, timeout=120, check=True
    )
    assert done.stdout.split() == ["timeout", "True", "True"], done.stdout + done.stderr


def test_the_scheduler_with_structured_output_stays_torch_free():
    import subprocess
    import sys

    probe = (
        "import sys, scheduler_svc.__main__, scheduler_svc.grammar, scheduler_svc.server; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'triton')))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out
