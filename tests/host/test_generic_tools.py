"""The generic tool format (host.generic_tools) for a model whose chat template renders no
tools: the tools in the system prompt, the call forced by grammar, parsed back into
tool_calls; through `gnosis-daemon run` and the official openai client on a tiny random
model with a plain ChatML template. Also: a schema past grammar_max_nodes is a quick 400
while another tenant's chat is served, and stop strings with a grammar are refused."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
import trio
from openai import OpenAI

from host.completions import with_tools
from host.generic_tools import CALL_RULES, generic_messages
from host.openai_api import parse_chat
from host.tool_calls import forced_grammar, parse_tool_calls
from tests.support.procs import free_port, run_daemon
from tests.support.tiny_models import build_tiny_model

WEATHER = {"type": "object",
           "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]},
                          "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
        "required": ["zone"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather.",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
GENERIC = {"chat_template_tools": False, "tool_parser": "generic"}


def test_the_tools_calls_and_results_become_text_the_template_renders():
    history = [{"role": "system", "content": "Be brief."}, *USER,
               {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {
                   "name": "get_weather", "arguments": {"city": "Paris", "days": 2}}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    out = generic_messages(history, TOOLS)
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert out[0]["content"].startswith("Be brief.\n\n") and CALL_RULES in out[0]["content"]
    assert json.dumps({"name": "get_time", "parameters": TIME}) in out[0]["content"]
    assert json.loads(out[2]["content"]) == {"tool_calls": [
        {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}]}
    assert out[3]["content"] == "Tool result (call_1): sunny"
    assert generic_messages(USER, TOOLS)[0]["role"] == "system"  # a system message of its own


def test_with_tools_on_a_generic_model_sends_no_tools_and_forces_the_call():
    req, parser = with_tools(parse_chat({"messages": USER, "tools": TOOLS,
                                         "tool_choice": "required"}), GENERIC)
    assert parser == "generic" and "tools" not in req.station_args
    assert req.station_args["messages"][0]["role"] == "system"
    assert req.station_args["grammar"] == forced_grammar("generic", TOOLS, one=False)
    auto, _ = with_tools(parse_chat({"messages": USER, "tools": TOOLS}), GENERIC)
    assert "grammar" not in auto.station_args  # auto asks, does not force


def test_the_generic_parser():
    text = '{"tool_calls": [{"name": "get_time", "arguments": {"zone": "UTC"}}]}'
    content, calls = parse_tool_calls(text, "generic")
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_time", {"zone": "UTC"})]
    assert parse_tool_calls('{"answer": 1}', "generic") == ('{"answer": 1}', [])
    assert parse_tool_calls("Hello there", "generic") == ("Hello there", [])
    content, calls = parse_tool_calls('Sure. {"tool_calls": [{"name": "a", "arguments": {}}]}',
                                      "generic")
    assert content == "Sure. " and calls[0].name == "a"


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    root = tmp_path_factory.mktemp("generic")
    model_dir = build_tiny_model(root / "tiny-chatml", "qwen2")  # ChatML: renders no tools
    port = free_port()
    with run_daemon(model_dir, root / "run", port, log_path=root / "daemon.log"):
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused",
                        max_retries=0, timeout=120)
        client.model_id = client.models.list().data[0].id
        yield client


def create(client, **kwargs):
    kwargs.setdefault("messages", USER)
    kwargs.setdefault("max_tokens", 240)  # one byte a token: a call is ~90 tokens
    return client.chat.completions.create(model=client.model_id, **kwargs)


def check_call(call) -> None:
    assert call.type == "function" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("parallel", [True, False])
def test_required_gives_valid_calls(client, parallel):
    resp = create(client, tools=TOOLS, tool_choice="required", parallel_tool_calls=parallel,
                  temperature=1.0, seed=3)
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.tool_calls and (parallel or len(choice.message.tool_calls) == 1)
    for call in choice.message.tool_calls:
        check_call(call)


def test_a_named_function_streamed(client):
    named = {"type": "function", "function": {"name": "get_weather"}}
    calls, reasons, content = {}, [], ""
    for chunk in create(client, tools=TOOLS, tool_choice=named, temperature=1.0, seed=8,
                        stream=True):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for part in choice.delta.tool_calls or ():
                call = calls.setdefault(part.index, {"name": "", "arguments": ""})
                call["name"] += part.function.name or ""
                call["arguments"] += part.function.arguments or ""
            if choice.finish_reason:
                reasons.append(choice.finish_reason)
    assert content == "" and reasons == ["tool_calls"] and list(calls) == [0]
    assert calls[0]["name"] == "get_weather"
    jsonschema.validate(json.loads(calls[0]["arguments"]), WEATHER)


def test_auto_renders_the_tools_without_forcing_a_call(client):
    plain = create(client, temperature=0, max_tokens=4)
    auto = create(client, tools=TOOLS, temperature=0, max_tokens=4)
    assert auto.usage.prompt_tokens > plain.usage.prompt_tokens + 100  # the tools are in it
    assert auto.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_stop_strings_with_a_grammar_are_refused(client):
    with pytest.raises(openai.BadRequestError) as info:
        create(client, response_format={"type": "json_object"}, stop=["}"])
    assert info.value.body["param"] == "stop"


def test_a_9000_property_schema_is_a_quick_400_while_another_chat_is_served(client):
    wide = {"type": "json_schema", "json_schema": {"name": "wide", "schema": {
        "type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(9000)}}}}
    results = {}

    def huge():
        try:
            create(client, response_format=wide, max_tokens=8)
        except openai.BadRequestError as exc:
            results["huge"] = exc.body

    def other():
        resp = create(client, temperature=1.0, max_tokens=16, seed=1,
                      messages=[{"role": "user", "content": "Hello"}])
        results["other"] = resp.choices[0].finish_reason

    async def both():
        with trio.fail_after(60):  # "answered at all"
            async with trio.open_nursery() as nursery:
                nursery.start_soon(trio.to_thread.run_sync, huge)
                nursery.start_soon(trio.to_thread.run_sync, other)

    trio.run(both)
    assert results["huge"]["param"] == "response_format"
    assert "grammar_max_nodes" in results["huge"]["message"]
    assert results["other"] in ("stop", "length")


def test_tokenize_with_tools_counts_the_prompt_a_completion_prefills(client):
    import httpx

    base = str(client.base_url).rstrip("/").removesuffix("/v1")
    got = httpx.post(f"{base}/tokenize", json={"messages": USER, "tools": TOOLS}, timeout=60)
    assert got.status_code == 200, got.text
    resp = create(client, tools=TOOLS, temperature=0, max_tokens=1)
    assert got.json()["count"] == resp.usage.prompt_tokens
