"""A station connection's state: its requests in flight, where each one is now.

A request is in exactly one of ``preparing`` (its tokenizer work runs on a worker thread),
``calls`` (an engine call) or ``generates`` (a generation the engine streams), so ``cancel``
and the shutdown drain find it wherever it is.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import trio

from gnosis_daemon.protocol import ErrorCode
from station.serving.engine_ops import EngineCall
from station.serving.stream import GenerateStream, TrioCalls


class Preparing:
    """A request whose arguments are being tokenized on a worker thread."""

    def __init__(self) -> None:
        self.scope = trio.CancelScope()
        self.error: tuple[ErrorCode, str] | None = None  # why it was stopped

    def cancel(self, code: ErrorCode, message: str) -> bool:
        if self.error is not None:
            return False
        self.error = (code, message)
        self.scope.cancel()
        return True


class Connection:
    """One client connection and its requests in flight, by frame id.

    Its write queue takes frames from trio's thread (op replies) and from the engine's (a
    generate's events, ``station.serving.stream``), so the queue and every write are under
    one thread lock: frames leave in the order they were queued, and one write at a time.
    """

    def __init__(self, number: int, stream: trio.SocketStream) -> None:
        self.number = number
        self.stream = stream
        self.send_lock = trio.Lock()  # trio's writers, one at a time (the writer task, send)
        self._lock = threading.Lock()  # _unsent, _sending and closed, from either thread
        self._unsent: list[bytes] = []  # frames not yet written, in order
        self._sending = False  # a trio write is under way: nobody else writes meanwhile
        self._wanted = trio.Event()  # set: queued frames wait for the writer
        self._on_trio = TrioCalls()  # wakes the writer from the engine's thread
        self.generates: dict[Any, GenerateStream] = {}
        self.calls: dict[Any, EngineCall] = {}  # in-flight engine calls by frame id
        self.preparing: dict[Any, Preparing] = {}  # tokenizer work on a worker thread
        self.closed = False

    def in_flight(self, request_id: Any) -> bool:
        return (request_id in self.generates or request_id in self.calls
                or request_id in self.preparing)

    @property
    def writing(self) -> bool:
        """Frames are queued or being written (the shutdown drain waits for them)."""
        return not self.closed and (bool(self._unsent) or self._sending or self.send_lock.locked())

    def close(self) -> None:
        """Trio thread, before the socket closes: nothing is written on it after this."""
        with self._lock:
            self.closed = True
            self._unsent.clear()

    def queue(self, payload: bytes) -> None:
        """Either thread, never waits: put a frame on the write queue; ``flush`` sends it."""
        with self._lock:
            if not self.closed:
                self._unsent.append(payload)

    def flush(self) -> None:
        """Either thread, never waits: write what is queued now, in one non-blocking write,
        the rest (a full socket buffer) left to the writer task. The engine calls it once a
        turn of its loop, so a step's frames are one write; while trio's write is under
        way, the writer sends them after it."""
        with self._lock:
            if self.closed or not self._unsent:
                return
            if not self._sending:
                data = self._unsent[0] if len(self._unsent) == 1 else b"".join(self._unsent)
                try:
                    sent = os.write(self.stream.socket.fileno(), data)
                except BlockingIOError:
                    sent = 0
                except OSError:  # the peer went: the reader sees EOF and tears it down
                    self.closed = True
                    self._unsent.clear()
                    return
                self._unsent = [data[sent:]] if sent < len(data) else []
            if not self._unsent:
                return
        self._on_trio(self._wanted.set)

    async def write_queued(self) -> None:
        """The connection's writer task: what ``flush`` could not write at once, in order,
        until the connection closes."""
        while not self.closed:
            await self._wanted.wait()
            self._wanted = trio.Event()
            await self._write_unsent()

    async def send(self, payload: bytes) -> None:
        """Write one frame (an op's reply), after every frame queued before it; return once
        it is written (one that went out in another's write still waits for the lock)."""
        self.queue(payload)
        await self._write_unsent()

    async def _write_unsent(self) -> None:
        async with self.send_lock:
            with self._lock:
                if self.closed or not self._unsent:
                    return
                frames, self._unsent = self._unsent, []
                self._sending = True
            try:
                await self.stream.send_all(frames[0] if len(frames) == 1 else b"".join(frames))
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                self.close()  # the reader sees EOF and tears the connection down
            finally:
                with self._lock:
                    self._sending = False
