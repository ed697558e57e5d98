"""Tool-call parsers on fixed strings, whole and streamed in every split, for the three
families; and the grammar that forces a call."""

from __future__ import annotations

import json

import pytest

from gnosis_daemon.grammar_spec import check_grammar
from host.tool_calls import ToolCallParser, forced_grammar, parse_tool_calls

WEATHER = {"city": "Paris", "days": 2}
CASES = [
    # family, output, content, [(name, arguments)]
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": '
               '{"city": "Paris", "days": 2}}\n</tool_call>', "Let me check.\n",
     [("get_weather", WEATHER)]),
    ("hermes", '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n<tool_call>\n'
               '{"name": "b", "arguments": {"x": [1, "<"]}}\n</tool_call>', None,
     [("a", {}), ("b", {"x": [1, "<"]})]),
    ("hermes", "A plain answer with a < sign and <tool talk.", "A plain answer with a < sign "
               "and <tool talk.", []),
    ("hermes", "<tool_call>\n{not json}\n</tool_call>", "<tool_call>\n{not json}\n</tool_call>", []),
    ("hermes", '<tool_call>{"name": "a", "arguments": {"k": 1}}', None, [("a", {"k": 1})]),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}]',
     None, [("get_weather", WEATHER)]),
    ("mistral", '[{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"y": true}}]', None,
     [("a", {}), ("b", {"y": True})]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 2}', None,
     [("get_weather", WEATHER)]),
    ("mistral", "Sure: [1, 2] is a list.", "Sure: [1, 2] is a list.", []),
    ("mistral", "[1, 2]", "[1, 2]", []),
    ("llama3", '{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}', None,
     [("get_weather", WEATHER)]),
    ("llama3", '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "arguments": {"z": 0}}',
     None, [("a", {}), ("b", {"z": 0})]),
    ("llama3", '{"answer": 42}', '{"answer": 42}', []),
    ("llama3", "Paris is sunny.", "Paris is sunny.", []),
]


def expect(calls, expected):
    assert [(c.name, json.loads(c.arguments)) for c in calls] == expected
    assert all(c.id.startswith("call_") and len(c.id) == 29 for c in calls)
    assert len({c.id for c in calls}) == len(calls)


@pytest.mark.parametrize("family, output, content, expected", CASES)
def test_whole_output(family, output, content, expected):
    got_content, calls = parse_tool_calls(output, family)
    assert got_content == content
    expect(calls, expected)


@pytest.mark.parametrize("family, output, content, expected", CASES)
def test_streamed_in_pieces_of_every_size(family, output, content, expected):
    for size in (1, 2, 3, 7, len(output)):
        parser = ToolCallParser(family)
        text, calls = [], []
        for i in range(0, len(output), size):
            piece, new = parser.feed(output[i:i + size])
            text.append(piece)
            calls += new
        piece, new = parser.finish()
        text.append(piece)
        calls += new
        joined = "".join(text)
        assert (joined if joined.strip() else None) == content, size
        expect(calls, expected)


def test_streamed_text_is_held_back_only_while_it_may_be_a_marker():
    parser = ToolCallParser("hermes")
    assert parser.feed("Hello <tool") == ("Hello ", [])
    assert parser.feed("box> there") == ("<toolbox> there", [])
    text, calls = parser.feed('<tool_call>{"name": "f", "arguments": {}}</tool_call>')
    assert text == "" and [c.name for c in calls] == ["f"]


def test_a_call_is_emitted_as_soon_as_its_block_closes():
    parser = ToolCallParser("hermes")
    assert parser.feed('<tool_call>{"name": "f", "arguments": {"a": 1}}') == ("", [])
    text, calls = parser.feed("</tool_call>\n")
    assert json.loads(calls[0].arguments) == {"a": 1}


def test_parallel_tool_calls_false_keeps_the_first_call():
    output = ('<tool_call>{"name": "a", "arguments": {}}</tool_call>'
              '<tool_call>{"name": "b", "arguments": {}}</tool_call>')
    content, calls = parse_tool_calls(output, "hermes", max_calls=1)
    assert content is None and [c.name for c in calls] == ["a"]


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}},
    "required": ["city"], "additionalProperties": False}}},
         {"type": "function", "function": {"name": "noop"}}]


@pytest.mark.parametrize("family", ["hermes", "mistral", "llama3"])
def test_forced_grammar_is_a_valid_spec_whose_output_the_parser_reads(family):
    grammar = check_grammar(forced_grammar(family, TOOLS, one=False))
    fmt = grammar["structural_tag"]["format"]
    calls = fmt if fmt["type"] == "tags_with_separator" else fmt["elements"][
        1 if family == "mistral" else 0]
    assert calls["at_least_one"] is True and calls["stop_after_first"] is False
    assert [t["content"]["json_schema"] for t in calls["tags"]] == [
        TOOLS[0]["function"]["parameters"], {"type": "object"}]
    # Text of the forced form (as the grammar writes it) parses back to the calls.
    prefix = "[" if family == "mistral" else ""
    suffix = "]" if family == "mistral" else ""
    tags = calls["tags"]
    text = prefix + tags[0]["begin"] + '{"city": "Oslo"}' + tags[0]["end"] + calls["separator"] + \
        tags[1]["begin"] + "{}" + tags[1]["end"] + suffix
    content, parsed = parse_tool_calls(text, family)
    assert content is None
    expect(parsed, [("get_weather", {"city": "Oslo"}), ("noop", {})])
