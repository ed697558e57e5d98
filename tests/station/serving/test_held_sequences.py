"""Liquid memory over the real socket of a real station child: KV session ops, generate's
session fields, held sequences (forward/decode_next), ownership and release, and a
station with kv_session/decode_next disabled."""

from __future__ import annotations

import random

import pytest
import trio

from gnosis_daemon.client import StationError, open_station_client
from tests.station.conftest import start_station
from tests.support.tiny_models import reference_generate

BS = 16


@pytest.fixture(scope="module")
def station(tiny_dir, tmp_path_factory):
    st = start_station(tiny_dir, tmp_path_factory.mktemp("liquid") / "rt")
    yield st
    assert st.stop() == 0


_REF: dict = {}


def reference(path, prompt, n):
    key = (str(path), tuple(prompt), n)
    if key not in _REF:
        _REF[key] = reference_generate(path, prompt, n)
    return _REF[key]


def prompt_of(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(0, 256) for _ in range(length)]


async def generate(conn, **args):
    args.setdefault("temperature", 0)
    events = []
    async with conn.open_stream("generate", args) as stream:
        async for event in stream:
            events.append(event)
    assert events[0]["type"] == "prefill"
    return events[0], stream.result


async def drop_all_sessions(conn) -> None:
    for s in (await conn.request("kv_session.list"))["sessions"]:
        await conn.request("kv_session.delete", {"session_id": s["session_id"]})


async def wait_clean(conn) -> dict:
    """Stats once no held sequence and no block is held (release is asynchronous)."""
    with trio.fail_after(10):
        while True:
            stats = await conn.request("stats")
            if stats["host_sequences"] == 0 and stats["blocks_held"] == 0:
                return stats
            await trio.sleep(0.02)


async def test_hello_flags_and_probe_session(station):
    caps = station.hello["capabilities"]
    assert {"generate", "forward", "decode_next", "embed", "kv_session"} <= set(caps)
    async with open_station_client(station.socket) as conn:
        # The host's capability probe: prefix length 0 under a throw-away id, then delete.
        assert await conn.request("kv_session.save", {"session_id": "probe-1", "prefix_len": 0}) == {
            "session_id": "probe-1", "num_tokens": 0}
        listed = await conn.request("kv_session.list", {"include_tokens": True})
        assert [(s["session_id"], s["num_tokens"], s["tokens"]) for s in listed["sessions"]] == [
            ("probe-1", 0, [])]
        assert listed["budget"] == 256 and listed["pinned_blocks"] == 0
        assert await conn.request("kv_session.delete", {"session_id": "probe-1"}) == {"deleted": True}
        assert await conn.request("kv_session.delete", {"session_id": "probe-1"}) == {"deleted": False}
        with pytest.raises(StationError) as err:
            await conn.request("kv_session.load", {"session_id": "probe-1"})
        assert err.value.code == "not_found"
        with pytest.raises(StationError) as err:
            await conn.request("kv_session.save", {"session_id": "x", "prefix_len": -1})
        assert err.value.code == "bad_request"


async def test_generate_saves_and_loads_sessions(station, tiny_dir):
    prompt = prompt_of(1, 45)
    async with open_station_client(station.socket) as conn:
        pre, first = await generate(conn, tokens=prompt, max_tokens=8, tenant="t",
                                    save_session="conv-p", load_session="conv-p")
        assert (pre["session_loaded"], pre["session_error"]) == (False, "not_found")  # a miss
        assert (pre["saved"], pre["save_error"]) == (True, None)
        assert first["token_ids"] == reference(tiny_dir, prompt, 8)
        assert (first["final_saved"], first["final_save_error"]) == (False, None)

        pre, again = await generate(conn, tokens=prompt, max_tokens=8, tenant="t",
                                    load_session="conv-p", save_final_session="conv-f")
        assert pre["session_loaded"] is True and pre["session_tokens"] == 32
        assert pre["cached_tokens"] >= len(prompt) - BS and again["cached_tokens"] == pre["cached_tokens"]
        assert again["token_ids"] == first["token_ids"]
        assert again["final_saved"] is True

        turn2 = prompt + again["token_ids"] + prompt_of(2, 5)
        pre, nxt = await generate(conn, tokens=turn2, max_tokens=6, tenant="t", load_session="conv-f")
        kept = (len(prompt) + len(again["token_ids"]) - 1) // BS * BS
        assert pre["session_loaded"] is True and pre["session_tokens"] == kept
        assert nxt["token_ids"] == reference(tiny_dir, turn2, 6)

        pre, other = await generate(conn, tokens=prompt, max_tokens=3, tenant="u",
                                    load_session="conv-p")
        assert (pre["session_loaded"], pre["session_error"], pre["cached_tokens"]) == (
            False, "tenant_mismatch", 0)

        # kv_session.save from resident prefix-cache blocks of the same tenant
        saved = await conn.request("kv_session.save", {"session_id": "from-tokens", "tenant": "t",
                                                        "tokens": prompt, "prefix_len": 40})
        assert saved == {"session_id": "from-tokens", "num_tokens": 32}
        with pytest.raises(StationError) as err:
            await conn.request("kv_session.save", {"session_id": "gone", "tenant": "t",
                                                   "tokens": prompt_of(3, 40), "prefix_len": 40})
        assert err.value.code == "not_found"
        listed = await conn.request("kv_session.list")
        assert {s["session_id"] for s in listed["sessions"]} == {"conv-p", "conv-f", "from-tokens"}
        await drop_all_sessions(conn)
        await wait_clean(conn)


async def test_forward_and_decode_next_equal_generate(station, tiny_dir):
    prompt = prompt_of(4, 37)
    expected = reference(tiny_dir, prompt, 10)
    async with open_station_client(station.socket) as conn:
        made = await conn.request("forward", {"tokens": prompt[:20]})
        seq_id = made["seq_id"]
        assert made["num_tokens"] == 20
        grown = await conn.request("forward", {"tokens": prompt[20:], "seq_id": seq_id})
        assert grown == {**grown, "seq_id": seq_id, "num_tokens": 37, "cached_tokens": 0}
        tokens = []
        for i in range(len(expected)):
            step = await conn.request("decode_next", {"seq_id": seq_id, "temperature": 0})
            assert step["num_tokens"] == 38 + i
            tokens.append(step["token_id"])
        assert tokens == expected

        # Pin it, release it, load it back: the loaded sequence continues the same way.
        saved = await conn.request("kv_session.save", {"session_id": "host", "seq_id": seq_id,
                                                        "prefix_len": 40})
        assert saved["num_tokens"] == 32
        assert (await conn.request("forward", {"seq_id": seq_id, "release": True}))["released"]
        loaded = await conn.request("kv_session.load", {"session_id": "host"})
        assert loaded["num_tokens"] == 32
        full = prompt + expected
        await conn.request("forward", {"seq_id": loaded["seq_id"], "tokens": full[32:40]})
        nxt = await conn.request("decode_next", {"seq_id": loaded["seq_id"], "temperature": 0})
        assert nxt["token_id"] == reference(tiny_dir, full[:40], 1)[0]

        # A new sequence that starts from the session (one call instead of load + forward).
        fresh = await conn.request("forward", {"tokens": full[:40], "load_session": "host"})
        # The session's 32 tokens, then the released sequence's cached blocks up to the last token.
        assert fresh["session_loaded"] is True and fresh["cached_tokens"] == 39
        await drop_all_sessions(conn)


async def test_concurrent_decode_next_on_one_connection(station, tiny_dir):
    prompts = [prompt_of(10 + i, 18 + 5 * i) for i in range(4)]
    async with open_station_client(station.socket) as conn:
        seqs = [(await conn.request("forward", {"tokens": p}))["seq_id"] for p in prompts]
        got: list[list[int]] = [[] for _ in prompts]

        async def one(i: int) -> None:
            step = await conn.request("decode_next", {"seq_id": seqs[i], "temperature": 0})
            got[i].append(step["token_id"])

        for _ in range(5):
            async with trio.open_nursery() as nursery:
                for i in range(len(seqs)):
                    nursery.start_soon(one, i)
        for prompt, tokens in zip(prompts, got):
            expected = reference(tiny_dir, prompt, 5)
            assert tokens[:len(expected)] == expected


async def test_unknown_or_foreign_sequence_is_not_found(station):
    async with open_station_client(station.socket) as a, open_station_client(station.socket) as b:
        with pytest.raises(StationError) as err:
            await a.request("decode_next", {"seq_id": "h999999"})
        assert err.value.code == "not_found"
        seq_id = (await a.request("forward", {"tokens": [1, 2, 3]}))["seq_id"]
        with pytest.raises(StationError) as err:
            await b.request("decode_next", {"seq_id": seq_id})  # not b's sequence
        assert err.value.code == "not_found"
        with pytest.raises(StationError) as err:
            await a.request("decode_next", {"seq_id": seq_id, "top_p": 0})
        assert err.value.code == "bad_request"


async def test_connection_close_releases_held_sequences(station):
    async with open_station_client(station.socket) as conn:
        await drop_all_sessions(conn)
        for i in range(3):
            seq_id = (await conn.request("forward", {"tokens": prompt_of(20 + i, 50)}))["seq_id"]
            await conn.request("decode_next", {"seq_id": seq_id})
        assert (await conn.request("stats"))["host_sequences"] >= 3
    async with open_station_client(station.socket) as conn:
        stats = await wait_clean(conn)
        assert stats["blocks_free"] == stats["blocks_total"]


def test_disabled_capabilities_answer_unknown_op(tiny_dir, tmp_path):
    st = start_station(tiny_dir, tmp_path / "rt", GNOSIS_STATION_DISABLE="kv_session,decode_next")
    try:
        caps = st.hello["capabilities"]
        assert not {"kv_session", "decode_next"} & set(caps)
        assert {"generate", "forward", "embed"} <= set(caps)

        async def probe():
            async with open_station_client(st.socket) as conn:
                for op, args in [("kv_session.save", {"session_id": "p", "prefix_len": 0}),
                                 ("kv_session.list", {}), ("decode_next", {"seq_id": "h1"})]:
                    with pytest.raises(StationError) as err:
                        await conn.request(op, args)
                    assert err.value.code == "unknown_op"
                with pytest.raises(StationError) as err:
                    await conn.request("generate", {"tokens": [1, 2], "save_session": "s"})
                assert err.value.code == "bad_request"
                assert (await conn.request("forward", {"tokens": [1, 2]}))["num_tokens"] == 2

        trio.run(probe)
    finally:
        assert st.stop() == 0


async def test_stop_string_still_saves_the_final_session(station, tiny_dir):
    prompt = prompt_of(30, 20)
    async with open_station_client(station.socket) as conn:
        _, full = await generate(conn, tokens=prompt, max_tokens=12, ignore_eos=True)
        text = full["text"]
        stop = text[len(text) // 2:len(text) // 2 + 2]
        if not stop.strip():
            pytest.skip("the tiny model's text has no usable stop string")
        _, cut = await generate(conn, tokens=prompt, max_tokens=12, ignore_eos=True, stop=[stop],
                                save_final_session="stopped")
        assert cut["finish_reason"] == "stop" and cut["text"] == text[:text.index(stop)]
        assert (cut["final_saved"], cut["final_save_error"]) == (True, None)
        assert cut["token_ids"] == full["token_ids"][:len(cut["token_ids"])]
        listed = await conn.request("kv_session.list")
        assert [s["session_id"] for s in listed["sessions"]] == ["stopped"]
        await drop_all_sessions(conn)
