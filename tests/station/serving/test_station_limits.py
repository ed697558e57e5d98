"""What one client cannot do to the others, over the real socket of a real station: freeze
the socket thread with tokenizer work, hold the engine thread with a long embed, or queue
without bound."""

from __future__ import annotations

import numpy as np
import pytest
import trio

from gnosis_daemon.client import StationError, open_station_client
from gnosis_daemon.protocol import unpack_array
from tests.station.conftest import open_raw, start_station
from tests.support.tiny_models import build_tiny_model, build_tokenizer

MAX_MODEL_LEN = 65536
MAX_TOKEN_CHARS = len("<|endoftext|>")  # the tiny tokenizer's longest token
CHAR_LIMIT = MAX_MODEL_LEN * MAX_TOKEN_CHARS
EMBED = {"tokens": [[5] * 512] * 256}  # the most inputs one embed takes


@pytest.fixture(scope="module")
def station(tmp_path_factory):
    model = build_tiny_model(tmp_path_factory.mktemp("long") / "tiny-long", "llama",
                             max_position_embeddings=MAX_MODEL_LEN)
    st = start_station(model, tmp_path_factory.mktemp("limits") / "rt",
                       GNOSIS_MAX_MODEL_LEN=str(MAX_MODEL_LEN), GNOSIS_KV_CACHE_BYTES=str(64 << 20),
                       GNOSIS_MAX_BATCH_SIZE="1", GNOSIS_MAX_WAITING_REQUESTS="2")
    yield st
    assert st.stop() == 0


async def _stats(conn) -> dict:
    return await conn.request("stats")


async def _wait_for(conn, predicate) -> dict:
    with trio.fail_after(60):
        while not predicate(stats := await _stats(conn)):
            await trio.sleep(0.005)
    return stats


def test_hello_publishes_max_token_chars(station):
    assert station.hello["model"]["max_token_chars"] == MAX_TOKEN_CHARS
    assert station.hello["model"]["max_model_len"] == MAX_MODEL_LEN


async def test_text_past_the_size_bound_is_refused_without_tokenizing(station):
    huge = "x" * 10_000_000
    just_over = "y" * (CHAR_LIMIT + 1)
    requests = [
        ("generate", {"prompt": huge}, len(huge)),
        ("generate", {"messages": [{"role": "user", "content": just_over}]}, CHAR_LIMIT + 5),
        ("tokenize", {"text": just_over}, CHAR_LIMIT + 1),
        ("embed", {"texts": ["short", just_over]}, CHAR_LIMIT + 1),
    ]
    async with open_station_client(station.socket) as conn:
        for op, args, chars in requests:
            with pytest.raises(StationError) as err:
                await conn.request(op, args)
            assert err.value.code == "context_overflow", op
            assert f"has {chars} characters" in err.value.message
            assert f"({CHAR_LIMIT} characters at most)" in err.value.message
        assert (await conn.request("health"))["status"] == "ok"


async def test_the_socket_thread_serves_while_a_large_tokenize_runs(station):
    text = "x" * CHAR_LIMIT  # the largest text the bound lets through
    raw = await open_raw(station.socket)
    await raw.send({"v": 1, "id": 1, "op": "tokenize", "args": {"text": text}})
    await raw.send({"v": 1, "id": 2, "op": "health", "args": {}})
    # The health sent after the tokenize is answered first: the tokenizer runs elsewhere.
    first = await raw.receive(timeout=120)
    assert (first["id"], first["kind"], first["data"]["status"]) == (2, "result", "ok")
    async with open_station_client(station.socket) as other:
        assert (await other.request("health"))["status"] == "ok"
    second = await raw.receive(timeout=120)
    x_id = build_tokenizer().encode("x", add_special_tokens=False)
    assert second["id"] == 1 and second["data"]["tokens"] == x_id * CHAR_LIMIT
    await raw.stream.aclose()


async def test_a_generate_decodes_while_a_long_embed_is_in_flight(station):
    order = []
    async with open_station_client(station.socket) as a, open_station_client(station.socket) as b:
        base = (await _stats(b))["embed_inputs"]

        async def embed():
            out = await a.request("embed", EMBED)
            assert unpack_array(out["embeddings"]).shape == (256, 64)
            order.append("embed")

        async def generate():
            await _wait_for(b, lambda s: s["embed_inputs"] > base)  # the embed is under way
            result = await b.request("generate", {"tokens": [1, 2, 3], "max_tokens": 8,
                                                  "temperature": 0, "ignore_eos": True})
            assert result["completion_tokens"] == 8
            order.append("generate")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(embed)
            nursery.start_soon(generate)
    assert order == ["generate", "embed"]


async def test_cancel_stops_an_embed_in_the_engine(station):
    async with open_station_client(station.socket) as conn:
        base = (await _stats(conn))["embed_inputs"]
        async with conn.open_stream("embed", EMBED) as stream:
            await _wait_for(conn, lambda s: s["embed_inputs"] > base)
            assert await conn.request("cancel", {"target": stream.request_id}) == {"cancelled": True}
            with pytest.raises(StationError) as err:
                async for _ in stream:
                    pass
            assert err.value.code == "cancelled"
        stats = await _wait_for(conn, lambda s: s["embed_calls"] == 0)
        assert 0 < stats["embed_inputs"] - base < 256  # dropped part way
        assert await conn.request("cancel", {"target": stream.request_id}) == {"cancelled": False}
        again = await conn.request("embed", {"tokens": [[5] * 8]})
        assert again["num_tokens"] == [8]


async def test_cancel_stops_a_forward_and_frees_its_sequence(station):
    """A forward in flight (a long prompt prefilled chunk by chunk) is dropped with its
    sequence: the client can no longer know which of its tokens have KV."""
    async with open_station_client(station.socket) as conn:
        base = (await _stats(conn))["steps"]
        async with conn.open_stream("forward", {"tokens": [5] * 60_000}) as stream:
            await _wait_for(conn, lambda s: s["host_sequences"] == 1 and s["steps"] > base + 1)
            assert await conn.request("cancel", {"target": stream.request_id}) == {"cancelled": True}
            with pytest.raises(StationError) as err:
                async for _ in stream:
                    pass
            assert err.value.code == "cancelled"
        stats = await _wait_for(conn, lambda s: s["host_sequences"] == 0 and s["running"] == 0)
        assert stats["steps"] - base < 60_000 // 512  # stopped before its prefill ended


async def test_closing_the_connection_drops_its_embed(station):
    async with open_station_client(station.socket) as watcher:
        base = (await _stats(watcher))["embed_inputs"]
        raw = await open_raw(station.socket)
        await raw.send({"v": 1, "id": 1, "op": "embed", "args": EMBED})
        await _wait_for(watcher, lambda s: s["embed_inputs"] > base)
        await raw.stream.aclose()
        stats = await _wait_for(watcher, lambda s: s["embed_calls"] == 0)
        assert 0 < stats["embed_inputs"] - base < 256


async def test_the_waiting_queue_is_bounded(station):
    """max_batch_size 1 and max_waiting_requests 2: one runs, two wait, the next is refused."""
    long = {"tokens": [1, 2, 3], "max_tokens": 60_000, "temperature": 0, "ignore_eos": True}
    async with open_station_client(station.socket) as conn:
        async with conn.open_stream("generate", long) as running:
            assert (await running.__anext__())["type"] == "prefill"
            async with conn.open_stream("generate", long), conn.open_stream("generate", long):
                for op, args in (("generate", long), ("forward", {"tokens": [1, 2]})):
                    with pytest.raises(StationError) as err, trio.fail_after(60):
                        await conn.request(op, args)  # refused, not queued
                    assert (err.value.code, err.value.retryable) == ("capacity", True), op
                    assert "max_waiting_requests 2" in err.value.message
                assert (await _stats(conn))["waiting"] == 2
        await _wait_for(conn, lambda s: s["running"] == 0 and s["waiting"] == 0)
        result = await conn.request("generate", {**long, "max_tokens": 2})
        assert result["completion_tokens"] == 2


async def test_embed_vectors_are_unchanged_by_stepping(station):
    """Stepped or not, each input is its own forward: the vectors equal one-by-one calls."""
    lists = [[7] * n for n in (3, 600, 40, 700, 5)]  # crosses the 512-token share per step
    async with open_station_client(station.socket) as conn:
        together = unpack_array((await conn.request("embed", {"tokens": lists}))["embeddings"])
        alone = [unpack_array((await conn.request("embed", {"tokens": [ids]}))["embeddings"])[0]
                 for ids in lists]
    np.testing.assert_array_equal(together, np.stack(alone))
