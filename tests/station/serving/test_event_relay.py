"""The engine-to-trio relay and a connection's write queue, on a real trio loop, a real
engine-side thread and a real socket pair: a step's events reach their streams in order
through one wake-up of trio, and each connection's frames of that batch leave in one write;
a stream whose handling of an event fails ends with an internal error frame, alone."""

from __future__ import annotations

import socket
import threading

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
        self._arrived.append((self.name, event))
        self.sink.queue(f"{self.name}:{event}".encode())


async def test_a_steps_events_are_one_batch_in_order_and_one_flush_per_connection():
    relay = EventRelay(trio.lowlevel.current_trio_token())
    arrived: list = []
    sinks = [_Sink(), _Sink()]
    streams = [_Stream(f"s{i}", sinks[i % 2], arrived) for i in range(6)]
    scheduled = []
    real = relay.token.run_sync_soon

    class _Counting:  # the relay's one run_sync_soon per batch, counted
        def run_sync_soon(self, fn, *args):
            scheduled.append(fn)
            real(fn, *args)

    relay.token = _Counting()  # type: ignore[assignment]

    def engine_step() -> None:  # the engine thread's events of one step: 3 tokens each
        for k in range(3):
            for stream in streams:
                relay.put(stream, k)  # type: ignore[arg-type]

    thread = threading.Thread(target=engine_step)
    thread.start()
    thread.join()  # trio's thread blocked meanwhile, as when it is busy: nothing drained yet
    assert arrived == [] and len(scheduled) == 1
    with trio.fail_after(5):
        while len(arrived) < 18:
            await trio.sleep(0.01)
    assert len(scheduled) == 1  # one drain took all 18
    assert arrived == [(s.name, k) for k in range(3) for s in streams]
    assert [sink.flushes for sink in sinks] == [1, 1]
    for i, stream in enumerate(streams):
        mine = [f for f in stream.sink.frames if f.startswith(f"{stream.name}:".encode())]
        assert mine == [f"{stream.name}:{k}".encode() for k in range(3)], i


async def test_a_put_from_another_thread_while_trio_drains_is_not_lost():
    relay = EventRelay(trio.lowlevel.current_trio_token())
    arrived: list = []
    sink = _Sink()
    stream = _Stream("s", sink, arrived)
    n = 2000

    def engine() -> None:
        for k in range(n):
            relay.put(stream, k)  # type: ignore[arg-type]

    thread = threading.Thread(target=engine)
    thread.start()
    with trio.fail_after(20):
        while len(arrived) < n:
            await trio.sleep(0)
    thread.join()
    assert [k for _, k in arrived] == list(range(n))


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

        # While a write holds the lock, flush leaves the frames to the writer, in order.
        async with conn.send_lock:
            conn.queue(b"d4")
            conn.flush()
            assert conn.writing
            await trio.sleep(0.05)
            assert conn.writing  # nothing went out beside the write under way
        with trio.fail_after(5):
            while conn.writing:
                await trio.sleep(0.01)
        await conn.send(b"e5")  # an op's reply after the queued frames
        got = b""
        with trio.fail_after(5):
            while got != b"d4e5":
                await trio.sleep(0.01)
                try:
                    got += theirs.recv(100)
                except BlockingIOError:
                    pass
        nursery.cancel_scope.cancel()
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
