"""`to_generation_input` (scheduler_svc/validation.py), a pure function, tested
directly: every invalid request raises InvalidRequest naming its field, with
the status code the gRPC edge will send, and every limit is inclusive where it
says so. tests/test_api_errors.py keeps a few of these cases end to end, to
check the edge's mapping to a status with BadRequest details."""

from __future__ import annotations

import math

import grpc
import pytest
from fake_executor import word_tokenizer_json
from hypothesis import given
from hypothesis import strategies as st

from pagedserve.v1 import generation_pb2 as pb
from pagedserve_client import build_request
from scheduler_svc.tokenizer import Tokenizer
from scheduler_svc.validation import InvalidRequest, Limits, to_generation_input
from shared.sampling_params import MAX_LOGPROBS

VOCAB = 300
LIMITS = Limits(
    vocab_size=VOCAB,
    max_model_len=64,
    max_n=16,
    max_stop_strings=16,
    max_stop_string_bytes=256,
    max_prompt_chars=64 * 16,
)
INVALID, OUT_OF_RANGE = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE
TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}w9{% endif %}"


def make_tokenizer(chat_template: str = TEMPLATE) -> Tokenizer:
    """Words "w1".."w299" are ids 1..299; a chat renders as its contents, then "w9"."""
    return Tokenizer.from_info(word_tokenizer_json(VOCAB), chat_template, "", "", False)


TOKENIZER = make_tokenizer()


def chat(messages) -> pb.GenerateRequest:
    req = pb.GenerateRequest()
    req.chat.messages.extend(pb.ChatMessage(role=r, content=c) for r, c in messages)
    return req


def with_sampling(**kw) -> pb.GenerateRequest:
    return build_request("w1 w2", **kw)


def tokens(n: int, **kw) -> pb.GenerateRequest:
    return build_request(token_ids=[5] * n, **kw)


CASES = [
    ("no prompt", pb.GenerateRequest(), INVALID, "prompt"),
    ("empty prompt", pb.GenerateRequest(text=""), INVALID, "prompt.text"),
    ("empty token ids", build_request(token_ids=[]), INVALID, "prompt.token_ids"),
    ("token id outside vocab", build_request(token_ids=[1, 2, VOCAB]), INVALID, "prompt.token_ids.ids"),
    ("prompt as long as the context", tokens(64), OUT_OF_RANGE, "prompt.token_ids"),
    ("prompt longer than context", tokens(100), OUT_OF_RANGE, "prompt.token_ids"),
    ("text prompt longer than context", build_request(" ".join(["w3"] * 64)), OUT_OF_RANGE, "prompt.text"),
    ("prompt + max_tokens beyond context", tokens(60, max_tokens=5), OUT_OF_RANGE, "stopping.max_tokens"),
    ("max_tokens zero", with_sampling(max_tokens=0), INVALID, "stopping.max_tokens"),
    ("negative temperature", with_sampling(temperature=-0.5), INVALID, "sampling.temperature"),
    ("NaN temperature", with_sampling(temperature=math.nan), INVALID, "sampling.temperature"),
    ("temperature above 100", with_sampling(temperature=100.5), INVALID, "sampling.temperature"),
    ("top_p zero", with_sampling(top_p=0.0), INVALID, "sampling.top_p"),
    ("top_p above one", with_sampling(top_p=1.5), INVALID, "sampling.top_p"),
    ("NaN top_p", with_sampling(top_p=math.nan), INVALID, "sampling.top_p"),
    ("top_k below -1", with_sampling(top_k=-2), INVALID, "sampling.top_k"),
    ("min_p above one", with_sampling(min_p=1.5), INVALID, "sampling.min_p"),
    ("negative min_p", with_sampling(min_p=-0.1), INVALID, "sampling.min_p"),
    ("repetition penalty zero", with_sampling(repetition_penalty=0.0), INVALID, "sampling.repetition_penalty"),
    ("repetition penalty above two", with_sampling(repetition_penalty=2.5), INVALID, "sampling.repetition_penalty"),
    ("presence penalty too big", with_sampling(presence_penalty=2.5), INVALID, "sampling.presence_penalty"),
    ("frequency penalty too small", with_sampling(frequency_penalty=-3.0), INVALID, "sampling.frequency_penalty"),
    ("n zero", with_sampling(n=0), INVALID, "sampling.n"),
    ("n above the maximum", with_sampling(n=17), INVALID, "sampling.n"),
    ("logprobs above the maximum", with_sampling(logprobs=MAX_LOGPROBS + 1), INVALID, "sampling.logprobs"),
    ("too many stop strings", build_request("w1", stop=[f"s{i}" for i in range(17)]), INVALID, "stopping.stop"),
    ("stop string too long", build_request("w1", stop=["x" * 257]), INVALID, "stopping.stop[0]"),
    ("stop string too long in bytes", build_request("w1", stop=["ok", "é" * 129]), INVALID, "stopping.stop[1]"),
    ("empty stop string", build_request("w1", stop=[""]), INVALID, "stopping.stop[0]"),
    ("min_tokens above max_tokens", with_sampling(max_tokens=4, min_tokens=5), INVALID, "stopping.min_tokens"),
    ("stop token id outside vocab", build_request("w1", stop_token_ids=[10**6]), INVALID, "stopping.stop_token_ids"),
    ("request id too long", build_request("w1", request_id="r" * 257), INVALID, "request_id"),
    ("unknown chat role", chat([("user", "w1"), ("wizard", "w2")]), INVALID, "prompt.chat.messages[1].role"),
    ("chat without messages", chat([]), INVALID, "prompt.chat.messages"),
]


@pytest.mark.parametrize(("name", "req", "code", "field"), CASES, ids=[c[0] for c in CASES])
def test_invalid_request_names_its_field_and_status(name, req, code, field):
    with pytest.raises(InvalidRequest) as info:
        to_generation_input(req, TOKENIZER, LIMITS)
    assert (info.value.field, info.value.code) == (field, code)
    assert info.value.description


def test_a_chat_needs_a_chat_template():
    with pytest.raises(InvalidRequest, match="no chat template") as info:
        to_generation_input(chat([("user", "w1")]), make_tokenizer(chat_template=""), LIMITS)
    assert info.value.field == "prompt.chat"


@pytest.mark.parametrize(
    "req",
    [
        with_sampling(temperature=0.0),
        with_sampling(temperature=100.0),
        with_sampling(top_p=1.0),
        with_sampling(top_k=-1),
        with_sampling(top_k=0),
        with_sampling(min_p=0.0),
        with_sampling(min_p=1.0),
        with_sampling(repetition_penalty=2.0),
        with_sampling(presence_penalty=-2.0),
        with_sampling(frequency_penalty=2.0),
        with_sampling(n=16),
        with_sampling(logprobs=MAX_LOGPROBS),
        with_sampling(max_tokens=4, min_tokens=4),
        build_request("w1", stop=[f"s{i}" for i in range(16)]),
        build_request("w1", stop=["x" * 256]),
        build_request("w1", stop_token_ids=[VOCAB - 1]),
        build_request(token_ids=[VOCAB - 1]),
        tokens(63),
        tokens(60, max_tokens=4),
        build_request("w1", request_id="r" * 256),
    ],
    ids=lambda r: str(r).replace("\n", " ")[:60],
)
def test_every_limit_is_inclusive(req):
    to_generation_input(req, TOKENIZER, LIMITS)


def test_defaults_and_conversion():
    got = to_generation_input(
        build_request("w1 w2 w3", request_id="abc", stop=["w7"], stop_token_ids=[4]), TOKENIZER, LIMITS
    )
    assert got.request_id == "abc" and got.prompt_token_ids == [1, 2, 3]
    assert got.max_tokens == LIMITS.max_model_len - 3, "no max_tokens: the rest of the context"
    assert got.n == 1 and got.min_tokens == 0 and got.stop == ("w7",) and got.stop_token_ids == {4}
    s = got.sampling
    assert (s.temperature, s.top_p, s.top_k, s.min_p, s.repetition_penalty, s.seed, s.logprobs) == (
        1.0,
        1.0,
        0,
        0.0,
        1.0,
        None,
        None,
    )
    assert to_generation_input(with_sampling(top_k=-1), TOKENIZER, LIMITS).sampling.top_k == 0, "-1 means off"
    assert to_generation_input(build_request("w1"), TOKENIZER, LIMITS).request_id, "an id is made up when none is sent"


def test_a_chat_renders_through_the_template():
    got = to_generation_input(chat([("system", "w4"), ("user", "w5 w6")]), TOKENIZER, LIMITS)
    assert got.prompt_token_ids == [4, 5, 6, 9]


@given(prompt_len=st.integers(1, 80), max_tokens=st.one_of(st.none(), st.integers(0, 80)))
def test_an_accepted_request_fits_the_context(prompt_len, max_tokens):
    req = tokens(prompt_len) if max_tokens is None else tokens(prompt_len, max_tokens=max_tokens)
    try:
        got = to_generation_input(req, TOKENIZER, LIMITS)
    except InvalidRequest as e:
        fits = prompt_len < LIMITS.max_model_len and (max_tokens is None or 1 <= max_tokens <= 64 - prompt_len)
        assert not fits, f"rejected a request that fits: {e}"
        return
    assert 1 <= got.max_tokens and prompt_len + got.max_tokens <= LIMITS.max_model_len
