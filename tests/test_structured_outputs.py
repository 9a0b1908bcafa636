"""Constrained decoding (issue 25, part 2) over real HTTP with the openai client, on the embedded
default model: `response_format` json_schema / json_object outputs parse and validate (jsonschema)
for many seeds, sampled, beside unconstrained rows in the same batches; forced tool calls
(`tool_choice` "required" or named) always parse and their arguments match the tool's schema;
a speculative engine decodes constrained rows without drafts and gives the plain engine's greedy
output; a schema the grammar engine cannot compile is a 400 naming `response_format`."""

from __future__ import annotations

import concurrent.futures
import json

import jsonschema
import openai
import pytest
from test_server import RunningServer

from hybridjax.default_model import default_model

NAME = "default"
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "ok"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "strict": True, "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                         "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "add", "strict": True, "parameters": {
        "type": "object", "properties": {"a": {"type": "integer", "minimum": -99, "maximum": 99},
                                         "b": {"type": "integer", "minimum": -99, "maximum": 99}},
        "required": ["a", "b"], "additionalProperties": False}}},
]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def default_server(**kw) -> RunningServer:
    """A server on the embedded default model, whose template renders tools."""
    return RunningServer(model=(NAME, default_model()), warmup=False, max_len=1024, **kw)


@pytest.fixture(scope="module")
def server():
    s = default_server(slots=4)
    yield s
    s.stop()


def ask(server, content, seed=0, temperature=1.0, max_tokens=160, **kw):
    return server.client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": content}],
                                                 seed=seed, temperature=temperature, max_tokens=max_tokens, **kw)


def schema_format(strict=True):
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": strict}}


def test_json_schema_outputs_validate_for_many_seeds(server):
    """16 sampled seeds, four at a time, each batch also holding an unconstrained request."""
    def one(seed):
        if seed % 4 == 3:  # an unconstrained neighbour in the batch
            return None, ask(server, "Tell me about a person.", seed=seed, max_tokens=40)
        return seed, ask(server, "Describe a person as JSON.", seed=seed, response_format=schema_format(seed % 2 == 0))

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(one, range(22)))
    checked = 0
    for seed, r in results:
        if seed is None:
            continue
        choice = r.choices[0]
        assert choice.finish_reason == "stop", (seed, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
        checked += 1
    assert checked >= 16


@pytest.mark.parametrize("stream", [False, True])
def test_json_object_parses(server, stream):
    """Any object: its strings are unbounded, so a sampled one may run to max_tokens (cut, as any
    response is); every one that ends by itself parses, and most do."""
    finished = 0
    for seed in range(4):
        r = ask(server, "Any JSON object, please.", seed=seed, temperature=0.7, max_tokens=200, stream=stream,
                response_format={"type": "json_object"},
                extra_body={"logit_bias": {"125": 3}})  # a bias and a grammar on one row
        if stream:
            chunks = list(r)
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            finish = next(c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason)
        else:
            text, finish = r.choices[0].message.content, r.choices[0].finish_reason
        assert text.startswith("{")
        if finish == "stop":
            assert isinstance(json.loads(text), dict)
            finished += 1
    assert finished >= 2


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "add"}}])
def test_forced_strict_tool_calls_always_parse(server, tool_choice):
    for seed in range(6):
        r = ask(server, "What is 2 + 3? Or the weather in Paris?", seed=seed, tools=TOOLS, tool_choice=tool_choice)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", choice.message
        (call,) = choice.message.tool_calls
        if isinstance(tool_choice, dict):
            assert call.function.name == "add"
        jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])


def test_a_schema_that_cannot_compile_is_a_400(server):
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"$ref": "#/definitions/missing"}}}}}
    with pytest.raises(openai.BadRequestError, match="missing") as e:
        ask(server, "x", response_format=bad)
    assert e.value.body["param"] == "response_format"
    with pytest.raises(openai.BadRequestError) as e:
        ask(server, "x", response_format={"type": "json_schema"})
    assert e.value.body["param"].startswith("response_format")
    with pytest.raises(openai.BadRequestError, match="tool_choice") as e:
        ask(server, "x", response_format={"type": "json_object"}, tools=TOOLS, tool_choice="required")
    # the completions endpoint takes response_format too
    r = server.client.completions.create(model=NAME, prompt="JSON:", max_tokens=120, temperature=0,
                                         extra_body={"response_format": {"type": "json_object"}})
    assert isinstance(json.loads(r.choices[0].text), dict)


def test_speculative_engine_decodes_constrained_rows_without_drafts(server):
    spec = default_server(slots=2, speculative_tokens=2)
    try:
        for fmt in (schema_format(), {"type": "json_object"}):
            want = ask(server, "Describe a person as JSON.", temperature=0, response_format=fmt).choices[0].message.content
            drafted_before = spec.engine.counters["spec_verify_steps"]
            got = ask(spec, "Describe a person as JSON.", temperature=0, response_format=fmt).choices[0].message.content
            assert got == want  # greedy: the plain engine's tokens
            assert spec.engine.counters["spec_verify_steps"] == drafted_before  # no drafting step ran for it
        plain = ask(spec, "Hello", temperature=0, max_tokens=12)  # an unconstrained row still drafts
        assert plain.choices[0].message.content is not None and spec.engine.counters["spec_verify_steps"] > 0
        # logit_bias and min_tokens apply to a drafting step's target logits: greedy, the plain engine's tokens
        banned = spec.engine.tokenizer.encode(plain.choices[0].message.content)[0]
        body = {"logit_bias": {str(banned): -100}, "min_tokens": 6}
        want = ask(server, "Hello", temperature=0, max_tokens=12, extra_body=body).choices[0].message.content
        got = ask(spec, "Hello", temperature=0, max_tokens=12, extra_body=body).choices[0].message.content
        assert got == want and got != plain.choices[0].message.content
    finally:
        spec.stop()


def test_responses_api_forced_tool_call_and_its_output(server):
    tool = {"type": "function", "name": "add", "parameters": PARAMS["add"], "strict": True}
    r = server.client.responses.create(model=NAME, input="Add 2 and 3.", tools=[tool], temperature=0,
                                       tool_choice={"type": "function", "name": "add"}, max_output_tokens=80)
    (call,) = [o for o in r.output if o.type == "function_call"]
    assert call.name == "add"
    jsonschema.validate(json.loads(call.arguments), PARAMS["add"])
    more = server.client.responses.create(model=NAME, previous_response_id=r.id, tools=[tool], temperature=0,
                                          input=[{"type": "function_call_output", "call_id": call.call_id, "output": "5"}],
                                          max_output_tokens=8)
    # (the default model's template renders neither calls nor tool results' roles specially: only accepted here)
    assert more.status in ("completed", "incomplete") and more.previous_response_id == r.id
