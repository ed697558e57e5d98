"""The station client bounds what each request's frames take while their reader is behind,
without ever making the connection's one reader wait: against a scripted station on a real
Unix socket, one request whose reader never reads is ended (cancelled in the station) while
another request on the same connection gets every frame."""

from __future__ import annotations

import pytest
import trio

from gnosis_daemon.client import StationStream, StreamOverflow, first_ready, open_station_client
from gnosis_daemon.protocol import FrameDecoder, event_frame, result_frame

LIMIT = 64 * 1024
EVENT = {"type": "tokens", "text": "x" * 1000, "token_ids": [1]}


async def _station(listener: trio.SocketListener, cancels: list, flood: int) -> None:
    """Answer request 1 with ``flood`` events then its result, request 2 with 100 events and
    its result; record every ``cancel`` received."""
    stream = await listener.accept()
    decoder = FrameDecoder()
    async with stream:
        while True:
            data = await stream.receive_some(65536)
            if not data:
                return
            for frame in decoder.feed(data):
                if frame["op"] == "cancel":
                    cancels.append(frame["args"]["target"])
                    continue
                count = flood if frame["id"] == 1 else 100
                for i in range(count):
                    await stream.send_all(event_frame(frame["id"], {**EVENT, "i": i}))
                await stream.send_all(result_frame(frame["id"], {"done": True}))


@pytest.fixture
def socket_path(tmp_path):
    return str(tmp_path / "station.sock")


async def _listen(path: str) -> trio.SocketListener:
    sock = trio.socket.socket(trio.socket.AF_UNIX)
    await sock.bind(path)
    sock.listen()
    return trio.SocketListener(sock)


async def test_a_reader_that_falls_behind_is_ended_alone(socket_path):
    listener = await _listen(socket_path)
    cancels: list = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_station, listener, cancels, 10_000)
        async with open_station_client(socket_path, hello=False, buffer_bytes=LIMIT) as conn:
            async with conn.open_stream("generate", {}) as stalled:
                peak = 0
                async with conn.open_stream("generate", {}) as other:
                    got = []
                    async for event in other:  # never waits for the stalled one
                        got.append(event["i"])
                        peak = max(peak, conn.buffered_bytes)
                    assert got == list(range(100)) and other.result == {"done": True}
                with trio.fail_after(30):
                    while not cancels:
                        await trio.sleep(0.01)
                assert cancels == [stalled.request_id]  # sent by the reader task, at once
                assert conn.overflows == 1 and peak <= LIMIT
                assert conn.peak_request_bytes <= LIMIT
                assert conn.buffered_bytes == 0 and conn.buffered_frames == 0  # dropped
                with pytest.raises(StreamOverflow):
                    await stalled.__anext__()
            # Leaving the ended stream sends no second cancel.
            await trio.sleep(0.1)
            assert cancels == [stalled.request_id]
        nursery.cancel_scope.cancel()


async def test_a_reader_that_keeps_up_is_never_ended(socket_path):
    listener = await _listen(socket_path)
    cancels: list = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_station, listener, cancels, 2_000)  # 2 MB through a 64 KiB inbox
        async with open_station_client(socket_path, hello=False, buffer_bytes=LIMIT) as conn:
            async with conn.open_stream("generate", {}) as stream:
                count = 0
                async for _ in stream:
                    count += 1
                    await trio.sleep(0)
            assert count == 2_000 and stream.result == {"done": True}
            assert conn.overflows == 0 and cancels == []
        nursery.cancel_scope.cancel()


async def test_first_ready_reads_streams_as_their_frames_arrive(socket_path):
    listener = await _listen(socket_path)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_station, listener, [], 100)
        async with open_station_client(socket_path, hello=False, buffer_bytes=LIMIT) as conn:
            async with conn.open_stream("generate", {}) as one, \
                    conn.open_stream("generate", {}) as two:
                streams: list[StationStream] = [one, two]
                counts = {one.request_id: 0, two.request_id: 0}
                while streams:
                    at = await first_ready(streams)
                    try:
                        await streams[at].__anext__()
                        counts[streams[at].request_id] += 1
                    except StopAsyncIteration:
                        streams.pop(at)
                assert counts == {one.request_id: 100, two.request_id: 100}
                assert conn.overflows == 0
        nursery.cancel_scope.cancel()


async def test_first_ready_takes_the_fullest_stream_first():
    """Frames coming faster than they are taken: the stream with the most bytes waiting is
    read next, so every stream falls behind alike (never prompt 0 alone, in turn)."""
    from types import SimpleNamespace

    from gnosis_daemon.client import _Inbox

    conn = SimpleNamespace(buffered_bytes=0, buffered_frames=0, peak_request_bytes=0)
    streams = [StationStream(i, _Inbox(conn, LIMIT)) for i in range(3)]  # type: ignore[arg-type]
    for _ in range(3):
        streams[0]._inbox.put({"kind": "event"}, 100, last=False)
    streams[1]._inbox.put({"kind": "event"}, 1000, last=False)
    assert await first_ready(streams) == 1
    await streams[1].__anext__()
    assert await first_ready(streams) == 0
    streams[2]._inbox.close()  # an end is read before any frame
    assert await first_ready(streams) == 2
    assert conn.buffered_bytes == 300 and conn.buffered_frames == 3
