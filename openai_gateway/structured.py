"""OpenAI and vLLM structured-output parameters -> the public API's OutputConstraint; logit_bias.

    response_format {"type": "json_object"}                        -> json_object
    response_format {"type": "json_schema", "json_schema": {...}}  -> json_schema (its "schema")
    guided_json (schema object or JSON text)                       -> json_schema
    guided_regex / guided_choice / guided_grammar (Lark or GBNF)   -> regex / choice / grammar
    structured_outputs {"json" | "regex" | "choice" | "grammar" | "json_object": ...}  (vLLM >= 0.10's name)

At most one of them per request. `strict` is accepted either way: the schema
is always enforced while decoding (OpenAI's strict mode also requires every
property to be listed in `required` and additionalProperties false; with
strict false we enforce what the schema says all the same). The scheduler
compiles the constraint and answers a bad one with the compiler's message.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from pagedserve.v1 import generation_pb2 as pb

GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


class ParamError(ValueError):
    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param
        self.message = message


def json_schema_constraint(schema, param: str) -> pb.OutputConstraint:
    if isinstance(schema, str):
        return pb.OutputConstraint(json_schema=schema)
    if not isinstance(schema, (dict, bool)):
        raise ParamError(param, "expected a JSON Schema object")
    return pb.OutputConstraint(json_schema=json.dumps(schema))


def _response_format(rf) -> pb.OutputConstraint | None:
    if not isinstance(rf, dict) or rf.get("type") not in ("text", "json_object", "json_schema"):
        raise ParamError("response_format", 'expected {"type": "text" | "json_object" | "json_schema", ...}')
    if rf["type"] == "text":
        return None
    if rf["type"] == "json_object":
        return pb.OutputConstraint(json_object=True)
    spec = rf.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("name", ""), str):
        raise ParamError("response_format.json_schema", 'expected {"name": ..., "schema": {...}, "strict": ...}')
    if not isinstance(spec.get("strict", False), (bool, type(None))):
        raise ParamError("response_format.json_schema.strict", "expected a boolean")
    schema = spec.get("schema", {"type": "object"})  # OpenAI: no schema means any object
    return json_schema_constraint(schema, "response_format.json_schema.schema")


def _guided(name: str, value) -> pb.OutputConstraint:
    if name == "guided_json":
        return json_schema_constraint(value, name)
    if name == "guided_regex":
        if not isinstance(value, str):
            raise ParamError(name, "expected a regular expression string")
        return pb.OutputConstraint(regex=value)
    if name == "guided_choice":
        if not isinstance(value, list) or not all(isinstance(c, str) for c in value):
            raise ParamError(name, "expected a list of strings")
        return pb.OutputConstraint(choice=pb.Choices(choices=value))
    if not isinstance(value, str):
        raise ParamError(name, "expected a Lark or GBNF grammar string")
    syntax = pb.Grammar.SYNTAX_GBNF if "::=" in value else pb.Grammar.SYNTAX_LARK
    return pb.OutputConstraint(grammar=pb.Grammar(syntax=syntax, source=value))


def output_constraint(body: Mapping) -> tuple[pb.OutputConstraint | None, str | None]:
    """(the constraint, the parameter it came from) for a chat or completions body."""
    found = []
    rf = body.get("response_format")
    if rf is not None:
        constraint = _response_format(rf)
        if constraint is not None:
            found.append(("response_format", constraint))
    for name in GUIDED:
        if body.get(name) is not None:
            found.append((name, _guided(name, body[name])))
    so = body.get("structured_outputs")
    if so is not None:
        keys = (
            [k for k in ("json", "regex", "choice", "grammar", "json_object") if so.get(k) is not None]
            if isinstance(so, dict)
            else []
        )
        if len(keys) != 1:
            raise ParamError("structured_outputs", "expected exactly one of json, regex, choice, grammar, json_object")
        key = keys[0]
        constraint = (
            pb.OutputConstraint(json_object=True) if key == "json_object" else _guided(f"guided_{key}", so[key])
        )
        found.append(("structured_outputs", constraint))
    if len(found) > 1:
        raise ParamError(found[1][0], f"only one structured-output parameter per request (also got {found[0][0]})")
    return (found[0][1], found[0][0]) if found else (None, None)


def logit_bias(body: Mapping) -> dict[int, float] | None:
    """OpenAI's {"token id": bias} (keys are strings in JSON)."""
    value = body.get("logit_bias")
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ParamError("logit_bias", "expected an object mapping token ids to biases")
    out = {}
    for key, bias in value.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise ParamError("logit_bias", f"keys must be token ids, got {key!r}") from None
        if not 0 <= token < 2**32 or isinstance(bias, bool) or not isinstance(bias, (int, float)):
            raise ParamError("logit_bias", f"expected a token id and a number, got {key!r}: {bias!r}")
        try:
            out[token] = float(bias)
        except OverflowError:
            raise ParamError("logit_bias", f"bias for {key!r} is too large for a number") from None
    return out
