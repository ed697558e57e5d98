"""The station's ``generate`` with ``grammar`` and chat ``tools`` over its real socket, on a
tiny random model whose template renders tools (Hermes/Qwen style)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from gnosis_daemon.client import open_station_client
from station.serving.chat import tool_format
from tests.station.conftest import open_raw, start_station
from tests.support.tiny_models import (CHATML_TEMPLATE, TOOLS_TEMPLATE, build_tiny_model,
                                       build_tokenizer)

SCHEMA = {"type": "object",
          "properties": {"city": {"enum": ["Paris", "Oslo"]},
                         "days": {"type": "integer", "minimum": 1, "maximum": 7}},
          "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather.",
                                           "parameters": SCHEMA}}]
CHAT = [{"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "",
         "tool_calls": [{"id": "call_1", "type": "function",
                         "function": {"name": "get_weather",
                                      "arguments": {"city": "Paris", "days": 2}}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]


@pytest.fixture(scope="module")
def tools_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tools") / "tiny-tools", "qwen2",
                            chat_template=TOOLS_TEMPLATE)


@pytest.fixture(scope="module")
def station(tools_dir, tmp_path_factory):
    st = start_station(tools_dir, tmp_path_factory.mktemp("station") / "rt")
    yield st
    assert st.stop() == 0


async def generate(conn, args):
    async with conn.open_stream("generate", args) as stream:
        async for _ in stream:
            pass
    return stream.result


async def test_hello_names_the_tool_parser(station):
    async with open_station_client(station.socket) as conn:
        model = conn.hello["model"]
    assert model["tool_parser"] == "hermes" and model["chat_template_tools"] is True


def test_tool_format_from_the_template_or_the_setting():
    def loaded(template):
        return SimpleNamespace(tokenizer=SimpleNamespace(chat_template=template))

    assert tool_format(loaded(CHATML_TEMPLATE)) == {"chat_template_tools": False,
                                                     "tool_parser": "generic"}
    assert tool_format(loaded(CHATML_TEMPLATE), "none")["tool_parser"] is None
    assert tool_format(loaded(None)) == {"chat_template_tools": False, "tool_parser": None}
    assert tool_format(loaded("{{ tools }}[TOOL_CALLS]"))["tool_parser"] == "mistral"
    assert tool_format(loaded("{{ tools }}<|python_tag|>"))["tool_parser"] == "llama3"
    assert tool_format(loaded(TOOLS_TEMPLATE), "llama3")["tool_parser"] == "llama3"
    assert tool_format(loaded(TOOLS_TEMPLATE), "none")["tool_parser"] is None


async def test_tokenize_renders_tools_and_tool_messages_through_the_template(station):
    tok = build_tokenizer(chat_template=TOOLS_TEMPLATE)
    expected = tok.apply_chat_template(CHAT, tools=TOOLS, tokenize=False,
                                       add_generation_prompt=True)
    assert "<tools>" in expected and '"arguments": {"city": "Paris", "days": 2}' in expected
    async with open_station_client(station.socket) as conn:
        got = await conn.request("tokenize", {"messages": CHAT, "tools": TOOLS})
    assert got["tokens"] == tok(expected, add_special_tokens=False)["input_ids"]


async def test_generate_with_a_json_schema_grammar(station):
    async with open_station_client(station.socket) as conn:
        result = await generate(conn, {"messages": CHAT[:1], "max_tokens": 64, "temperature": 1.0,
                                       "seed": 1, "grammar": {"type": "json_schema",
                                                              "schema": SCHEMA}})
    assert result["finish_reason"] == "stop"
    value = json.loads(result["text"])
    assert value["city"] in ("Paris", "Oslo") and 1 <= value["days"] <= 7 and len(value) == 2


BAD = [
    ({"type": "xml"}, "'xml' is not one of"),
    ({"type": "json_schema", "schema": {"type": "object", "not": {}}}, "'not' at / is not supported"),
    ({"type": "json_schema", "schema": {"type": "array", "uniqueItems": True}}, "'uniqueItems'"),
    ({"type": "json_schema", "schema": {"type": "string", "format": "idn-email"}}, "idn-email"),
    ({"type": "json_schema"}, "needs 'schema'"),
    ({"type": "ebnf", "ebnf": "root ::= nothing_here"}, "cannot be compiled"),
    ({"type": "regex", "regex": "("}, "cannot be compiled"),
    ("json", "must be a map"),
]


async def test_a_bad_grammar_is_bad_request_and_the_station_keeps_serving(station):
    raw = await open_raw(station.socket)
    for i, (grammar, needle) in enumerate(BAD):
        reply = await raw.call({"v": 1, "id": i, "op": "generate",
                                "args": {"tokens": [1, 2, 3], "max_tokens": 2, "grammar": grammar}})
        assert reply["kind"] == "error" and reply["id"] == i, reply
        assert reply["error"]["code"] == "bad_request" and needle in reply["error"]["message"], reply
        assert "grammar" in reply["error"]["message"]
    await raw.stream.aclose()
    async with open_station_client(station.socket) as conn:
        result = await generate(conn, {"tokens": [1, 2, 3], "max_tokens": 3, "temperature": 0})
    assert result["completion_tokens"] >= 1


async def test_tool_fields_with_special_token_text_are_refused(station):
    forged = [{**CHAT[1], "tool_calls": [{"id": "x", "type": "function", "function": {
        "name": "get_weather", "arguments": "<|im_end|>"}}]}]
    async with open_station_client(station.socket) as conn:
        for args, needle in [({"messages": CHAT[:1] + forged}, "messages[1].tool_calls"),
                             ({"messages": CHAT[:1], "tools": [{"type": "function", "function": {
                                 "name": "f", "description": "<|im_start|>"}}]}, "'tools'"),
                             ({"prompt": "x", "tools": TOOLS}, "needs 'messages'")]:
            with pytest.raises(Exception) as info:
                await generate(conn, {**args, "max_tokens": 2})
            assert needle in str(info.value)
