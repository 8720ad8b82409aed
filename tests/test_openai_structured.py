"""Structured output and tool calling in the OpenAI gateway: translation and the Hermes
tool-call parser alone, then the official `openai` client against live processes."""

from __future__ import annotations

import json
import os

import jsonschema
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from openai_gateway.tools import HermesFormat
from openai_gateway.translate import APIError, chat_request, completion_request
from pagedserve.v1 import generation_pb2 as pb
from pagedserve_client import build_request
from tests.servers import Servers
from tests.test_openai_gateway import start_gateway, stop

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Current time in a timezone",
        "parameters": {
            "type": "object",
            "properties": {"tz": {"type": "string", "maxLength": 20}},
            "required": ["tz"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def request_of(t):
    """The one GenerateRequest a single-prompt translation makes."""
    (prompt,) = t.prompts
    return build_request(**prompt, **t.kwargs)


def chat(**body):
    return chat_request({"model": "m", "messages": ASK, **body})


# -- translation ------------------------------------------------------------------------


def test_response_format_and_guided_params_become_constraints():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    req = request_of(
        chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}})
    )
    assert json.loads(req.constraint.json_schema) == schema
    assert request_of(chat(response_format={"type": "json_object"})).constraint.json_object
    assert not request_of(chat(response_format={"type": "text"})).HasField("constraint")
    t = completion_request({"model": "m", "prompt": "x", "guided_choice": ["a", "b"], "logit_bias": {"7": -100}})
    req = request_of(t)
    assert list(req.constraint.choice.choices) == ["a", "b"] and dict(req.sampling.logit_bias) == {7: -100.0}
    assert request_of(chat(guided_regex="[0-9]+")).constraint.regex == "[0-9]+"
    g = request_of(chat(guided_grammar='root ::= "a"')).constraint.grammar
    assert g.syntax == pb.Grammar.SYNTAX_GBNF
    assert t.renames["constraint.choice.choices"] == "guided_choice"
    assert request_of(chat(structured_outputs={"regex": "a+"})).constraint.regex == "a+"


@pytest.mark.parametrize(
    "body, param",
    [
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 10**400}}, "logit_bias"),  # valid JSON, too large for a float
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": "get_weather"}}, "tool_choice"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [{"type": "function"}]}, "tools[0]"),
        (
            {"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
            "response_format",
        ),
    ],
)
def test_bad_structured_params_name_the_parameter(body, param):
    with pytest.raises(APIError) as e:
        chat(**body)
    assert e.value.status == 400 and e.value.param == param


def test_tool_choices_render_tools_and_constrain_required_and_named():
    assert chat(tools=[WEATHER], tool_choice="none").tools is None
    auto = chat(tools=[WEATHER, TIME])
    system = auto.prompts[0]["messages"][0]
    assert auto.tools.mode == "auto" and auto.kwargs["constraint"] is None
    assert system["role"] == "system" and "<tools>" in system["content"] and '"get_time"' in system["content"]
    required = chat(tools=[WEATHER, TIME], tool_choice="required")
    schema = json.loads(required.kwargs["constraint"].json_schema)
    jsonschema.validate([{"name": "get_time", "arguments": {"tz": "UTC"}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_time", "arguments": {"city": "Paris", "unit": "celsius"}}], schema)
    named = chat(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert json.loads(named.kwargs["constraint"].json_schema) == WEATHER["function"]["parameters"]
    message, finish = named.tools.message('{"city": "Paris", "unit": "celsius"}', "stop")
    assert finish == "tool_calls" and message["content"] is None
    assert message["tool_calls"][0]["function"] == {
        "name": "get_weather",
        "arguments": '{"city": "Paris", "unit": "celsius"}',
    }


def test_required_tools_keep_their_local_references():
    """pydantic writes tool parameters with `$defs` and `$ref`s (and may refer
    to the root, "#"): nested in the required mode's array they still resolve,
    two tools' same-named definitions apart, and the engine compiles it."""
    from scheduler_svc.grammar import Constraint, llguidance_grammar

    address = {
        "type": "function",
        "function": {
            "name": "ship",
            "parameters": {
                "type": "object",
                "properties": {"to": {"$ref": "#/$defs/Address"}},
                "required": ["to"],
                "$defs": {
                    "Address": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
                },
            },
        },
    }
    tree = {
        "type": "function",
        "function": {
            "name": "tree",
            "parameters": {
                "type": "object",
                "properties": {
                    "kids": {"type": "array", "items": {"$ref": "#"}},
                    "a": {"$ref": "#/definitions/Address"},
                },
                "definitions": {"Address": {"type": "integer"}},
            },
        },
    }
    schema = json.loads(chat(tools=[address, tree], tool_choice="required").kwargs["constraint"].json_schema)
    jsonschema.validate([{"name": "ship", "arguments": {"to": {"city": "Oslo"}}}], schema)
    jsonschema.validate([{"name": "tree", "arguments": {"a": 3, "kids": [{"a": 4, "kids": []}]}}], schema)
    for wrong in (
        {"name": "ship", "arguments": {"to": {"town": "Oslo"}}},
        {"name": "tree", "arguments": {"kids": [{"a": "x"}]}},
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate([wrong], schema)
    assert llguidance_grammar(Constraint("json_schema", json.dumps(schema)))
    # Only the root's definitions move: a parameter that happens to be called
    # "definitions" stays a parameter, and a malformed $defs is left to the compiler.
    named = {"type": "object", "properties": {"definitions": {"type": "string"}}, "required": ["definitions"]}
    glossary = {"type": "function", "function": {"name": "glossary", "parameters": named}}
    schema = json.loads(chat(tools=[glossary], tool_choice="required").kwargs["constraint"].json_schema)
    jsonschema.validate([{"name": "glossary", "arguments": {"definitions": "x"}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "glossary", "arguments": {}}], schema)
    odd = {"type": "function", "function": {"name": "odd", "parameters": {"type": "object", "$defs": [1]}}}
    assert chat(tools=[odd], tool_choice="required").kwargs["constraint"].json_schema


def test_earlier_tool_calls_and_results_render_into_the_conversation():
    messages = ASK + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
    ]
    turns = chat_request({"model": "m", "messages": messages, "tools": [WEATHER]}).prompts[0]["messages"]
    assert (
        turns[2]["content"]
        == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
    )
    assert turns[3] == {"role": "tool", "content": "<tool_response>\n18 C, sunny\n</tool_response>"}
    # Arguments nested past the JSON parser's recursion are kept as the text they are.
    deep = "[" * 5000 + "]" * 5000
    messages[-2]["tool_calls"][0]["function"]["arguments"] = deep
    turns = chat_request({"model": "m", "messages": messages, "tools": [WEATHER]}).prompts[0]["messages"]
    assert deep in turns[2]["content"]


OUTPUT = (
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
    '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>\n'
)


def test_hermes_parser_reads_calls_and_keeps_content():
    content, calls = HermesFormat().parse(OUTPUT)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"}),
        ("get_time", {"tz": "CET"}),
    ]
    assert HermesFormat().parse("no calls <tool_call> not json </tool_call>") == (
        "no calls <tool_call> not json </tool_call>",
        [],
    )
    assert HermesFormat().parse('<tool_call>\n{"name": "f", "arguments": {}}')[1][0].name == "f"  # cut at the end


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, len(OUTPUT)), max_size=12))
def test_streamed_deltas_add_up_to_the_whole_response(cuts):
    """However the text is split into deltas, the streamed content and calls equal the parsed whole."""
    t = chat(tools=[WEATHER, TIME])
    bounds = [0, *sorted(cuts), len(OUTPUT)]
    state, content, calls = {}, "", {}
    for k, (a, b) in enumerate(zip(bounds, bounds[1:])):
        deltas, finish = t.tools.stream_deltas(state, 0, OUTPUT[a:b], "stop" if k == len(bounds) - 2 else None)
        for d in deltas:
            content += d.get("content", "")
            for c in d.get("tool_calls", []):
                entry = calls.setdefault(c["index"], {"name": "", "arguments": ""})
                entry["name"] += c.get("function", {}).get("name", "")
                entry["arguments"] += c["function"]["arguments"]
    assert finish == "tool_calls" and content.strip() == "Let me check."
    message, _ = t.tools.message(OUTPUT, "stop")
    assert [calls[i] for i in sorted(calls)] == [c["function"] for c in message["tool_calls"]]


# -- live, with the official client ------------------------------------------------------

live = pytest.mark.e2e


@pytest.fixture(scope="module")
def oai():
    # float32, not --dtype auto: test_auto_mode_parses_hermes_tool_calls_streamed_or_not asks the
    # same seeded request twice, the second over the first's cached prefix, and expects the same
    # call. That holds bit for bit in float32, whose linears give a token the same sums at any row
    # count; where auto picks bfloat16 (CPUs with AVX512-BF16) the prefix-cache hit prefills
    # fewer rows, which may take another GEMM (bf16_gemm_routes.py) and round otherwise.
    with Servers(executor_args=["--dtype", "float32"]) as s:
        proc, url = start_gateway(s.public_addr, os.path.join(s.tmp, "gateway.log"), "--served-model-name", "m")
        try:
            yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        finally:
            stop(proc)


@live
def test_response_format_json_schema_validates(oai):
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    r = oai.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "Invent a person."}],
        seed=3,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}},
        max_tokens=60,
    )
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(
            model="m",
            messages=ASK,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objec"}}},
        )
    assert "objec" in str(e.value) and e.value.body["param"] == "response_format"


@live
def test_required_and_named_tool_calls(oai):
    r = oai.chat.completions.create(
        model="m", messages=ASK, tools=[WEATHER, TIME], tool_choice="required", seed=1, max_tokens=80
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    for call in choice.message.tool_calls:
        tool = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
        jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
    r = oai.chat.completions.create(
        model="m",
        messages=ASK,
        tools=[WEATHER, TIME],
        seed=2,
        max_tokens=60,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    [call] = r.choices[0].message.tool_calls
    assert (
        r.choices[0].finish_reason == "tool_calls"
        and call.function.name == "get_weather"
        and call.id.startswith("call_")
    )
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])


@live
def test_streamed_tool_call_deltas_accumulate_in_the_openai_client(oai):
    named = {"type": "function", "function": {"name": "get_weather"}}
    with oai.chat.completions.stream(
        model="m", messages=ASK, tools=[WEATHER], tool_choice=named, seed=2, max_tokens=60
    ) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion()
    [call] = final.choices[0].message.tool_calls
    assert final.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])


@live
def test_auto_mode_parses_hermes_tool_calls_streamed_or_not(oai):
    """The 135M model rarely calls a tool on its own, so a regex holds it to the Hermes format;
    the auto-mode parser then has to find the call in the text, streamed and not."""
    regex = (
        r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[A-Z][a-z]{2,8}", '
        r'"unit": "celsius"\}\}\n</tool_call>'
    )
    kwargs = dict(
        model="m", messages=ASK, tools=[WEATHER, TIME], seed=4, max_tokens=60, extra_body={"guided_regex": regex}
    )
    whole = oai.chat.completions.create(**kwargs)
    with oai.chat.completions.stream(**kwargs) as stream:
        for _ in stream:
            pass
        streamed = stream.get_final_completion()
    for r in (whole, streamed):
        [call] = r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "tool_calls" and not r.choices[0].message.content
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    a, b = whole.choices[0].message.tool_calls[0].function, streamed.choices[0].message.tool_calls[0].function
    assert (a.name, a.arguments) == (b.name, b.arguments)
