"""OpenAI tool calling on a model whose chat template has no tools section.

    tool_choice "none"      tools are neither shown to the model nor called
    tool_choice "auto"      tools rendered into the system turn; the model may answer in text
                            or emit <tool_call>{"name": ..., "arguments": {...}}</tool_call>
                            blocks, which become `tool_calls` (finish_reason "tool_calls")
    tool_choice "required"  as auto, and the output is constrained (JSON schema) to a
                            non-empty array of {"name": <a tool>, "arguments": <its parameters>}
    named function          the output is constrained to that tool's parameters schema:
                            the arguments of one call to it

(vLLM's choices for required and named.) How tools are shown and how calls
are read back is a `ToolFormat`, chosen per chat template (`FORMATS`); the one
here is Hermes' (NousResearch Hermes 2 Pro, also SmolLM2's function-calling
prompt): a <tools> block in the system turn and <tool_call> JSON blocks.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field

from openai_gateway.structured import ParamError
from pagedserve.v1 import generation_pb2 as pb


def _call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


@dataclass
class Call:
    name: str
    arguments: str  # JSON text

    def json(self, index: int | None = None) -> dict:
        out = {"id": _call_id(), "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


def _loads_or_raw(text: str):
    try:
        return json.loads(text or "{}")
    except (ValueError, RecursionError):  # not JSON, or nested past the parser's recursion: kept as text
        return text


def _as_call(obj) -> Call | None:
    if isinstance(obj, dict) and isinstance(obj.get("name"), str):
        args = obj.get("arguments", obj.get("parameters", {}))
        return Call(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))
    return None


class HermesFormat:
    """<tools> in the system turn, <tool_call> JSON blocks out, <tool_response> for results."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def system_prompt(self, tools: list[dict]) -> str:
        listing = "\n".join(json.dumps({"type": "function", "function": t}, ensure_ascii=False) for t in tools)
        return (
            "You are a function calling AI model. You are provided with function signatures within <tools></tools> "
            "XML tags. You may call one or more functions to assist with the user query. Don't make assumptions "
            f"about what values to plug into functions. Here are the available tools:\n<tools>\n{listing}\n</tools>\n"
            "For each function call return a JSON object with the function name and arguments within "
            "<tool_call></tool_call> XML tags as follows:\n<tool_call>\n"
            '{"name": <function-name>, "arguments": <args-dict>}\n</tool_call>'
        )

    def render(self, messages: list[dict], tools: list[dict]) -> list[dict]:
        """Chat turns the template can render: the tools prompt merged into the system turn,
        assistant tool calls written out as blocks, tool results wrapped in <tool_response>."""
        out = []
        for m in messages:
            content = m["content"]
            if m["role"] == "assistant" and m.get("tool_calls"):
                blocks = [
                    f"{self.OPEN}\n{json.dumps({'name': c.name, 'arguments': _loads_or_raw(c.arguments)}, ensure_ascii=False)}"
                    f"\n{self.CLOSE}"
                    for c in m["tool_calls"]
                ]
                content = "\n".join(([content] if content else []) + blocks)
            elif m["role"] == "tool":
                content = f"<tool_response>\n{content}\n</tool_response>"
            out.append({"role": m["role"], "content": content})
        if tools:
            prompt = self.system_prompt(tools)
            if out and out[0]["role"] == "system":
                out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{prompt}"}
            else:
                out.insert(0, {"role": "system", "content": prompt})
        return out

    def parse(self, text: str) -> tuple[str | None, list[Call]]:
        """(content outside the blocks or None, the calls). A block that is not a call stays content."""
        stream = self.stream()
        events = stream.feed(text) + stream.close()
        content = "".join(e for e in events if isinstance(e, str)).strip()
        return content or None, [e for e in events if isinstance(e, Call)]

    def stream(self) -> HermesStream:
        return HermesStream(self)


@dataclass
class HermesStream:
    """Incremental parser: feed text deltas, get content strings and whole Calls in order.

    Text that could be the start of "<tool_call>" is held back until it is
    not; content that is only whitespace is held until something follows it
    (so the blank lines between calls never become content)."""

    fmt: HermesFormat
    buf: str = ""
    in_call: bool = False
    pending_space: str = ""
    num_calls: int = 0

    def _content(self, text: str) -> list:
        text = self.pending_space + text
        if not text.strip():
            self.pending_space = text
            return []
        self.pending_space = ""
        return [text]

    def feed(self, delta: str) -> list:
        self.buf += delta
        events = []
        open_, close = self.fmt.OPEN, self.fmt.CLOSE
        while True:
            if self.in_call:
                end = self.buf.find(close)
                if end < 0:
                    return events
                events += self._block(self.buf[:end])
                self.buf, self.in_call = self.buf[end + len(close) :], False
                continue
            start = self.buf.find(open_)
            if start >= 0:
                events += self._content(self.buf[:start])
                self.buf, self.in_call = self.buf[start + len(open_) :], True
                continue
            keep = next(
                (k for k in range(min(len(open_) - 1, len(self.buf)), 0, -1) if open_.startswith(self.buf[-k:])), 0
            )
            ready, self.buf = self.buf[: len(self.buf) - keep], self.buf[len(self.buf) - keep :]
            return events + (self._content(ready) if ready else [])

    def _block(self, body: str) -> list:
        try:
            call = _as_call(json.loads(body))
        except ValueError:
            call = None
        if call is None:
            return self._content(self.fmt.OPEN + body + self.fmt.CLOSE)
        self.num_calls += 1
        return [call]

    def close(self) -> list:
        """The end of the output: an unterminated block is read as a call if it parses, else as content."""
        rest, self.buf = self.buf, ""
        if self.in_call:
            self.in_call = False
            try:
                call = _as_call(json.loads(rest))
            except ValueError:
                call = None
            if call is not None:
                self.num_calls += 1
                return [call]
            rest = self.fmt.OPEN + rest
        return self._content(rest) if rest.strip() else []


FORMATS = {"hermes": HermesFormat()}
DEFAULT_FORMAT = "hermes"


@dataclass
class ToolCalling:
    """One request's tool setup: what to render, what to constrain, how to read the output."""

    mode: str  # "auto", "required" or "named"
    tools: list[dict]
    name: str | None = None  # the named tool
    fmt: HermesFormat = field(default_factory=lambda: FORMATS[DEFAULT_FORMAT])

    def constraint(self) -> pb.OutputConstraint | None:
        if self.mode == "named":
            tool = next(t for t in self.tools if t["name"] == self.name)
            return pb.OutputConstraint(json_schema=json.dumps(tool.get("parameters") or {"type": "object"}))
        if self.mode == "required":
            calls, defs = [], {}
            for i, t in enumerate(self.tools):
                arguments = _hoist_defs(t.get("parameters") or {"type": "object"}, f"tool{i}_", defs)
                calls.append(
                    {
                        "type": "object",
                        "properties": {"name": {"const": t["name"]}, "arguments": arguments},
                        "required": ["name", "arguments"],
                        "additionalProperties": False,
                    }
                )
            schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
            return pb.OutputConstraint(json_schema=json.dumps({**schema, **({"$defs": defs} if defs else {})}))
        return None

    def parse(self, text: str) -> tuple[str | None, list[Call]]:
        if self.mode == "named":
            return None, [Call(self.name, text)]
        if self.mode == "required":
            try:
                calls = [_as_call(c) for c in json.loads(text)]
            except (ValueError, TypeError):  # cut short by max_tokens: not JSON yet
                return text, []
            return None, [c for c in calls if c is not None]
        return self.fmt.parse(text)

    def message(self, text: str, finish: str) -> tuple[dict, str]:
        """The whole response's message and finish_reason."""
        content, calls = self.parse(text) if finish == "stop" or self.mode == "auto" else (text, [])
        message = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [c.json() for c in calls]
            return message, "tool_calls"
        return message, finish

    def stream_deltas(self, state: dict, index: int, text: str, finish: str | None) -> tuple[list[dict], str | None]:
        """Chat deltas for one sample's text delta, and its finish_reason. `state` holds the
        per-sample parsers. Auto mode streams content as it comes and each call once its block
        closes; required and named calls are known only when the output is complete."""
        if self.mode != "auto":
            state[index] = state.get(index, "") + text
            if finish is None:
                return [], None
            message, finish = self.message(state.pop(index), finish)
            deltas = [{"content": message["content"]}] if message["content"] else []
            calls = [Call(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", [])]
            return deltas + _call_deltas(calls, 0), finish
        stream = state.setdefault(index, self.fmt.stream())
        before = stream.num_calls
        events = stream.feed(text) + (stream.close() if finish is not None else [])
        deltas, calls = [], 0
        for e in events:
            if isinstance(e, str):
                deltas.append({"content": e})
            else:
                deltas += _call_deltas([e], before + calls)
                calls += 1
        if finish is not None and stream.num_calls and finish == "stop":
            finish = "tool_calls"
        return deltas, finish


def _call_deltas(calls: list[Call], first_index: int) -> list[dict]:
    """OpenAI's streamed call: a delta naming it (id, type, name, empty arguments), then its arguments."""
    out = []
    for i, call in enumerate(calls, first_index):
        out.append(
            {
                "tool_calls": [
                    {"index": i, "id": _call_id(), "type": "function", "function": {"name": call.name, "arguments": ""}}
                ]
            }
        )
        out.append({"tool_calls": [{"index": i, "function": {"arguments": call.arguments}}]})
    return out


def tool_calling(body: Mapping) -> ToolCalling | None:
    """The request's tools and tool_choice; None when tools play no part."""
    tools = body.get("tools") or []
    if not isinstance(tools, list):
        raise ParamError("tools", "expected a list of tools")
    functions = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) and t.get("type", "function") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ParamError(
                f"tools[{i}]", 'expected {"type": "function", "function": {"name": ..., "parameters": {...}}}'
            )
        if not isinstance(fn.get("parameters", {}), dict):
            raise ParamError(f"tools[{i}].function.parameters", "expected a JSON Schema object")
        functions.append(fn)
    choice = body.get("tool_choice")
    if choice is None:
        choice = "auto" if functions else "none"
    if choice == "none":
        return None
    if not functions:
        raise ParamError("tool_choice", "needs tools")
    if choice in ("auto", "required"):
        return ToolCalling(choice, functions)
    function = choice.get("function") if isinstance(choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise ParamError(
            "tool_choice", 'expected "none", "auto", "required" or {"type": "function", "function": {"name": ...}}'
        )
    if name not in {f["name"] for f in functions}:
        raise ParamError("tool_choice", f"no tool named {name!r} in tools")
    return ToolCalling("named", functions, name)


def _hoist_defs(schema, prefix: str, defs: dict):
    """`schema` (a tool's parameters) made to work nested inside another: its
    root `$defs`/`definitions` move to `defs` under `prefix`ed names, and its
    local references ("#/$defs/X", "#/definitions/X", "#") follow them, since
    a pointer resolves against the root, which is no longer this schema."""
    if not isinstance(schema, dict):
        return schema
    own = {}
    for key in ("definitions", "$defs"):
        if isinstance(schema.get(key), dict):
            own.update(schema[key])
    root = prefix.rstrip("_")  # never equal to a prefixed definition's name
    to_root = []

    def rewrite(node):
        if isinstance(node, list):
            return [rewrite(n) for n in node]
        if not isinstance(node, dict):
            return node
        out = {k: rewrite(v) for k, v in node.items()}
        ref = node.get("$ref")
        if isinstance(ref, str) and (ref == "#" or ref.startswith(("#/$defs/", "#/definitions/"))):
            out["$ref"] = f"#/$defs/{root}" if ref == "#" else f"#/$defs/{prefix}{ref.split('/', 2)[2]}"
            to_root.append(ref == "#")
        return out

    try:
        body = rewrite({k: v for k, v in schema.items() if not (k in ("$defs", "definitions") and isinstance(v, dict))})
        for name, sub in own.items():
            defs[f"{prefix}{name}"] = rewrite(sub)
    except RecursionError:
        raise ParamError("tools", "a tool's parameters are nested too deeply") from None
    if any(to_root):  # it refers to itself: reachable by name too
        defs[root] = body
    return body


def assistant_tool_calls(i: int, m: Mapping) -> list[Call]:
    """An assistant turn's earlier tool_calls, for rendering them back into the conversation."""
    calls = []
    for j, c in enumerate(m.get("tool_calls") or []):
        fn = c.get("function") if isinstance(c, dict) else None
        if (
            not isinstance(fn, dict)
            or not isinstance(fn.get("name"), str)
            or not isinstance(fn.get("arguments", "{}"), str)
        ):
            raise ParamError(
                f"messages[{i}].tool_calls[{j}]", 'expected {"function": {"name": ..., "arguments": "..."}}'
            )
        calls.append(Call(fn["name"], fn.get("arguments") or "{}"))
    return calls
