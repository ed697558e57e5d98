"""generate's ``pins`` and the prefill event's pin reports: read, checked and written once."""

from __future__ import annotations

import msgpack
import pytest

from gnosis_daemon.protocol import ErrorCode, OpError
from gnosis_daemon.wire import (GenerateArgs, Pin, PinReport, PrefillEvent, PrefillReport,
                                event_from_wire)

CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]


def refusal(args: dict) -> str:
    with pytest.raises(OpError) as err:
        GenerateArgs.from_wire(args)
    assert err.value.code is ErrorCode.BAD_REQUEST
    return err.value.message


def test_pins_round_trip():
    wired = {"messages": CHAT, "tenant": "t",
             "pins": [{"session_id": "a", "ttl_s": 300.0},
                      {"session_id": "b", "ttl_s": 0.5, "messages": 1, "parts": 0},
                      {"session_id": "c", "ttl_s": 2592000, "messages": 0},
                      {"session_id": "d", "ttl_s": 60, "messages": 0, "chars": 3}]}
    args = GenerateArgs.from_wire(wired)
    assert args.sessions.pins == (Pin(session_id="a", ttl_s=300.0),
                                  Pin(session_id="b", ttl_s=0.5, messages=1, parts=0),
                                  Pin(session_id="c", ttl_s=2592000.0, messages=0),
                                  Pin(session_id="d", ttl_s=60.0, messages=0, chars=3))
    assert args.sessions.asked
    assert args.to_wire() == wired | {"pins": [
        {"session_id": "a", "ttl_s": 300.0},
        {"session_id": "b", "ttl_s": 0.5, "messages": 1, "parts": 0},
        {"session_id": "c", "ttl_s": 2592000.0, "messages": 0},
        {"session_id": "d", "ttl_s": 60.0, "messages": 0, "chars": 3}]}
    assert GenerateArgs.from_wire(msgpack.unpackb(msgpack.packb(args.to_wire()))) == args


def test_no_pins_add_nothing():
    args = GenerateArgs.from_wire({"tokens": [1], "pins": []})
    assert args.sessions.pins == () and not args.sessions.asked
    assert args.to_wire() == {"tokens": [1]}
    assert GenerateArgs.from_wire({"tokens": [1], "pins": None}).sessions.pins == ()


PIN = {"session_id": "p", "ttl_s": 5}


@pytest.mark.parametrize(("pins", "message"), [
    ("x", "argument 'pins' must be list, got str"),
    ([3], "argument 'pins' must be a list of maps"),
    ([PIN] * 2, "argument 'pins' names a session_id twice"),
    ([{"session_id": str(i), "ttl_s": 1} for i in range(9)],
     "argument 'pins' has 9 pins, more than 8"),
    ([{"ttl_s": 1}], "argument 'pins' needs a 'session_id' in each pin"),
    ([{"session_id": "", "ttl_s": 1}], "argument 'pins' needs a non-empty 'session_id' in each pin"),
    ([{"session_id": 4, "ttl_s": 1}], "argument 'pins': argument 'session_id' must be str, got int"),
    ([{"session_id": "p"}], "argument 'pins' needs a 'ttl_s' in each pin"),
    ([PIN | {"ttl_s": "5m"}],
     "argument 'pins': argument 'ttl_s' must be int or float, got str"),
    ([PIN | {"ttl_s": 0}], "argument 'pins' ttl_s must be in (0, 2592000], got 0.0"),
    ([PIN | {"ttl_s": -1}], "argument 'pins' ttl_s must be in (0, 2592000], got -1.0"),
    ([PIN | {"ttl_s": 2592001}], "argument 'pins' ttl_s must be in (0, 2592000], got 2592001.0"),
    ([PIN | {"ttl_s": float("nan")}], "argument 'pins' ttl_s must be in (0, 2592000], got nan"),
    ([PIN | {"messages": -1}], "argument 'pins' messages must be >= 0, got -1"),
    ([PIN | {"messages": 1, "parts": -2}], "argument 'pins' parts must be >= 0, got -2"),
    ([PIN | {"messages": 1.5}], "argument 'pins': argument 'messages' must be int, got float"),
    ([PIN | {"parts": 1}],
     "argument 'pins' parts and chars need messages (they cut message[messages])"),
    ([PIN | {"chars": 3}],
     "argument 'pins' parts and chars need messages (they cut message[messages])"),
    ([PIN | {"messages": 0, "chars": -1}], "argument 'pins' chars must be >= 0, got -1"),
    ([PIN | {"messages": 0, "parts": 1, "chars": 2}], "argument 'pins' takes parts or chars, not both"),
], ids=lambda v: str(v)[:40] if isinstance(v, str) else None)
def test_each_pin_bound_refuses_naming_pins(pins, message):
    assert refusal({"messages": CHAT, "pins": pins}) == message


def test_messages_pins_need_a_messages_prompt():
    assert refusal({"tokens": [1, 2], "pins": [PIN | {"messages": 0}]}) == \
        "argument 'pins' messages needs a 'messages' prompt"
    assert GenerateArgs.from_wire({"tokens": [1, 2], "pins": [PIN]}).sessions.pins == (
        Pin(session_id="p", ttl_s=5.0),)


def test_prefill_event_pins_round_trip():
    reports = (PinReport(session_id="a", num_tokens=32, read_tokens=16, ttl_s=300.0,
                         expires_at=1_700_000_000.5, pinned=True),
               PinReport(session_id="b", num_tokens=48, read_tokens=0, ttl_s=3600.0,
                         expires_at=None, pinned=False, reason="pin_budget"))
    event = PrefillEvent.of(PrefillReport(prompt_tokens=50, cached_tokens=16, pins=reports))
    wired = event.to_wire()
    assert wired["pins"] == [
        {"session_id": "a", "num_tokens": 32, "read_tokens": 16, "ttl_s": 300.0,
         "expires_at": 1_700_000_000.5, "pinned": True, "reason": None},
        {"session_id": "b", "num_tokens": 48, "read_tokens": 0, "ttl_s": 3600.0,
         "expires_at": None, "pinned": False, "reason": "pin_budget"}]
    assert event_from_wire(msgpack.unpackb(msgpack.packb(wired))) == event
    assert event_from_wire({"type": "prefill", "prompt_tokens": 1,
                            "cached_tokens": 0}).pins == ()
    with pytest.raises(OpError, match=r"^event field 'pins' must be a list of maps$"):
        event_from_wire({"type": "prefill", "prompt_tokens": 1, "cached_tokens": 0,
                         "pins": [1]})
