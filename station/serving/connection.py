"""A station connection's state: its requests in flight, where each one is now.

A request is in exactly one of ``preparing`` (its tokenizer work runs on a worker thread),
``calls`` (an engine call) or ``generates`` (a generation the engine streams), so ``cancel``
and the shutdown drain find it wherever it is.
"""

from __future__ import annotations

from typing import Any

import trio

from gnosis_daemon.protocol import ErrorCode
from station.serving.engine_ops import EngineCall
from station.serving.stream import GenerateStream


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
    """One client connection and its requests in flight, by frame id."""

    def __init__(self, number: int, stream: trio.SocketStream) -> None:
        self.number = number
        self.stream = stream
        self.send_lock = trio.Lock()
        self.generates: dict[Any, GenerateStream] = {}
        self.calls: dict[Any, EngineCall] = {}  # in-flight engine calls by frame id
        self.preparing: dict[Any, Preparing] = {}  # tokenizer work on a worker thread
        self.closed = False

    def in_flight(self, request_id: Any) -> bool:
        return (request_id in self.generates or request_id in self.calls
                or request_id in self.preparing)

    async def send(self, payload: bytes) -> None:
        if self.closed:
            return
        try:
            async with self.send_lock:
                await self.stream.send_all(payload)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            self.closed = True  # the reader sees EOF and tears the connection down
