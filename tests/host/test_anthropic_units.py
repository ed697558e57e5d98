"""The Anthropic dialect's pure parts: a Messages body as the chat path's station arguments,
its cache_control breakpoints as TTL pins, and the usage counts from the pins' reports."""

from __future__ import annotations

import pytest

from gnosis_daemon.wire.pins import PinReport
from host import cache_pins
from host.anthropic_api import Breakpoint, parse_messages
from host.anthropic_format import matched_stop, usage
from host.errors import ApiError
from host.openai_api import parse_chat

EPHEMERAL = {"type": "ephemeral"}
HOUR = {"type": "ephemeral", "ttl": "1h"}
TTL_S = {"5m": 300.0, "1h": 3600.0}


def body(**kw):
    return {"model": "m", "max_tokens": 5, **kw}


def test_a_conversation_is_the_chat_paths_station_arguments():
    req = parse_messages(body(
        system=[{"type": "text", "text": "A. "}, {"type": "text", "text": "B."}],
        messages=[{"role": "user", "content": "Hi"},
                  {"role": "assistant", "content": [
                      {"type": "text", "text": "Let me look."},
                      {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {"x": 1}}]},
                  {"role": "user", "content": [
                      {"type": "tool_result", "tool_use_id": "toolu_1", "content": [
                          {"type": "text", "text": "42"}]},
                      {"type": "text", "text": "Thanks"}]}],
        tools=[{"name": "f", "input_schema": {"type": "object"}}], stop_sequences=["\n\n"],
        temperature=0.5, metadata={"user_id": "u-1"}))
    chat = parse_chat({"messages": [
        {"role": "system", "content": "A. B."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "42"},
        {"role": "user", "content": "Thanks"}],
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
        "max_tokens": 5, "temperature": 0.5, "stop": ["\n\n"], "user": "u-1"})
    assert req.chat.station_args == chat.station_args
    assert req.chat.session_name == chat.session_name == "u-1"
    assert req.stop_sequences == ("\n\n",) and req.breakpoints == ()


def test_breakpoints_are_found_in_prompt_order_with_where_their_prefix_ends():
    req = parse_messages(body(
        tools=[{"name": "f", "input_schema": {"type": "object"}, "cache_control": HOUR}],
        system=[{"type": "text", "text": "S1", "cache_control": HOUR},
                {"type": "text", "text": "S2", "cache_control": EPHEMERAL}],
        messages=[{"role": "user", "content": [{"type": "text", "text": "Q", "cache_control": EPHEMERAL}]}]))
    assert req.breakpoints == (
        Breakpoint("1h", "tools.0.cache_control", None),
        Breakpoint("1h", "system.0.cache_control", 0, False, 2),  # "S1": 2 characters
        Breakpoint("5m", "system.1.cache_control", 0, True),
        Breakpoint("5m", "messages.0.content.0.cache_control", 1, True))
    auto = parse_messages(body(cache_control=EPHEMERAL, messages=[{"role": "user", "content": "Q"}]))
    assert auto.breakpoints == (Breakpoint("5m", "cache_control", 0, True),)


def test_each_prefix_is_one_pin_whose_id_digests_the_tenant_and_the_prefix():
    req = parse_messages(body(
        system=[{"type": "text", "text": "S1", "cache_control": HOUR},
                {"type": "text", "text": "S2", "cache_control": EPHEMERAL}],
        messages=[{"role": "user", "content": [{"type": "text", "text": "Q", "cache_control": EPHEMERAL},
                                               {"type": "text", "text": "R", "cache_control": EPHEMERAL}]}]))
    messages = req.chat.station_args["messages"]
    plan = cache_pins.plan(req.breakpoints, messages, None, 0, "t", TTL_S)
    # A text block that does not end its message cuts that message's joined text where the
    # block ends: system.0 at "S1" (chars 2), the user's first block at "Q" (chars 1).
    assert [(p["messages"], p.get("parts"), p.get("chars"), p["ttl_s"]) for p in plan.pins] == \
        [(0, None, 2, 3600.0), (1, 0, None, 300.0), (1, None, 1, 300.0), (2, 0, None, 300.0)]
    assert plan.of_breakpoint == (0, 1, 2, 3)
    again = cache_pins.plan(req.breakpoints, messages, None, 0, "t", TTL_S)
    other = cache_pins.plan(req.breakpoints, messages, None, 0, "u", TTL_S)
    assert again.pins == plan.pins
    assert {p["session_id"] for p in other.pins}.isdisjoint(p["session_id"] for p in plan.pins)
    assert all(p["session_id"].startswith("t.") for p in plan.pins)
    tools = {"role": "system", "content": "the tools"}  # a message put before the request's own
    shifted = cache_pins.plan(req.breakpoints, [tools, *messages], None, 1, "t", TTL_S)
    assert [p["messages"] for p in shifted.pins] == [1, 2, 2, 3]


def report(num, read, pinned=True, reason=None):
    return PinReport(session_id="s", num_tokens=num, read_tokens=read, ttl_s=1.0,
                     expires_at=None, pinned=pinned, reason=reason)


def test_usage_counts_reads_and_creations_by_ttl_and_names_each_outcome():
    points = (Breakpoint("1h", "system.0.cache_control", 0),
              Breakpoint("5m", "messages.0.content.0.cache_control", 1),
              Breakpoint("5m", "messages.2.content.0.cache_control", 3))
    plan = cache_pins.PinPlan(({}, {}, {}), (0, 1, 2))
    got = cache_pins.usage(points, plan, (report(32, 32), report(64, 32),
                                          report(96, 0, False, "pin_budget")), None)
    assert (got.read, got.creation_1h, got.creation_5m) == (32, 0, 32)
    assert got.outcomes == [("1h", "read"), ("5m", "read"), ("5m", "downgraded")]
    assert got.cache_pins[2] == {"ttl": "5m", "tokens": 96, "pinned": False, "reason": "pin_budget"}
    assert usage(100, 5, got) == {
        "input_tokens": 36, "output_tokens": 5, "cache_creation_input_tokens": 32,
        "cache_read_input_tokens": 32,
        "cache_creation": {"ephemeral_5m_input_tokens": 32, "ephemeral_1h_input_tokens": 0}}
    first = cache_pins.usage(points[:2], cache_pins.PinPlan(({}, {}), (0, 1)),
                             (report(32, 0), report(64, 0)), None)
    assert (first.read, first.creation_1h, first.creation_5m) == (0, 32, 32)
    assert first.outcomes == [("1h", "created"), ("5m", "created")]
    off = cache_pins.usage(points[:1], None, (), "liquid memory is off")
    assert off.cache_pins == [{"ttl": "1h", "tokens": 0, "pinned": False,
                               "reason": "liquid memory is off"}]
    assert off.outcomes == [("1h", "refused")] and off.creation == off.read == 0


def test_the_stop_sequence_is_the_earliest_one_past_the_kept_text():
    assert matched_stop("Hello. World", "Hello", (" World", ".")) == "."
    assert matched_stop("Hello", "Hello", (".",)) is None


@pytest.mark.parametrize("extra, field", [
    ({"cache_control": {"type": "persistent"}}, "cache_control.type"),
    ({"system": [{"type": "text", "text": "a", "cache_control": {"type": "ephemeral",
                                                                "ttl": "2h"}}]}, "system.0.cache_control.ttl"),
    ({"stop_sequences": [""]}, "stop_sequences.0"),
    ({"top_k": 0}, "top_k"),
    ({"output_config": {"effort": "high"}}, "output_config"),
    ({"speed": "warp"}, "speed"),
    ({"tools": [{"name": "f", "input_schema": {"type": "object"}}],
      "tool_choice": {"type": "tool", "name": "g"}}, "tool_choice.name"),
    ({"tools": [{"name": "f", "input_schema": {"type": "object"}, "type": "bash_20250124"}]},
     "tools.0.type"),
    ({"tools": [{"name": "bad name!", "input_schema": {"type": "object"}}]}, "tools.0.name"),
])
def test_each_refusal_names_its_field(extra, field):
    with pytest.raises(ApiError) as refused:
        parse_messages(body(messages=[{"role": "user", "content": "hi"}], **extra))
    assert refused.value.status == 400 and refused.value.param == field
    assert refused.value.message.startswith(f"{field}: ")


def test_a_failure_mid_stream_is_anthropics_error_event():
    from host.errors import internal
    from host.messages import _error_event

    raw = _error_event(ApiError(503, "The server is busy; retry shortly.", "service_unavailable"),
                       "req-1")
    assert raw == (b'event: error\ndata: {"type":"error","error":{"type":"overloaded_error",'
                   b'"message":"The server is busy; retry shortly."},"request_id":"req-1"}\n\n')
    assert b'"type":"api_error"' in _error_event(internal("boom"), "req-2")
