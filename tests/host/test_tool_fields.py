"""``tools``, ``tool_choice``, ``parallel_tool_calls``, ``response_format`` and messages' tool
fields: what reaches the station, and every refusal with OpenAI's 400 naming the field."""

from __future__ import annotations

import pytest

from gnosis_daemon.client import StationError
from host.completions import check_grammar_support, station_error, with_tools
from host.errors import ApiError
from host.openai_api import parse_chat

USER = [{"role": "user", "content": "hi"}]
PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather.",
                                           "parameters": PARAMS, "strict": True}},
         {"type": "function", "function": {"name": "noop"}}]
HERMES = {"chat_template_tools": True, "tool_parser": "hermes"}


def refused(body) -> dict:
    with pytest.raises(ApiError) as info:
        parse_chat(body)
    assert info.value.status == 400
    return info.value.body()["error"]


def test_response_format_becomes_the_station_grammar():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    for value, grammar in [
        ({"type": "json_object"}, {"type": "json_object"}),
        ({"type": "json_schema", "json_schema": {"name": "s", "schema": schema, "strict": True}},
         {"type": "json_schema", "schema": schema}),
        ({"type": "json_schema", "json_schema": {"name": "s"}}, {"type": "json_object"}),
    ]:
        req = parse_chat({"messages": USER, "response_format": value})
        assert req.station_args["grammar"] == grammar and req.grammar_param == "response_format"
    assert "grammar" not in parse_chat({"messages": USER,
                                        "response_format": {"type": "text"}}).station_args


@pytest.mark.parametrize("value, param, code, words", [
    ({"type": "json_schema", "json_schema": {"name": "s", "schema": {"not": {}}}},
     "response_format.json_schema.schema", "unsupported_value", "'not' at /"),
    ({"type": "json_schema", "json_schema": {"name": "s", "schema": {
        "type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}}}},
     "response_format.json_schema.schema", "unsupported_value", "'uniqueItems' at /properties/tags"),
    ({"type": "json_schema", "json_schema": {"name": "s", "schema": {
        "type": "string", "format": "idn-email"}}},
     "response_format.json_schema.schema", "unsupported_value", "idn-email"),
    ({"type": "json_schema", "json_schema": {"schema": {}}}, "response_format.json_schema.name",
     "missing_required_parameter", "name"),
    ({"type": "json_schema", "json_schema": {"name": "bad name!"}},
     "response_format.json_schema.name", "invalid_value", "characters"),
    ({"type": "json_schema"}, "response_format.json_schema", "missing_required_parameter", ""),
    ({"type": "grammar"}, "response_format.type", "invalid_value", "'grammar'"),
    ({"type": "json_object", "schema": {}}, "response_format.schema", "unknown_parameter", ""),
    ("json", "response_format", "invalid_type", ""),
])
def test_bad_response_formats_are_refused_naming_the_field(value, param, code, words):
    error = refused({"messages": USER, "response_format": value})
    assert (error["param"], error["code"]) == (param, code)
    assert words in error["message"]


def test_tools_auto_render_and_parse_without_a_grammar():
    req = parse_chat({"messages": USER, "tools": TOOLS})
    assert req.tools.choice == "auto" and req.tools.parallel and not req.tools.forced
    # strict is OpenAI's and not the template's business; everything else is passed on.
    assert req.station_args["tools"] == [
        {"type": "function", "function": {"name": "get_weather", "description": "Weather.",
                                          "parameters": PARAMS}},
        {"type": "function", "function": {"name": "noop"}}]
    req, parser = with_tools(req, HERMES)
    assert parser == "hermes" and "grammar" not in req.station_args


def test_tool_choice_none_sends_no_tools():
    req = parse_chat({"messages": USER, "tools": TOOLS, "tool_choice": "none"})
    assert req.tools is None and "tools" not in req.station_args
    assert with_tools(req, HERMES) == (req, None)


@pytest.mark.parametrize("choice, parallel, names, one", [
    ("required", None, ["get_weather", "noop"], False),
    ("required", False, ["get_weather", "noop"], True),
    ({"type": "function", "function": {"name": "noop"}}, None, ["noop"], True),
])
def test_required_and_named_tool_choice_force_a_call_with_a_grammar(choice, parallel, names, one):
    body = {"messages": USER, "tools": TOOLS, "tool_choice": choice}
    if parallel is not None:
        body["parallel_tool_calls"] = parallel
    req, parser = with_tools(parse_chat(body), HERMES)
    assert req.grammar_param == "tool_choice"
    calls = req.station_args["grammar"]["structural_tag"]["format"]
    assert [t["begin"].split('"')[3] for t in calls["tags"]] == names
    assert calls["stop_after_first"] is one and calls["at_least_one"] is True


@pytest.mark.parametrize("model, words", [
    ({"chat_template_tools": False, "tool_parser": None}, "does not render tools"),
    ({"chat_template_tools": True, "tool_parser": None}, "tool_parser"),
    ({}, "does not render tools"),
])
def test_tools_on_a_model_that_cannot_take_them_are_refused(model, words):
    with pytest.raises(ApiError) as info:
        with_tools(parse_chat({"messages": USER, "tools": TOOLS}), model)
    error = info.value.body()["error"]
    assert (error["param"], error["code"]) == ("tools", "unsupported_value")
    assert words in error["message"]


@pytest.mark.parametrize("extra, param, code", [
    ({"tools": {"a": 1}}, "tools", "invalid_type"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type", "invalid_value"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name",
     "invalid_value"),
    ({"tools": [{"type": "function", "function": {"name": "a", "extra": 1}}]},
     "tools[0].function.extra", "unknown_parameter"),
    ({"tools": [TOOLS[1], TOOLS[1]]}, "tools", "invalid_value"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "invalid_value"),
    ({"tool_choice": "required"}, "tool_choice", "invalid_value"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "invalid_value"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls", "invalid_type"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"not": {}}}}],
      "tool_choice": "required"}, "tools[0].function.parameters", "unsupported_value"),
    ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "response_format",
     "invalid_value"),
])
def test_bad_tool_fields_are_refused_naming_the_field(extra, param, code):
    error = refused({"messages": USER, **extra})
    assert (error["param"], error["code"]) == (param, code)


def test_an_unenforceable_schema_is_fine_when_no_call_is_forced():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"not": {}}}}]
    assert parse_chat({"messages": USER, "tools": tools}).tools.choice == "auto"


def test_tool_calls_and_tool_results_reach_the_template():
    req = parse_chat({"messages": [
        *USER,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "call_2", "type": "function", "function": {"name": "noop", "arguments": "x"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]})
    assistant, tool = req.station_args["messages"][1:]
    assert assistant == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
        {"id": "call_2", "type": "function", "function": {"name": "noop", "arguments": "x"}}]}
    assert tool == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}


@pytest.mark.parametrize("message, param, code", [
    ({"role": "tool", "content": "x", "tool_call_id": 7}, "messages[0].tool_call_id",
     "invalid_type"),
    ({"role": "user", "content": "x", "tool_calls": [{"id": "c", "type": "function", "function": {
        "name": "f", "arguments": "{}"}}]}, "messages[0].tool_calls", "invalid_value"),
    ({"role": "assistant", "content": None, "tool_calls": [{"id": "c", "function": {
        "name": "f", "arguments": {}}}]}, "messages[0].tool_calls[0].function.arguments",
     "invalid_type"),
    ({"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": {
        "name": "f", "arguments": "{}"}}]}, "messages[0].tool_calls[0].id", "invalid_type"),
])
def test_bad_message_tool_fields_are_refused(message, param, code):
    error = refused({"messages": [message]})
    assert (error["param"], error["code"]) == (param, code)


def test_a_grammar_needs_a_station_with_structured_output():
    for body, param in [({"response_format": {"type": "json_object"}}, "response_format"),
                        ({"tools": TOOLS, "tool_choice": "required"}, "tool_choice")]:
        req, _ = with_tools(parse_chat({"messages": USER, **body}), HERMES)
        check_grammar_support(req, {"generate": True, "structured_output": True})
        with pytest.raises(ApiError) as info:
            check_grammar_support(req, {"generate": True})
        error = info.value.body()["error"]
        assert (error["param"], error["code"]) == (param, "unsupported_value")
    plain, _ = with_tools(parse_chat({"messages": USER, "tools": TOOLS}), HERMES)
    check_grammar_support(plain, {"generate": True})  # auto needs no grammar


def test_a_grammar_or_tools_the_station_refuses_is_blamed_on_its_field():
    fmt = parse_chat({"messages": USER, "response_format": {"type": "json_schema", "json_schema": {
        "name": "s", "schema": {"type": "string", "pattern": "(?<=a)b"}}}})
    compile_error = StationError("bad_request", "argument 'grammar' cannot be compiled: lookbehind")
    error = station_error(compile_error, fmt).body()["error"]
    assert (error["param"], error["code"]) == ("response_format", "invalid_value")
    assert "lookbehind" in error["message"]
    forced, _ = with_tools(parse_chat({"messages": USER, "tools": TOOLS,
                                       "tool_choice": "required"}), HERMES)
    assert station_error(compile_error, forced).body()["error"]["param"] == "tool_choice"
    tools_error = StationError("bad_request", "argument 'tools' holds special-token text")
    assert station_error(tools_error, forced).body()["error"]["param"] == "tools"
    other = StationError("bad_request", "chat template rejected the messages: roles")
    assert station_error(other, fmt).body()["error"]["param"] == "messages"
