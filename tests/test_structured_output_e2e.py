"""Structured output through the real engine (SmolLM2, llguidance): property tests with seeded
temperature-1 sampling, and the engine features around it (n > 1, preemption with a small
KV cache, stop strings, max_tokens, a killed executor, compile errors and timeouts).
"""

from __future__ import annotations

import concurrent.futures
import json
import re
import signal
import string
import threading
import time

import grpc
import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from servers import Servers

from pagedserve.v1 import generation_pb2 as pb
from pagedserve.v1 import generation_pb2_grpc as pb_grpc

pytestmark = pytest.mark.e2e

PROMPT = "Reply with JSON describing a person, a city or a list of numbers."
SETTINGS = settings(
    max_examples=10,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

# -- a strategy of small JSON schemas ---------------------------------------------------

NAMES = ["name", "age", "city", "tags", "ok", "score", "kind", "items"]
leaf = st.one_of(
    st.builds(
        lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
        st.integers(-50, 50),
        st.integers(0, 500),
    ),
    st.just({"type": "boolean"}),
    st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(1, 8)),
    st.lists(st.text(string.ascii_lowercase, min_size=1, max_size=6), min_size=1, max_size=4, unique=True).map(
        lambda e: {"enum": e}
    ),
    st.just({"type": "null"}),
)


def _object(children):
    return st.dictionaries(st.sampled_from(NAMES), children, min_size=1, max_size=3).flatmap(
        lambda props: st.sets(st.sampled_from(sorted(props))).map(
            lambda req: {"type": "object", "properties": props, "required": sorted(req), "additionalProperties": False}
        )
    )


def _array(children):
    return st.builds(lambda items, hi: {"type": "array", "items": items, "maxItems": hi}, children, st.integers(0, 3))


schemas = st.recursive(leaf, lambda children: _object(children) | _array(children), max_leaves=5).filter(
    lambda s: s.get("type") in ("object", "array")
)


# -- the engine ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def servers():
    # ~0.03 GiB of float32 KV (about 40 blocks of 16) and 64-token chunks: bursts preempt and
    # recompute. float32, not --dtype auto: where auto picks bfloat16 (CPUs with AVX512-BF16)
    # the same budget holds twice the blocks and nothing preempts, and a recomputed stream is
    # only likely to match an uninterrupted one in float32 (docs/determinism.md).
    with Servers(
        executor_args=["--dtype", "float32", "--kv-cache-gib", "0.03"],
        scheduler_args=["--max-num-batched-tokens", "64", "--watermark", "0", "--executor-recovery-timeout", "300"],
    ) as s:
        yield s


@pytest.fixture(scope="module")
def stub(servers):
    with grpc.insecure_channel(servers.public_addr) as channel:
        yield pb_grpc.GenerationStub(channel)


def generate(
    stub,
    constraint: pb.OutputConstraint | None,
    *,
    seed=0,
    n=1,
    max_tokens=80,
    stop=(),
    temperature=1.0,
    on_response=None,
):
    """{index: (text, finish_reason, matched_stop, completion_tokens)}; `on_response(r)` sees each streamed chunk."""
    req = pb.GenerateRequest(
        chat=pb.Chat(messages=[pb.ChatMessage(role="user", content=PROMPT)]),
        sampling=pb.SamplingParams(temperature=temperature, seed=seed, n=n),
        stopping=pb.StoppingCriteria(max_tokens=max_tokens, stop=list(stop)),
        constraint=constraint,
    )
    texts: dict[int, str] = {}
    done = {}
    for r in stub.Generate(req, timeout=120):
        if on_response is not None:
            on_response(r)
        texts[r.index] = texts.get(r.index, "") + r.text
        if r.finish_reason:
            done[r.index] = (texts[r.index], r.finish_reason, r.matched_stop, r.usage.completion_tokens)
    return done


@SETTINGS
@given(schema=schemas, seed=st.integers(0, 2**32))
def test_every_completed_output_validates_against_its_schema(stub, schema, seed):
    outs = generate(stub, pb.OutputConstraint(json_schema=json.dumps(schema)), seed=seed, n=2)
    for text, finish, _, _ in outs.values():
        if finish == pb.FINISH_REASON_STOP:
            jsonschema.validate(json.loads(text), schema)
        else:
            assert finish == pb.FINISH_REASON_LENGTH


REGEXES = [
    r"[0-9]{3}-[0-9]{4}",
    r"(yes|no), because [a-z ]{1,20}\.",
    r"[A-Z][a-z]{2,8} [0-9]{1,2}(st|nd|rd|th)",
    r"#[0-9a-f]{6}",
    r"\d{1,6}(\.\d{1,3})?",
]


@SETTINGS
@given(regex=st.sampled_from(REGEXES), seed=st.integers(0, 2**32))
def test_every_regex_output_matches(stub, regex, seed):
    for text, finish, _, _ in generate(stub, pb.OutputConstraint(regex=regex), seed=seed, n=2, max_tokens=40).values():
        assert finish == pb.FINISH_REASON_STOP and re.fullmatch(regex, text), (regex, text)


@SETTINGS
@given(
    choices=st.lists(
        st.text(string.ascii_letters + " ,.!-\"'", min_size=1, max_size=12), min_size=1, max_size=5, unique=True
    ),
    seed=st.integers(0, 2**32),
)
def test_every_choice_output_is_one_of_the_choices(stub, choices, seed):
    outs = generate(stub, pb.OutputConstraint(choice=pb.Choices(choices=choices)), seed=seed, n=3)
    assert all(text in choices and finish == pb.FINISH_REASON_STOP for text, finish, _, _ in outs.values()), outs


def test_a_grammar_that_never_ends_stops_at_max_tokens_with_length(stub):
    never_ends = pb.Grammar(syntax=pb.Grammar.SYNTAX_LARK, source='start: x\nx: ("a" | "b" | "ab") x')
    [(text, finish, _, count)] = generate(stub, pb.OutputConstraint(grammar=never_ends), max_tokens=9).values()
    assert finish == pb.FINISH_REASON_LENGTH and count == 9 and set(text) <= {"a", "b"}


def test_json_object_gbnf_and_greedy_outputs(stub):
    outs = generate(stub, pb.OutputConstraint(json_object=True), temperature=0.0, max_tokens=120)
    text, finish, _, _ = outs[0]
    if finish == pb.FINISH_REASON_STOP:
        assert isinstance(json.loads(text), dict)
    else:
        assert text.startswith("{")
    gbnf = pb.Grammar(syntax=pb.Grammar.SYNTAX_GBNF, source='root ::= "The answer is " [0-9]+ "."')
    [(text, finish, _, _)] = generate(stub, pb.OutputConstraint(grammar=gbnf)).values()
    assert finish == pb.FINISH_REASON_STOP and re.fullmatch(r"The answer is [0-9]+\.", text), text


def test_a_stop_string_still_ends_a_constrained_output(stub):
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 6}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    [(text, finish, matched, _)] = generate(
        stub, pb.OutputConstraint(json_schema=json.dumps(schema)), stop=['"age"']
    ).values()
    assert (
        finish == pb.FINISH_REASON_STOP
        and matched == '"age"'
        and text.lstrip("{ \n").startswith('"name"')
        and "age" not in text
    )


def test_bad_constraints_are_refused_at_once_with_the_compilers_message(stub):
    cases = [
        (pb.OutputConstraint(json_schema='{"type": "objec"}'), "constraint.json_schema", "objec"),
        (pb.OutputConstraint(json_schema='{"type": '), "constraint.json_schema", "not valid JSON"),
        # Deeper than Python's JSON parser recurses (a RecursionError, not a ValueError).
        (pb.OutputConstraint(json_schema="[" * 100_000 + "]" * 100_000), "constraint.json_schema", "too deeply"),
        (pb.OutputConstraint(regex="(a"), "constraint.regex", "unclosed group"),
        (
            pb.OutputConstraint(grammar=pb.Grammar(syntax=pb.Grammar.SYNTAX_LARK, source="start: nope")),
            "constraint.grammar.source",
            "nope",
        ),
        (pb.OutputConstraint(choice=pb.Choices()), "constraint.choice.choices", "between 1"),
    ]
    for constraint, field, words in cases:
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            generate(stub, constraint)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details().startswith(field) and words in err.value.details(), err.value.details()
        assert time.monotonic() - t0 < 2.0


def test_logit_bias_forces_and_bans_tokens(stub):
    req = pb.GenerateRequest(
        text="The capital of France is",
        sampling=pb.SamplingParams(temperature=0.0),
        stopping=pb.StoppingCriteria(max_tokens=4),
    )
    plain = [t for r in stub.Generate(req) for t in r.token_ids]
    req.sampling.logit_bias[plain[0]] = -100.0
    req.sampling.logit_bias[42] = 100.0
    biased = [t for r in stub.Generate(req) for t in r.token_ids]
    assert biased == [42] * 4 != plain
    req.sampling.logit_bias[10**6] = 1.0
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(req))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "sampling.logit_bias" in err.value.details()


def test_a_burst_under_preemption_and_a_prefix_cache_stays_valid(servers, stub):
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}, "population": {"type": "integer", "minimum": 0}},
        "required": ["city", "population"],
        "additionalProperties": False,
    }
    before = stub.GetServerStatus(pb.GetServerStatusRequest())
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(
            pool.map(
                lambda seed: generate(stub, pb.OutputConstraint(json_schema=json.dumps(schema)), seed=seed, n=2),
                range(8),
            )
        )
    after = stub.GetServerStatus(pb.GetServerStatusRequest())
    assert after.num_preemptions > before.num_preemptions, "the small KV cache was meant to force preemption"
    assert after.prefix_cache_hits_tokens > before.prefix_cache_hits_tokens
    completed = [text for outs in results for text, finish, _, _ in outs.values() if finish == pb.FINISH_REASON_STOP]
    assert len(completed) >= 8
    for text in completed:
        jsonschema.validate(json.loads(text), schema)


@pytest.mark.slow  # restarts the executor
def test_a_killed_executor_resumes_constrained_streams_identically(servers, stub):
    """Seeded draws depend only on (seed, position) and the mask only on the tokens so far, so a
    stream recomputed after an executor loss (the matcher never saw the lost samples) is identical."""
    schema = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99999}, "maxItems": 30}
    constraint = pb.OutputConstraint(json_schema=json.dumps(schema))
    reference = [generate(stub, constraint, seed=seed, max_tokens=60) for seed in range(3)]
    # Kill as soon as every stream has its first tokens (not after a fixed
    # sleep: with one-call decode steps all three once finished within 1 s).
    started = [threading.Event() for _ in range(3)]
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        futures = [
            pool.submit(
                generate, stub, constraint, seed=seed, max_tokens=60, on_response=lambda r, e=started[seed]: e.set()
            )
            for seed in range(3)
        ]
        assert all(e.wait(60) for e in started), "a stream never started"
        servers.executor.send_signal(signal.SIGKILL)
        servers.executor.wait()
        assert not all(f.done() for f in futures), "the kill came too late to interrupt anything"
        servers.start_executor()
        resumed = [f.result(timeout=120) for f in futures]
    assert resumed == reference
