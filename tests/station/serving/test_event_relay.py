"""The relay and a connection's write queue, on a real trio loop, a real engine-side thread
and a real socket pair: a step's events are handled on the engine's thread as they come, in
order, each connection's frames of a turn leave in one write, and trio is woken only for a
stream's end or a full socket; frames written from both threads arrive whole and in order;
a stream whose handling of an event fails ends with an internal error frame, alone."""

from __future__ import annotations

import socket
import threading

import msgpack
import trio

from station.serving.connection import Connection
from station.serving.stream import EventRelay


class _Sink:
    def __init__(self) -> None:
        self.frames: list[bytes] = []
        self.flushes = 0

    def queue(self, payload: bytes) -> None:
        self.frames.append(payload)

    def flush(self) -> None:
        self.flushes += 1


class _Stream:
    """What the relay needs of a GenerateStream: ``arrive`` and ``sink``."""

    def __init__(self, name: str, sink: _Sink, arrived: list) -> None:
        self.name, self.sink, self._arrived = name, sink, arrived

    def arrive(self, event: object) -> None:
        self._arrived.append((self.name, event, threading.get_ident()))
        self.sink.queue(f"{self.name}:{event}".encode())


class _Counting:
    """A trio token whose ``run_sync_soon`` calls are counted (each one wakes trio)."""

    def __init__(self, real: trio.lowlevel.TrioToken) -> None:
        self.real, self.scheduled = real, []

    def run_sync_soon(self, fn, *args):
        self.scheduled.append(fn)
        self.real.run_sync_soon(fn, *args)


async def test_a_steps_events_are_handled_on_the_engine_thread_in_order_one_write_a_turn():
    relay = EventRelay(trio.lowlevel.current_trio_token())
    relay.on_trio.token = counting = _Counting(relay.token)  # type: ignore[assignment]
    arrived: list = []
    sinks = [_Sink(), _Sink()]
    streams = [_Stream(f"s{i}", sinks[i % 2], arrived) for i in range(6)]
    flushes_before_turn_end: list[int] = []

    def engine_turn() -> None:  # the engine thread's events of one step: 3 tokens each
        for k in range(3):
            for stream in streams:
                relay.put(stream, k)  # type: ignore[arg-type]
        flushes_before_turn_end.extend(sink.flushes for sink in sinks)
        relay.turn_done()

    thread = threading.Thread(target=engine_turn)
    thread.start()
    thread.join()  # trio's thread blocked meanwhile: the events did not need it
    assert [(name, k) for name, k, _ in arrived] == [(s.name, k) for k in range(3) for s in streams]
    assert {ident for _, _, ident in arrived} == {thread.ident}
    assert flushes_before_turn_end == [0, 0] and [sink.flushes for sink in sinks] == [1, 1]
    assert counting.scheduled == []  # trio was never woken
    relay.turn_done()  # a turn without events writes nothing
    assert [sink.flushes for sink in sinks] == [1, 1]
    for stream in streams:
        mine = [f for f in stream.sink.frames if f.startswith(f"{stream.name}:".encode())]
        assert mine == [f"{stream.name}:{k}".encode() for k in range(3)]


async def test_a_streams_end_on_the_engine_thread_wakes_its_task_on_trio():
    from station.core.requests import Finished, Token

    relay = EventRelay(trio.lowlevel.current_trio_token())
    relay.on_trio.token = counting = _Counting(relay.token)  # type: ignore[assignment]
    sink, engine = _Sink(), _Engine()
    stream = _stream(relay)
    stream.route(sink, engine)  # type: ignore[arg-type]

    def engine_turn() -> None:
        relay.put(stream, Token("g:1:7", 72))
        relay.put(stream, Finished("g:1:7", "length", 2, 1, 0))
        relay.turn_done()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(stream.pump)
        await trio.sleep(0)
        thread = threading.Thread(target=engine_turn)
        thread.start()
        with trio.fail_after(5):
            while not stream.done or len(counting.scheduled) < 1:
                await trio.sleep(0.01)
    thread.join()
    frames = [msgpack.unpackb(f) for f in sink.frames]
    assert [f["kind"] for f in frames] == ["event", "result"]
    assert frames[0]["data"] == {"type": "tokens", "token_ids": [72], "text": "i"}  # its byte
    assert stream.outcome == "length" and len(counting.scheduled) == 1  # the end, only


async def test_flush_writes_the_queue_in_one_write_and_the_writer_takes_over_when_busy():
    ours, theirs = socket.socketpair()
    theirs.setblocking(False)
    conn = Connection(1, trio.SocketStream(trio.socket.from_stdlib_socket(ours)))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(conn.write_queued)
        for frame in (b"a1", b"b22", b"c333"):
            conn.queue(frame)
        conn.flush()  # synchronous: written before trio runs anything else
        assert theirs.recv(100) == b"a1b22c333"
        assert not conn.writing

        # A reply larger than the socket's buffer: trio's write waits for the reader.
        big = b"R" * (4 << 20)
        nursery.start_soon(conn.send, big)
        with trio.fail_after(5):
            while not conn._sending:
                await trio.sleep(0.01)
        conn.queue(b"d4")
        conn.flush()  # a write is under way: the frame waits for the writer, after it
        assert conn.writing
        got = b""
        with trio.fail_after(10):
            while not got.endswith(b"d4"):
                await trio.sleep(0)
                try:
                    got += theirs.recv(1 << 20)
                except BlockingIOError:
                    pass
        assert got == big + b"d4"
        await conn.send(b"e5")  # an op's reply after the queued frames
        with trio.fail_after(5):
            while True:
                try:
                    assert theirs.recv(100) == b"e5"
                    break
                except BlockingIOError:
                    await trio.sleep(0.01)
        nursery.cancel_scope.cancel()
    theirs.close()
    ours.close()


async def test_frames_from_the_engine_thread_and_trio_replies_arrive_whole_and_in_order():
    """The engine thread queues and flushes frames while trio sends replies, through a
    small socket buffer the reader empties slowly: every frame arrives whole, each side's
    in its own order."""
    ours, theirs = socket.socketpair()
    ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    conn = Connection(1, trio.SocketStream(trio.socket.from_stdlib_socket(ours)))
    n = 3000
    received: list = []

    def reader() -> None:
        unpacker = msgpack.Unpacker()
        while len(received) < 2 * n:
            data = theirs.recv(1500)
            if not data:
                return
            unpacker.feed(data)
            received.extend(unpacker)

    def engine() -> None:
        for k in range(n):
            conn.queue(msgpack.packb({"engine": k, "pad": "x" * (k % 97)}))
            if k % 7 == 6:
                conn.flush()
        conn.flush()

    read = threading.Thread(target=reader)
    read.start()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(conn.write_queued)
        thread = threading.Thread(target=engine)
        thread.start()
        for k in range(n):
            await conn.send(msgpack.packb({"reply": k, "pad": "y" * (k % 89)}))
        with trio.fail_after(30):
            while thread.is_alive() or conn.writing:
                await trio.sleep(0.01)
        nursery.cancel_scope.cancel()
    read.join(30)
    assert [m["engine"] for m in received if "engine" in m] == list(range(n))
    assert [m["reply"] for m in received if "reply" in m] == list(range(n))
    theirs.close()
    ours.close()


async def test_flush_to_a_closed_peer_marks_the_connection_closed():
    ours, theirs = socket.socketpair()
    conn = Connection(1, trio.SocketStream(trio.socket.from_stdlib_socket(ours)))
    theirs.close()
    conn.queue(b"x" * 10)
    conn.flush()
    assert conn.closed and not conn.writing
    conn.queue(b"y")  # after the end: dropped, never raised
    conn.flush()
    ours.close()


class _Engine:
    def __init__(self) -> None:
        self.aborted: list[str] = []

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


def _stream(relay: EventRelay):
    from gnosis_daemon.wire import GenerateArgs
    from station.serving.ops import CheckedGenerate
    from station.serving.stream import GenerateStream
    from tests.support.tiny_models import build_tokenizer

    gen = CheckedGenerate(args=GenerateArgs.from_wire({"tokens": [5, 6], "max_tokens": 4}),
                          prompt_ids=[5, 6], max_tokens=4)
    return GenerateStream(7, "g:1:7", gen, build_tokenizer(), (), relay)


async def test_a_bug_handling_one_event_is_that_requests_internal_error_and_nothing_else():
    import msgpack

    from station.core.requests import Token

    relay = EventRelay(trio.lowlevel.current_trio_token())
    sink, engine = _Sink(), _Engine()
    stream = _stream(relay)
    stream.route(sink, engine)  # type: ignore[arg-type]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(stream.pump)
        stream.arrive(Token("g:1:7", 72))  # "i" in the tiny byte-level vocabulary
        stream.arrive(object())  # type: ignore[arg-type]  # an event no stream knows: a bug
        with trio.fail_after(5):
            while not stream.done:
                await trio.sleep(0.01)
    frames = [msgpack.unpackb(f) for f in sink.frames]
    assert [f["kind"] for f in frames] == ["event", "error"]
    assert frames[0]["data"]["token_ids"] == [72]
    assert frames[1]["id"] == 7 and frames[1]["error"]["code"] == "internal"
    assert engine.aborted == ["g:1:7"]  # the engine stops computing it
    assert stream.outcome == "internal"
    stream.arrive(Token("g:1:7", 73))  # a late event after the end: dropped
    assert len(sink.frames) == 2


def test_one_token_frames_are_the_event_frames_byte_for_byte():
    from gnosis_daemon.protocol import event_frame
    from gnosis_daemon.wire import TokensEvent
    from gnosis_daemon.wire.events import OneTokenFrames

    for request_id in (0, 7, 2**31, -3, "req-1", "x" * 300):
        frames = OneTokenFrames(request_id)
        for token_id in (0, 1, 127, 128, 65535, 2**20):
            for text in ("", "a", "é😀", "x" * 40, "y" * 70000):
                assert frames.frame(token_id, text) == \
                    event_frame(request_id, TokensEvent.wire([token_id], text))
