"""TTL pins over the real socket of a real station child: hello's flag, generate's pins on a
chat prompt (the first message's rendering, the whole prompt) and their reports on the next
turn, the per-tenant listing and deletion, and bad pins refused naming the argument."""

from __future__ import annotations

import pytest

from gnosis_daemon.client import StationError, open_station_client
from gnosis_daemon.tokens import common_prefix_len
from tests.station.conftest import start_station
from tests.station.serving.test_held_sequences import generate

BS = 16
CHAT = [{"role": "system", "content": "You are a careful assistant who answers briefly."},
        {"role": "user", "content": "What colour is the sky on a clear day?"},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "And at sunset, usually?"}]


@pytest.fixture(scope="module")
def station(tiny_dir, tmp_path_factory):
    st = start_station(tiny_dir, tmp_path_factory.mktemp("pins") / "rt")
    yield st
    assert st.stop() == 0


async def tokens(conn, messages, generation_prompt: bool = True) -> list[int]:
    return (await conn.request("tokenize", {"messages": messages,
                                            "add_generation_prompt": generation_prompt}))["tokens"]


async def test_chat_pins_are_saved_reported_and_read_on_the_next_turn(station):
    assert station.hello["capabilities"]["kv_session_pins"] is True
    pins = [{"session_id": "t.sys", "ttl_s": 300, "messages": 1},
            {"session_id": "t.all", "ttl_s": 300}]
    turn2 = CHAT + [{"role": "assistant", "content": "Orange."},
                    {"role": "user", "content": "Thanks."}]
    async with open_station_client(station.socket) as conn:
        system = await tokens(conn, CHAT[:1], False)
        first_prompt, next_prompt = await tokens(conn, CHAT), await tokens(conn, turn2)
        pre, _ = await generate(conn, messages=CHAT, max_tokens=2, tenant="t", pins=pins)
        sys_n, all_n = len(system) // BS * BS, len(first_prompt) // BS * BS
        assert sys_n > 0 and first_prompt[:len(system)] == system
        assert [(p["session_id"], p["num_tokens"], p["read_tokens"], p["ttl_s"], p["pinned"],
                 p["reason"]) for p in pre["pins"]] == [
            ("t.sys", sys_n, 0, 300.0, True, None), ("t.all", all_n, 0, 300.0, True, None)]
        assert all(p["expires_at"] > 0 for p in pre["pins"])

        pre, _ = await generate(conn, messages=turn2, max_tokens=2, tenant="t", pins=pins)
        # The first turn's pinned blocks are read back: the system prefix whole, and of the
        # whole prompt what the two prompts share, in blocks.
        shared = min(common_prefix_len(first_prompt, next_prompt), all_n) // BS * BS
        assert [(p["session_id"], p["num_tokens"], p["read_tokens"]) for p in pre["pins"]] == [
            ("t.sys", sys_n, sys_n), ("t.all", len(next_prompt) // BS * BS, shared)]
        assert pre["cached_tokens"] >= shared

        listed = (await conn.request("kv_session.list", {"tenant": "t"}))["sessions"]
        assert sorted((s["session_id"], s["pinned"], s["ttl_s"]) for s in listed) == [
            ("t.all", True, 300.0), ("t.sys", True, 300.0)]
        assert all(s["bytes"] > 0 and s["expires_at"] > 0 for s in listed)
        assert (await conn.request("kv_session.list", {"tenant": "nobody"}))["sessions"] == []
        stats = await conn.request("stats")
        assert (stats["kv_pins"], stats["kv_pins_downgraded"]) == (2, 0)
        assert await conn.request("kv_session.delete", {"session_id": "t.sys", "tenant": "u"}) == {
            "deleted": False}
        assert await conn.request("kv_session.delete", {"all": True, "tenant": "t",
                                                        "forget": True}) == {"deleted": 2}
        assert (await conn.request("kv_session.list", {"tenant": "t"}))["sessions"] == []
        assert (await conn.request("stats"))["kv_pins"] == 0


async def test_a_chars_pin_ends_inside_a_message(station):
    """``chars``: message[messages] rendered with its content cut there; the pin keeps the
    tokens that rendering shares with the prompt (up to the cut, not the message's end)."""
    system = CHAT[0]["content"] + " Always name the colour first, then the reason for it."
    chat = [{"role": "system", "content": system}, *CHAT[1:]]
    keep = len(CHAT[0]["content"])
    pins = [{"session_id": "c.cut", "ttl_s": 300, "messages": 0, "chars": keep}]
    async with open_station_client(station.socket) as conn:
        prompt = await tokens(conn, chat)
        cut = await tokens(conn, [{"role": "system", "content": system[:keep]}], False)
        whole_turn = await tokens(conn, chat[:1], False)
        pre, _ = await generate(conn, messages=chat, max_tokens=2, tenant="c", pins=pins)
        expected = common_prefix_len(cut, prompt) // BS * BS
        assert expected > 0 and common_prefix_len(cut, prompt) < len(whole_turn)
        assert [(p["num_tokens"], p["pinned"], p["reason"]) for p in pre["pins"]] == [
            (expected, True, None)]
        bad = [{"session_id": "c.bad", "ttl_s": 300, "messages": len(chat), "chars": 1}]
        pre, _ = await generate(conn, messages=chat, max_tokens=2, tenant="c", pins=bad)
        assert (pre["pins"][0]["pinned"], pre["pins"][0]["num_tokens"]) == (False, 0)
        assert pre["pins"][0]["reason"].startswith(f"the pin cuts at message {len(chat)}")
        assert await conn.request("kv_session.delete", {"all": True, "tenant": "c"}) == {
            "deleted": 1}


@pytest.mark.parametrize(("args", "message"), [
    ({"messages": CHAT, "pins": [{"session_id": "p", "ttl_s": 0}]},
     "argument 'pins' ttl_s must be in (0, 2592000], got 0.0"),
    ({"tokens": [1, 2, 3], "pins": [{"session_id": "p", "ttl_s": 5, "messages": 1}]},
     "argument 'pins' messages needs a 'messages' prompt"),
    ({"tokens": [1, 2, 3], "pins": [{"session_id": str(i), "ttl_s": 5} for i in range(9)]},
     "argument 'pins' has 9 pins, more than 8"),
])
async def test_bad_pins_are_refused_naming_the_argument(station, args, message):
    async with open_station_client(station.socket) as conn:
        with pytest.raises(StationError) as err:
            await generate(conn, **args)
        assert (err.value.code, err.value.message) == ("bad_request", message)


async def test_kv_session_delete_all_needs_a_tenant(station):
    async with open_station_client(station.socket) as conn:
        for args, message in (({"all": True}, "argument 'all' needs 'tenant' (whose sessions "
                                              "to delete)"),
                              ({"all": True, "tenant": "t", "session_id": "x"},
                               "kv_session.delete takes 'session_id' or 'all', not both"),
                              ({"session_id": "x", "forget": 1},
                               "argument 'forget' must be bool, got int")):
            with pytest.raises(StationError) as err:
                await conn.request("kv_session.delete", args)
            assert (err.value.code, err.value.message) == ("bad_request", message)
