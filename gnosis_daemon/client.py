"""A trio client for the station socket: one connection multiplexes many requests.

Resource handling: ``open_station_client`` owns the socket and a reader task; leaving the
context closes both, and every request still waiting gets ``StationUnavailable``.

Error handling: an error frame raises ``StationError`` with the station's code; a closed
or refused connection raises ``StationUnavailable``. Leaving a stream early (the caller was
cancelled, e.g. its HTTP client went away) sends ``cancel`` for that request, shielded, so
the station frees its KV blocks at once.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
from typing import Any, AsyncIterator

import trio

from gnosis_daemon.protocol import (
    DEFAULT_MAX_FRAME_BYTES,
    ErrorCode,
    FrameDecoder,
    ProtocolError,
    request_frame,
)


class StationError(Exception):
    """The station answered a request with an error frame."""

    def __init__(self, code: str, message: str, retryable: bool = False) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.retryable = retryable


class StationUnavailable(StationError):
    """No connection to the station (refused, closed, or lost mid-request)."""

    def __init__(self, message: str) -> None:
        super().__init__("unavailable", message, retryable=True)


_CLOSED = object()


class StationStream:
    """Frames of one streaming request. Iterate for events; ``result`` holds the final data."""

    def __init__(self, request_id: int, receive: trio.MemoryReceiveChannel) -> None:
        self.request_id = request_id
        self._receive = receive
        self.result: dict[str, Any] | None = None
        self.done = False

    def __aiter__(self) -> StationStream:
        return self

    async def __anext__(self) -> dict[str, Any]:
        if self.done:
            raise StopAsyncIteration
        frame = await self._receive.receive()
        if frame is _CLOSED:
            self.done = True
            raise StationUnavailable("station connection closed mid-request")
        kind = frame.get("kind")
        if kind == "event":
            return frame.get("data") or {}
        self.done = True
        if kind == "result":
            self.result = frame.get("data") or {}
            raise StopAsyncIteration
        err = frame.get("error") or {}
        raise StationError(err.get("code", "internal"), err.get("message", ""),
                           bool(err.get("retryable")))


class StationConnection:
    def __init__(self, stream: trio.SocketStream, max_frame_bytes: int) -> None:
        self._stream = stream
        self._decoder = FrameDecoder(max_frame_bytes)
        self._send_lock = trio.Lock()
        self._ids = itertools.count(1)
        self._pending: dict[int, trio.MemorySendChannel] = {}
        self.closed = False
        self._closed_event = trio.Event()
        self.hello: dict[str, Any] | None = None

    async def _read_loop(self) -> None:
        try:
            while True:
                data = await self._stream.receive_some(65536)
                if not data:
                    break
                for frame in self._decoder.feed(data):
                    if not isinstance(frame, dict):
                        continue
                    channel = self._pending.get(frame.get("id"))
                    if channel is None:
                        continue
                    channel.send_nowait(frame)
                    if frame.get("kind") in ("result", "error"):
                        self._pending.pop(frame.get("id"), None)
        except (trio.BrokenResourceError, trio.ClosedResourceError, ProtocolError, OSError):
            pass
        finally:
            self._fail_all()

    def _fail_all(self) -> None:
        self.closed = True
        self._closed_event.set()
        for channel in self._pending.values():
            try:
                channel.send_nowait(_CLOSED)
            except (trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError):
                pass
        self._pending.clear()

    async def _send(self, payload: bytes) -> None:
        if self.closed:
            raise StationUnavailable("station connection is closed")
        try:
            async with self._send_lock:
                await self._stream.send_all(payload)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            self._fail_all()
            raise StationUnavailable(f"station connection lost: {exc}") from None

    async def wait_closed(self) -> None:
        """Return once the connection is closed (the station went away, or ``aclose``)."""
        await self._closed_event.wait()

    async def _start(self, op: str, args: dict[str, Any] | None,
                     rid: str | None) -> tuple[int, trio.MemoryReceiveChannel]:
        request_id = next(self._ids)
        send, receive = trio.open_memory_channel(math.inf)
        self._pending[request_id] = send
        try:
            await self._send(request_frame(request_id, op, args, rid))
        except BaseException:
            self._pending.pop(request_id, None)
            raise
        return request_id, receive

    async def request(self, op: str, args: dict[str, Any] | None = None, *,
                      rid: str | None = None) -> dict[str, Any]:
        """One request, its final result (events, if any, are dropped)."""
        async with self.open_stream(op, args, rid=rid) as stream:
            async for _ in stream:
                pass
            assert stream.result is not None
            return stream.result

    @contextlib.asynccontextmanager
    async def open_stream(self, op: str, args: dict[str, Any] | None = None, *,
                          rid: str | None = None) -> AsyncIterator[StationStream]:
        request_id, receive = await self._start(op, args, rid)
        stream = StationStream(request_id, receive)
        try:
            yield stream
        finally:
            self._pending.pop(request_id, None)
            if not stream.done and not self.closed:
                with trio.CancelScope(shield=True):
                    with trio.move_on_after(2):
                        await self.send_cancel(request_id)

    async def send_cancel(self, request_id: int) -> None:
        try:
            await self._send(request_frame(next(self._ids), "cancel", {"target": request_id}))
        except StationUnavailable:
            pass

    async def aclose(self) -> None:
        self._fail_all()
        await self._stream.aclose()


@contextlib.asynccontextmanager
async def open_station_client(
    path: str | os.PathLike[str], *, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
    hello: bool = True,
) -> AsyncIterator[StationConnection]:
    """Connect to the station socket at ``path`` (and say ``hello`` unless told not to)."""
    try:
        stream = await trio.open_unix_socket(os.fspath(path))
    except OSError as exc:
        raise StationUnavailable(f"cannot connect to station socket {os.fspath(path)}: {exc}") from None
    conn = StationConnection(stream, max_frame_bytes)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(conn._read_loop)
            try:
                if hello:
                    conn.hello = await conn.request("hello")
                yield conn
            finally:
                nursery.cancel_scope.cancel()
                with trio.CancelScope(shield=True):
                    await conn.aclose()
    except BaseExceptionGroup as group:
        # The reader task never raises, so a group holds the caller's one exception:
        # hand it back as itself, so callers can catch StationError and friends plainly.
        if len(group.exceptions) == 1:
            raise group.exceptions[0] from None
        raise


def is_unknown_op(exc: BaseException) -> bool:
    return isinstance(exc, StationError) and exc.code == ErrorCode.UNKNOWN_OP
