"""Checks a public GenerateRequest and turns it into a GenerationInput.

Every rejection names the field and the limit. Nothing here has side effects:
a rejected request changes nothing in the engine, and these functions may run
in a worker thread (scheduler_svc/text_work.py).

Size limits come before any tokenizing, so an oversized prompt costs nothing:
a token_ids prompt is counted, a chat's messages are counted (every message
renders to at least one token) and a text's characters are bounded by
`max_model_len * tokenizer.max_token_chars` (no token covers more characters).
"""

from __future__ import annotations

import json
import math
import uuid
from dataclasses import dataclass

import grpc

from pagedserve.v1 import generation_pb2 as pb
from scheduler_svc.grammar import Constraint
from scheduler_svc.intake import GenerationInput
from scheduler_svc.tokenizer import Tokenizer
from shared.sampling_params import MAX_LOGPROBS, SamplingParams

CHAT_ROLES = ("system", "user", "assistant", "tool")
MAX_LOGIT_BIAS = 300  # entries, as OpenAI
MAX_CONSTRAINT_BYTES = 256 << 10  # a schema or grammar's text
MAX_CHOICES = 1024


class InvalidRequest(ValueError):
    """Bad input: mapped to a gRPC status with a BadRequest field violation."""

    def __init__(self, field: str, description: str, code: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT):
        super().__init__(f"{field}: {description}")
        self.field = field
        self.description = description
        self.code = code


@dataclass(frozen=True)
class Limits:
    vocab_size: int
    max_model_len: int
    max_n: int
    max_stop_strings: int
    max_stop_string_bytes: int
    max_prompt_chars: int  # more characters than this cannot fit max_model_len tokens
    special_tokens_in_content: bool = False  # chat content may write control tokens


def _check_range(field: str, value: float, lo: float, hi: float, lo_open: bool = False) -> None:
    if math.isnan(value) or value > hi or value < lo or (lo_open and value == lo):
        left = "(" if lo_open else "["
        raise InvalidRequest(field, f"must be in {left}{lo}, {hi}], got {value}")


def render_chat(tokenizer: Tokenizer, chat: pb.Chat, field: str, special_tokens_in_content: bool = False) -> list[int]:
    if not chat.messages:
        raise InvalidRequest(f"{field}.messages", "a chat needs at least one message")
    for i, m in enumerate(chat.messages):
        if m.role not in CHAT_ROLES:
            raise InvalidRequest(
                f"{field}.messages[{i}].role", f"unknown role {m.role!r}; expected one of {', '.join(CHAT_ROLES)}"
            )
    if not tokenizer.has_chat_template:
        raise InvalidRequest(field, "the served model has no chat template; send text or token_ids")
    add_gen = chat.add_generation_prompt if chat.HasField("add_generation_prompt") else True
    try:
        return tokenizer.encode_chat(
            [{"role": m.role, "content": m.content} for m in chat.messages],
            add_gen,
            special_tokens_in_content=special_tokens_in_content,
        )
    except ValueError as e:
        raise InvalidRequest(field, str(e)) from e


def _too_long(field: str, what: str, limits: Limits) -> InvalidRequest:
    return InvalidRequest(
        field, f"{what}: more than the model's context of {limits.max_model_len} tokens", grpc.StatusCode.OUT_OF_RANGE
    )


def check_prompt_size(req: pb.GenerateRequest, limits: Limits) -> None:
    """Rejects a prompt that cannot fit the context, without tokenizing it."""
    kind = req.WhichOneof("prompt")
    if kind == "text" and len(req.text) > limits.max_prompt_chars:
        raise _too_long("prompt.text", f"the prompt has {len(req.text)} characters", limits)
    if kind == "token_ids" and len(req.token_ids.ids) >= limits.max_model_len:
        raise _too_long("prompt.token_ids", f"the prompt has {len(req.token_ids.ids)} tokens", limits)
    if kind == "chat":
        messages = req.chat.messages
        if len(messages) >= limits.max_model_len:
            raise _too_long("prompt.chat.messages", f"the chat has {len(messages)} messages", limits)
        chars = sum(len(m.content) for m in messages)
        if chars > limits.max_prompt_chars:
            raise _too_long("prompt.chat.messages", f"the chat has {chars} characters of content", limits)


def chat_work_size(chat: pb.Chat) -> int:
    """Roughly how much work rendering and tokenizing a chat is, in characters (cheap to compute)."""
    messages = chat.messages
    return 1 << 30 if len(messages) > 16 else sum(64 + len(m.content) for m in messages)


def work_size(req: pb.GenerateRequest) -> int:
    """Roughly how much tokenizer work a request needs, in characters or ids (cheap to compute)."""
    kind = req.WhichOneof("prompt")
    if kind == "text":
        return len(req.text)
    if kind == "token_ids":
        return len(req.token_ids.ids)
    return chat_work_size(req.chat) if kind == "chat" else 0


def prompt_token_ids(req: pb.GenerateRequest, tokenizer: Tokenizer, limits: Limits) -> list[int]:
    kind = req.WhichOneof("prompt")
    if kind is None:
        raise InvalidRequest("prompt", "no prompt: set text, token_ids or chat")
    check_prompt_size(req, limits)
    if kind == "text":
        if not req.text:
            raise InvalidRequest("prompt.text", "the prompt is empty")
        ids = tokenizer.encode(req.text)
    elif kind == "token_ids":
        ids = list(req.token_ids.ids)
        bad = next((t for t in ids if t >= limits.vocab_size), None)
        if bad is not None:
            raise InvalidRequest(
                "prompt.token_ids.ids", f"token id {bad} is outside the vocabulary (size {limits.vocab_size})"
            )
    else:
        ids = render_chat(tokenizer, req.chat, "prompt.chat", limits.special_tokens_in_content)
    if not ids:
        raise InvalidRequest(f"prompt.{kind}", "the prompt has no tokens")
    if len(ids) >= limits.max_model_len:
        raise InvalidRequest(
            f"prompt.{kind}",
            f"the prompt has {len(ids)} tokens; the model's context is {limits.max_model_len} "
            "(at least one token must remain for the output)",
            grpc.StatusCode.OUT_OF_RANGE,
        )
    return ids


def sampling_params(s: pb.SamplingParams, limits: Limits) -> tuple[SamplingParams, int]:
    temperature = s.temperature if s.HasField("temperature") else 1.0
    if math.isnan(temperature) or temperature < 0 or temperature > 100:
        raise InvalidRequest("sampling.temperature", f"must be in [0, 100] (0 = greedy), got {temperature}")
    top_p = s.top_p if s.HasField("top_p") else 1.0
    _check_range("sampling.top_p", top_p, 0.0, 1.0, lo_open=True)
    top_k = s.top_k if s.HasField("top_k") else -1
    if top_k < -1:
        raise InvalidRequest("sampling.top_k", f"must be -1 (off), 0 (off) or positive, got {top_k}")
    min_p = s.min_p if s.HasField("min_p") else 0.0
    _check_range("sampling.min_p", min_p, 0.0, 1.0)
    rep = s.repetition_penalty if s.HasField("repetition_penalty") else 1.0
    _check_range("sampling.repetition_penalty", rep, 0.0, 2.0, lo_open=True)
    presence = s.presence_penalty if s.HasField("presence_penalty") else 0.0
    _check_range("sampling.presence_penalty", presence, -2.0, 2.0)
    frequency = s.frequency_penalty if s.HasField("frequency_penalty") else 0.0
    _check_range("sampling.frequency_penalty", frequency, -2.0, 2.0)
    logprobs = s.logprobs if s.HasField("logprobs") else None
    if logprobs is not None and logprobs > MAX_LOGPROBS:
        raise InvalidRequest("sampling.logprobs", f"at most {MAX_LOGPROBS}, got {logprobs}")
    n = s.n if s.HasField("n") else 1
    if n < 1 or n > limits.max_n:
        raise InvalidRequest("sampling.n", f"must be in [1, {limits.max_n}], got {n}")
    params = SamplingParams(
        temperature=temperature,
        top_p=top_p,
        top_k=max(top_k, 0),
        min_p=min_p,
        repetition_penalty=rep,
        presence_penalty=presence,
        frequency_penalty=frequency,
        seed=s.seed if s.HasField("seed") else None,
        logprobs=logprobs,
        logit_bias=logit_bias(s, limits),
    )
    return params, n


def logit_bias(s: pb.SamplingParams, limits: Limits) -> tuple[tuple[int, float], ...]:
    if len(s.logit_bias) > MAX_LOGIT_BIAS:
        raise InvalidRequest("sampling.logit_bias", f"at most {MAX_LOGIT_BIAS} entries, got {len(s.logit_bias)}")
    for token, bias in s.logit_bias.items():
        if token >= limits.vocab_size:
            raise InvalidRequest(
                "sampling.logit_bias", f"token id {token} is outside the vocabulary (size {limits.vocab_size})"
            )
        _check_range(f"sampling.logit_bias[{token}]", bias, -100.0, 100.0)
    return tuple(sorted(s.logit_bias.items()))


def _check_text(field: str, text: str) -> None:
    if not text:
        raise InvalidRequest(field, "must not be empty")
    if len(text.encode()) > MAX_CONSTRAINT_BYTES:
        raise InvalidRequest(field, f"at most {MAX_CONSTRAINT_BYTES} bytes, got {len(text.encode())}")


def output_constraint(c: pb.OutputConstraint) -> Constraint | None:
    """The request's constraint, checked for shape; the compiler checks the content later."""
    kind = c.WhichOneof("kind")
    if kind is None:
        return None
    field = f"constraint.{kind}"
    if kind == "json_schema":
        _check_text(field, c.json_schema)
        try:
            schema = json.loads(c.json_schema)
        except RecursionError as e:  # nested deeper than Python's parser recurses
            raise InvalidRequest(field, "nested too deeply to parse") from e
        except ValueError as e:
            raise InvalidRequest(field, f"not valid JSON: {e}") from e
        if not isinstance(schema, (dict, bool)):
            raise InvalidRequest(field, f"a JSON Schema is an object (or a boolean), got {type(schema).__name__}")
        return Constraint("json_schema", c.json_schema)
    if kind == "json_object":
        if not c.json_object:
            raise InvalidRequest(field, "set it to true (or leave the constraint unset)")
        return Constraint("json_object", "")
    if kind == "regex":
        _check_text(field, c.regex)
        return Constraint("regex", c.regex)
    if kind == "choice":
        choices = tuple(c.choice.choices)
        if not 1 <= len(choices) <= MAX_CHOICES:
            raise InvalidRequest(f"{field}.choices", f"between 1 and {MAX_CHOICES} choices, got {len(choices)}")
        for i, choice in enumerate(choices):
            _check_text(f"{field}.choices[{i}]", choice)
        return Constraint("choice", choices)
    syntax = {pb.Grammar.SYNTAX_LARK: "lark", pb.Grammar.SYNTAX_GBNF: "gbnf"}.get(c.grammar.syntax)
    if syntax is None:
        raise InvalidRequest(f"{field}.syntax", "set SYNTAX_LARK or SYNTAX_GBNF")
    _check_text(f"{field}.source", c.grammar.source)
    return Constraint(syntax, c.grammar.source)


def to_generation_input(req: pb.GenerateRequest, tokenizer: Tokenizer, limits: Limits) -> GenerationInput:
    if len(req.request_id) > 256:
        raise InvalidRequest("request_id", f"at most 256 characters, got {len(req.request_id)}")
    sampling, n = sampling_params(req.sampling, limits)
    st = req.stopping
    if len(st.stop) > limits.max_stop_strings:
        raise InvalidRequest("stopping.stop", f"at most {limits.max_stop_strings} stop strings, got {len(st.stop)}")
    for i, s in enumerate(st.stop):
        if not s:
            raise InvalidRequest(f"stopping.stop[{i}]", "stop strings must not be empty")
        if len(s.encode()) > limits.max_stop_string_bytes:
            raise InvalidRequest(
                f"stopping.stop[{i}]", f"at most {limits.max_stop_string_bytes} bytes, got {len(s.encode())}"
            )
    bad = next((t for t in st.stop_token_ids if t >= limits.vocab_size), None)
    if bad is not None:
        raise InvalidRequest(
            "stopping.stop_token_ids", f"token id {bad} is outside the vocabulary (size {limits.vocab_size})"
        )
    ids = prompt_token_ids(req, tokenizer, limits)
    room = limits.max_model_len - len(ids)
    if st.HasField("max_tokens"):
        if st.max_tokens == 0:
            raise InvalidRequest("stopping.max_tokens", "must be at least 1")
        if st.max_tokens > room:
            raise InvalidRequest(
                "stopping.max_tokens",
                f"prompt ({len(ids)} tokens) + max_tokens ({st.max_tokens}) exceeds the context "
                f"of {limits.max_model_len} tokens",
                grpc.StatusCode.OUT_OF_RANGE,
            )
        max_tokens = st.max_tokens
    else:
        max_tokens = room
    min_tokens = st.min_tokens if st.HasField("min_tokens") else 0
    if min_tokens > max_tokens:
        raise InvalidRequest("stopping.min_tokens", f"min_tokens ({min_tokens}) exceeds max_tokens ({max_tokens})")
    return GenerationInput(
        request_id=req.request_id or uuid.uuid4().hex,
        prompt_token_ids=ids,
        sampling=sampling,
        n=n,
        max_tokens=max_tokens,
        stop=tuple(st.stop),
        stop_token_ids=frozenset(st.stop_token_ids),
        ignore_eos=st.ignore_eos,
        min_tokens=min_tokens,
        include_stop_str_in_output=st.include_stop_str_in_output,
        priority=req.priority,
        constraint=output_constraint(req.constraint),
    )
