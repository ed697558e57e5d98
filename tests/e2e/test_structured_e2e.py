"""End to end with the official openai client: response_format and tools against
`gnosis-daemon run` on a tiny random model whose chat template renders tools (Hermes/Qwen
style). The weights are random, so only the grammar makes the output valid: every answer
below must parse and match its schema, streamed or not."""

from __future__ import annotations

import json

import openai
import pytest

from tests.support.procs import openai_on_daemon
from tests.support.tiny_models import TOOLS_TEMPLATE, build_tiny_model

SCHEMA = {"type": "object",
          "properties": {"colour": {"enum": ["red", "green", "blue"]},
                         "count": {"type": "integer", "minimum": 0, "maximum": 99},
                         "ok": {"type": "boolean"}},
          "required": ["colour", "count", "ok"], "additionalProperties": False}
WEATHER = {"type": "object",
           "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]},
                          "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather.",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
             "required": ["zone"], "additionalProperties": False}}}]
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    root = tmp_path_factory.mktemp("structured")
    model_dir = build_tiny_model(root / "tiny-tools", "qwen2", chat_template=TOOLS_TEMPLATE)
    with openai_on_daemon(model_dir, root) as client:
        yield client


def create(client, **kwargs):
    kwargs.setdefault("messages", MESSAGES)
    kwargs.setdefault("max_tokens", 240)  # one byte a token: a call is ~100 tokens
    return client.chat.completions.create(model=client.model_id, **kwargs)


def streamed(client, **kwargs):
    """(content, tool calls {index: {id, name, arguments}}, finish reasons) of a stream."""
    content, calls, reasons = [], {}, []
    for chunk in create(client, stream=True, **kwargs):
        for choice in chunk.choices:
            delta = choice.delta
            content.append(delta.content or "")
            for part in delta.tool_calls or ():
                call = calls.setdefault(part.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = part.id or call["id"]
                if part.function is not None:
                    call["name"] += part.function.name or ""
                    call["arguments"] += part.function.arguments or ""
            if choice.finish_reason:
                reasons.append(choice.finish_reason)
    return "".join(content), calls, reasons


def check_colours(value):
    assert set(value) == {"colour", "count", "ok"}
    assert value["colour"] in ("red", "green", "blue") and isinstance(value["ok"], bool)
    assert isinstance(value["count"], int) and 0 <= value["count"] <= 99


def check_weather(arguments: str):
    value = json.loads(arguments)
    assert set(value) == {"city", "days"} and value["city"] in ("Paris", "Oslo", "Lima")
    assert isinstance(value["days"], int) and 1 <= value["days"] <= 7


FORMAT = {"type": "json_schema", "json_schema": {"name": "colours", "schema": SCHEMA,
                                                 "strict": True}}


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.2, "seed": 4}])
def test_json_schema_output_parses_and_validates(client, sampling):
    resp = create(client, response_format=FORMAT, **sampling)
    assert resp.choices[0].finish_reason == "stop"
    check_colours(json.loads(resp.choices[0].message.content))
    text, calls, reasons = streamed(client, response_format=FORMAT, **sampling)
    assert text == resp.choices[0].message.content and not calls and reasons == ["stop"]


def test_json_object_output_is_an_object(client):
    resp = create(client, response_format={"type": "json_object"}, temperature=0.9, seed=2,
                  max_tokens=300)
    assert resp.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(resp.choices[0].message.content), dict)


def test_an_unsupported_schema_feature_is_a_400_naming_it(client):
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "array", "uniqueItems": True}}}}}
    with pytest.raises(openai.BadRequestError) as info:
        create(client, response_format=bad)
    error = info.value.body
    assert error["param"] == "response_format.json_schema.schema"
    assert "'uniqueItems' at /properties/a" in error["message"]
    assert create(client, max_tokens=3).choices[0].finish_reason in ("stop", "length")


def test_named_tool_choice_calls_that_function_with_valid_arguments(client):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    resp = create(client, tools=TOOLS, tool_choice=choice, temperature=1.0, seed=9)
    message = resp.choices[0].message
    assert resp.choices[0].finish_reason == "tool_calls" and message.content is None
    assert len(message.tool_calls) == 1
    call = message.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    check_weather(call.function.arguments)
    text, calls, reasons = streamed(client, tools=TOOLS, tool_choice=choice, temperature=1.0,
                                    seed=9)
    assert text == "" and reasons == ["tool_calls"] and list(calls) == [0]
    assert calls[0]["name"] == "get_weather" and calls[0]["id"].startswith("call_")
    assert json.loads(calls[0]["arguments"]) == json.loads(call.function.arguments)


@pytest.mark.parametrize("parallel", [True, False])
def test_required_tool_choice_always_calls_a_tool(client, parallel):
    for seed in (1, 2):
        resp = create(client, tools=TOOLS, tool_choice="required", parallel_tool_calls=parallel,
                      temperature=1.0, seed=seed)
        calls = resp.choices[0].message.tool_calls
        assert resp.choices[0].finish_reason == "tool_calls" and calls
        assert len(calls) == 1 or parallel
        for call in calls:
            if call.function.name == "get_weather":
                check_weather(call.function.arguments)
            else:
                assert call.function.name == "get_time"
                assert json.loads(call.function.arguments)["zone"] in ("UTC", "CET")


def test_a_conversation_with_a_tool_call_and_its_result(client):
    first = create(client, tools=TOOLS, tool_choice="required", temperature=0)
    call = first.choices[0].message.tool_calls[0]
    history = [*MESSAGES,
               {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
               {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    resp = create(client, messages=history, tools=TOOLS, temperature=0, max_tokens=8)
    assert resp.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert resp.usage.prompt_tokens > first.usage.prompt_tokens


def test_tool_choice_none_and_auto_answer(client):
    none = create(client, tools=TOOLS, tool_choice="none", temperature=0, max_tokens=8)
    plain = create(client, temperature=0, max_tokens=8)
    assert none.choices[0].message.content == plain.choices[0].message.content
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens  # the tools are not rendered
    auto = create(client, tools=TOOLS, temperature=0, max_tokens=8)
    assert auto.usage.prompt_tokens > plain.usage.prompt_tokens  # they are


NESTED = {
    "type": "object",
    "properties": {
        "ship": {"type": "object",
                 "properties": {"name": {"enum": ["Ada", "Brig", "Cog"]},
                                "crew": {"type": "integer", "minimum": 1, "maximum": 40}},
                 "required": ["name", "crew"], "additionalProperties": False},
        "cargo": {"type": "array", "items": {"enum": ["salt", "tea", "wool"]},
                  "minItems": 1, "maxItems": 3},
        "stops": {"type": "array", "maxItems": 2,
                  "items": {"type": "object",
                            "properties": {"port": {"enum": ["Oslo", "Lima"]},
                                           "days": {"type": "integer", "minimum": 0, "maximum": 9}},
                            "required": ["port", "days"], "additionalProperties": False}},
        "late": {"type": "boolean"},
    },
    "required": ["ship", "cargo", "stops", "late"], "additionalProperties": False,
}


def test_twenty_samples_at_temperature_1_of_a_nested_schema_all_validate(client):
    """Nested objects, arrays (of enums and of objects) and enums: 20 sampled outputs (two
    requests of n=10, each choice its own seed) all parse and validate."""
    import jsonschema

    fmt = {"type": "json_schema", "json_schema": {"name": "voyage", "schema": NESTED, "strict": True}}
    outputs = []
    for seed in (100, 200):
        resp = create(client, response_format=fmt, temperature=1.0, seed=seed, n=10, max_tokens=400)
        assert len(resp.choices) == 10
        for choice in resp.choices:
            assert choice.finish_reason == "stop", choice
            outputs.append(json.loads(choice.message.content))
    assert len(outputs) == 20
    for value in outputs:
        jsonschema.validate(value, NESTED)
    assert len({json.dumps(v, sort_keys=True) for v in outputs}) > 1  # sampled, not one answer
