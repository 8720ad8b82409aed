"""OpenAI JSON <-> PagedServe `Generate` calls, and gRPC errors -> OpenAI error bodies.

Pure functions, no I/O. Requests are checked only as far as translating them
needs (types the protobuf fields can hold, features this server does not have);
every range and limit is the scheduler's to check, and its BadRequest field
violation comes back named as the OpenAI parameter (`sampling.temperature` ->
`temperature`).

The `model` field is required; the gateway fronts exactly one model and
answers 404 for any other name (app.py checks it), and responses echo the
caller's value. A completions request may carry a list of prompts: each is its
own `Generate` call, and its samples are choices p*n .. p*n+n-1.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import grpc

from openai_gateway import structured
from openai_gateway.tools import ToolCalling, assistant_tool_calls, tool_calling
from pagedserve.v1 import generation_pb2 as pb
from pagedserve_client import Completion, PagedServeError

COMPLETION, CHAT = "text_completion", "chat.completion"
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat runs to the context
_UINT32, _INT32, _UINT64 = (0, 2**32 - 1), (-(2**31), 2**31 - 1), (0, 2**64 - 1)
_MAX_TOKENS = (1, 2**32 - 1)


class APIError(Exception):
    """Sent back as OpenAI's `{"error": {...}}` body with `status`."""

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None, type: str | None = None
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# gRPC status -> (HTTP status, OpenAI error type, OpenAI error code); anything else is a 500.
_FROM_GRPC = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error", None),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error", "context_length_exceeded"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "invalid_request_error", "invalid_api_key"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "invalid_request_error", "conflict"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error", "rate_limit_exceeded"),
    grpc.StatusCode.UNAVAILABLE: (503, "server_error", "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "server_error", "timeout"),
}


def from_grpc(err: PagedServeError, renames: Mapping[str, str]) -> APIError:
    """`renames` maps gRPC field prefixes to the OpenAI parameter the caller used (most specific first)."""
    status, type_, code = _FROM_GRPC.get(err.code(), (500, "server_error", None))
    violation = err.field_violations[0] if err.field_violations else None
    if violation is None:
        return APIError(status, err.details() or err.code().name, None, code, type_)
    param = next(
        (name + violation.field[len(p) :] for p, name in renames.items() if violation.field.startswith(p)), None
    )
    param = param or violation.field.removeprefix("sampling.").removeprefix("stopping.")
    return APIError(status, f"{param}: {violation.description}", param, code, type_)


@dataclass(frozen=True)
class Translated:
    """One OpenAI request, ready for `AsyncClient.generate(**kwargs)`."""

    kind: str  # COMPLETION or CHAT
    model: str
    prompts: list[dict]  # one Generate call each: {"prompt": str} | {"token_ids": [...]} | {"messages": [...]}
    kwargs: dict  # the sampling and stopping arguments all of them share
    stream: bool
    include_usage: bool
    logprobs: bool  # whether the response carries log-probabilities
    renames: dict[str, str]  # gRPC field prefix -> the OpenAI parameter, for from_grpc
    echo: bool = False  # completions: each choice's text starts with its prompt
    tools: ToolCalling | None = None  # chat with tools: how the output becomes tool_calls

    @property
    def n(self) -> int:
        return self.kwargs.get("n") or 1


def _bad(param: str, message: str) -> APIError:
    return APIError(400, f"{param}: {message}", param)


def _typed(body: Mapping, name: str, kind: type, what: str):
    value = body.get(name)
    if value is None:
        return None
    if (isinstance(value, bool) and kind is not bool) or not isinstance(value, kind):  # JSON true is no number
        raise _bad(name, f"expected {what}, got {type(value).__name__}")
    return value


def _num(body, name):
    value = _typed(body, name, (int, float), "a number")
    if isinstance(value, int):  # JSON integers are unbounded; the protos' numbers are not
        try:
            float(value)
        except OverflowError:
            raise _bad(name, "expected a number, got an integer too large for one") from None
    return value


def _int(body, name, bounds):
    value = _typed(body, name, int, "an integer")
    if value is not None and not bounds[0] <= value <= bounds[1]:
        raise _bad(name, f"must be an integer in [{bounds[0]}, {bounds[1]}], got {value}")
    return value


def _token_ids(value) -> list[int] | None:
    if (
        isinstance(value, list)
        and value
        and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**32 for t in value)
    ):
        return value
    return None


def _stop(body) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise _bad("stop", "expected a string or a list of strings")
    return stop


def _unsupported(body, name: str, allowed=(None,)) -> None:
    if body.get(name) not in allowed:
        raise _bad(name, "not supported by this server")


def _common(body: Mapping) -> tuple[dict, bool, bool]:
    """The fields both endpoints share -> (generate kwargs, stream, include_usage)."""
    if not isinstance(body.get("model"), str):
        raise _bad("model", "required: the model's name (any string; this server serves one model)")
    kwargs = dict(
        temperature=_num(body, "temperature"),
        top_p=_num(body, "top_p"),
        min_p=_num(body, "min_p"),
        presence_penalty=_num(body, "presence_penalty"),
        frequency_penalty=_num(body, "frequency_penalty"),
        repetition_penalty=_num(body, "repetition_penalty"),
        top_k=_int(body, "top_k", _INT32),
        n=_int(body, "n", _UINT32),
        seed=_int(body, "seed", _UINT64),
        min_tokens=_int(body, "min_tokens", _UINT32),
        ignore_eos=_typed(body, "ignore_eos", bool, "a boolean"),
        stop=_stop(body),
        include_stop_str_in_output=_typed(body, "include_stop_str_in_output", bool, "a boolean"),
        priority=_int(body, "priority", _INT32) or 0,
    )
    stop_ids = body.get("stop_token_ids")
    if stop_ids is not None and stop_ids != [] and _token_ids(stop_ids) is None:
        raise _bad("stop_token_ids", "expected a list of token ids")
    kwargs["stop_token_ids"] = stop_ids or []
    kwargs["logit_bias"] = structured.logit_bias(body)
    stream = bool(_typed(body, "stream", bool, "a boolean"))
    options = _typed(body, "stream_options", dict, "an object") or {}
    include_usage = bool(_typed(options, "include_usage", bool, "a boolean"))
    if options and not stream:
        raise _bad("stream_options", "only allowed with stream: true")
    return kwargs, stream, include_usage


def _prompts(value) -> list[dict]:
    """A prompt or a list of them: strings, or token-id lists."""
    if isinstance(value, str):
        return [{"prompt": value}]
    if _token_ids(value) is not None:
        return [{"token_ids": value}]
    if isinstance(value, list) and value and all(isinstance(p, str) or _token_ids(p) is not None for p in value):
        return [{"prompt": p} if isinstance(p, str) else {"token_ids": p} for p in value]
    raise _bad("prompt", "expected a string, a non-empty list of token ids, or a non-empty list of either")


_CONSTRAINT_FIELDS = (
    "constraint.json_schema",
    "constraint.json_object",
    "constraint.regex",
    "constraint.choice.choices",
    "constraint.choice",
    "constraint.grammar.source",
    "constraint.grammar.syntax",
    "constraint.grammar",
    "constraint",
)


def _constraint(kwargs: dict, renames: dict, constraint: pb.OutputConstraint | None, param: str | None) -> None:
    kwargs["constraint"] = constraint
    if param is not None:
        renames.update((f, param) for f in _CONSTRAINT_FIELDS)


def _param_errors(translate):
    """Turns the helper modules' ParamError into the 400 APIError."""

    def wrapped(body: Mapping) -> Translated:
        try:
            return translate(body)
        except structured.ParamError as e:
            raise _bad(e.param, e.message) from None

    wrapped.__doc__ = translate.__doc__
    return wrapped


@_param_errors
def completion_request(body: Mapping) -> Translated:
    """POST /v1/completions: one prompt or a list of them."""
    kwargs, stream, include_usage = _common(body)
    prompts = _prompts(body.get("prompt"))
    kwargs["max_tokens"] = _int(body, "max_tokens", _MAX_TOKENS)
    if kwargs["max_tokens"] is None:
        kwargs["max_tokens"] = COMPLETIONS_DEFAULT_MAX_TOKENS
    kwargs["logprobs"] = _int(body, "logprobs", _UINT32)
    echo = bool(_typed(body, "echo", bool, "a boolean"))
    if echo and kwargs["logprobs"] is not None:
        raise _bad("echo", "echo with logprobs is not supported (prompt log-probabilities are not computed)")
    _unsupported(body, "suffix", (None, ""))
    best_of = _int(body, "best_of", _UINT32)
    if best_of is not None and best_of != (kwargs["n"] or 1):
        raise _bad("best_of", "only best_of == n is supported")
    renames = {"prompt.token_ids.ids": "prompt", "prompt.token_ids": "prompt", "prompt.text": "prompt"}
    _constraint(kwargs, renames, *structured.output_constraint(body))
    return Translated(
        COMPLETION,
        body["model"],
        prompts,
        kwargs,
        stream,
        include_usage,
        kwargs["logprobs"] is not None,
        renames,
        echo=echo,
    )


def _message(i: int, m) -> dict:
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise _bad(f"messages[{i}]", "expected an object with a role")
    if m.get("function_call"):
        raise _bad(f"messages[{i}].function_call", "the deprecated function_call is not supported: use tool_calls")
    calls = assistant_tool_calls(i, m) if m["role"] == "assistant" else []
    content = m.get("content")
    if isinstance(content, list):  # content parts: only text ones
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            raise _bad(f"messages[{i}].content", "only text content parts are supported")
        content = "".join(p["text"] for p in content)
    elif content is None:
        if m["role"] != "assistant":  # only an assistant turn (e.g. one that called tools) may lack content
            raise _bad(f"messages[{i}].content", f"required for role {m['role']!r}")
        content = ""
    elif not isinstance(content, str):
        raise _bad(f"messages[{i}].content", "expected a string or a list of text parts")
    # "developer" is OpenAI's newer name for the system role; chat templates know "system".
    return {"role": "system" if m["role"] == "developer" else m["role"], "content": content, "tool_calls": calls}


@_param_errors
def chat_request(body: Mapping) -> Translated:
    """POST /v1/chat/completions. Text only; tools per openai_gateway/tools.py."""
    kwargs, stream, include_usage = _common(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", "expected a non-empty list of messages")
    tools = tool_calling(body)
    turns = [_message(i, m) for i, m in enumerate(messages)]
    fmt = tools.fmt if tools is not None else ToolCalling("auto", []).fmt  # earlier calls render even without tools
    prompts = [{"messages": fmt.render(turns, tools.tools if tools is not None else [])}]
    max_name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    kwargs["max_tokens"] = _int(body, max_name, _MAX_TOKENS)
    want_logprobs = bool(_typed(body, "logprobs", bool, "a boolean"))
    top = _int(body, "top_logprobs", _UINT32)
    if top is not None and not want_logprobs:
        raise _bad("top_logprobs", "needs logprobs: true")
    kwargs["logprobs"] = (top or 0) if want_logprobs else None
    _unsupported(body, "functions", (None, []))
    renames = {
        "prompt.chat.messages": "messages",
        "prompt.chat": "messages",
        "prompt": "messages",
        "sampling.logprobs": "top_logprobs",
        "stopping.max_tokens": max_name,
    }
    constraint, param = structured.output_constraint(body)
    tool_constraint = tools.constraint() if tools is not None else None
    if tool_constraint is not None:
        if constraint is not None:
            raise _bad(
                param,
                f"cannot be combined with tool_choice {body.get('tool_choice')!r}, which constrains the output itself",
            )
        constraint, param = tool_constraint, "tools"
    _constraint(kwargs, renames, constraint, param)
    return Translated(CHAT, body["model"], prompts, kwargs, stream, include_usage, want_logprobs, renames, tools=tools)


def logprob_token_ids(logprobs) -> set[int]:
    """Every token id whose text a logprobs block shows: the sampled ones and their alternatives."""
    return {lp.token_id for lp in logprobs} | {t.token_id for lp in logprobs for t in lp.top}


# JSON has no -Infinity: a token an output constraint or logit bias ruled out
# reports this instead (as OpenAI and vLLM do).
LOGPROB_FLOOR = -9999.0


def _finite(logprob: float) -> float:
    return logprob if logprob >= LOGPROB_FLOOR else LOGPROB_FLOOR  # NaN too: JSON has none


def logprobs_json(kind: str, logprobs, text: Mapping[int, str], offset: int = 0) -> dict:
    """OpenAI's logprobs object. Completions' `text_offset` counts characters from `offset`
    (the sample's text length before these tokens); its top_logprobs include the sampled token.
    Logprobs are floored at LOGPROB_FLOOR."""
    if kind == CHAT:

        def entry(token_id, logprob):
            return {"token": text[token_id], "logprob": _finite(logprob), "bytes": list(text[token_id].encode())}

        content = [
            {**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t.token_id, t.logprob) for t in lp.top]}
            for lp in logprobs
        ]
        return {"content": content, "refusal": None}
    offsets = []
    for lp in logprobs:
        offsets.append(offset)
        offset += len(text[lp.token_id])
    return {
        "tokens": [text[lp.token_id] for lp in logprobs],
        "token_logprobs": [_finite(lp.logprob) for lp in logprobs],
        "top_logprobs": [
            {**{text[t.token_id]: _finite(t.logprob) for t in lp.top}, text[lp.token_id]: _finite(lp.logprob)}
            for lp in logprobs
        ],
        "text_offset": offsets,
    }


def usage_json(groups: list[list[Completion]]) -> dict:
    """One group of samples per prompt: the samples of a prompt share it (and its cache hits); outputs add up."""
    prompt = sum(g[0].prompt_tokens for g in groups)
    completion = sum(s.completion_tokens for g in groups for s in g)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(g[0].cached_prompt_tokens for g in groups)},
    }


def response_json(
    t: Translated,
    response_id: str,
    created: int,
    groups: list[list[Completion]],
    logprobs: list[dict | None],
    echoes: list[str],
) -> dict:
    """The whole non-streaming response; `logprobs[i]` is choice i's logprobs object (or None),
    `echoes[p]` the text that prompt p's choices start with."""
    choices = []
    samples = [(p, s) for p, g in enumerate(groups) for s in g]
    for i, ((p, s), lp) in enumerate(zip(samples, logprobs)):
        finish = s.finish_reason
        if t.kind == COMPLETION:
            body = {"text": echoes[p] + s.text}
        elif t.tools is not None:
            message, finish = t.tools.message(s.text, finish)
            body = {"message": message}
        else:
            body = {"message": {"role": "assistant", "content": s.text}}
        choices.append({"index": i, **body, "logprobs": lp, "finish_reason": finish})
    return {
        "id": response_id,
        "object": t.kind,
        "created": created,
        "model": t.model,
        "choices": choices,
        "usage": usage_json(groups),
    }


def chunk_json(
    t: Translated,
    response_id: str,
    created: int,
    index: int,
    text: str,
    finish: str | None,
    logprobs: dict | None,
    first: bool,
) -> dict:
    """One streamed chunk for one sample; a chat sample's `first` chunk also names the role."""
    if t.kind == COMPLETION:
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
    else:
        delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
    return {
        "id": response_id,
        "object": t.kind if t.kind == COMPLETION else "chat.completion.chunk",
        "created": created,
        "model": t.model,
        "choices": [choice],
        **({"usage": None} if t.include_usage else {}),
    }


def delta_chunk_json(
    t: Translated, response_id: str, created: int, index: int, delta: dict, finish: str | None, logprobs: dict | None
) -> dict:
    """A chat chunk with a prepared delta (tool calls)."""
    return {
        "id": response_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": t.model,
        "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}],
        **({"usage": None} if t.include_usage else {}),
    }


def usage_chunk_json(t: Translated, response_id: str, created: int, groups: list[list[Completion]]) -> dict:
    """The last chunk when stream_options.include_usage: no choices, the whole request's usage."""
    return {
        "id": response_id,
        "object": t.kind if t.kind == COMPLETION else "chat.completion.chunk",
        "created": created,
        "model": t.model,
        "choices": [],
        "usage": usage_json(groups),
    }
