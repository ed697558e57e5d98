"""A trio client for the station socket: one connection multiplexes many requests.

Resource handling: ``open_station_client`` owns the socket and a reader task; leaving the
context closes both, and every request still waiting gets ``StationUnavailable``.

Error handling: an error frame raises ``StationError`` with the station's code; a closed
or refused connection raises ``StationUnavailable``. Leaving a stream early (the caller was
cancelled, e.g. its HTTP client went away) sends ``cancel`` for that request, shielded, so
the station frees its KV blocks at once.

Back-pressure: one reader task serves every request on the connection, so it never waits
for any one of them. Each request's frames wait in its own inbox, bounded by
``buffer_bytes`` (as the frames' bytes on the socket; a frame always fits an empty inbox,
and a request's last frame always fits). A request whose reader falls that far behind is
ended alone: its inbox is emptied, the station is told to ``cancel`` it, and its reader gets
``StreamOverflow`` once it asks for the next frame. The reader task reads on for the others.
"""

from __future__ import annotations

import contextlib
import itertools
import os
from collections import deque
from typing import Any, AsyncIterator, Callable

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


class StreamOverflow(StationError):
    """The request's reader fell ``buffer_bytes`` behind its frames: the request was ended
    (cancelled in the station) so that it could not hold more of this process's memory."""

    CODE = "client_too_slow"

    def __init__(self, limit: int) -> None:
        super().__init__(self.CODE, f"The stream's client read it too slowly: more than "
                         f"{limit} bytes of it waited in the server, so it was ended.")


# Bytes one request's frames may take while they wait for its reader (DEFAULT: callers other
# than the host, which passes its stream_buffer_bytes setting).
DEFAULT_BUFFER_BYTES = 64 * 1024 * 1024


class _Inbox:
    """One request's frames, waiting for its reader: at most ``limit`` bytes of them."""

    def __init__(self, conn: StationConnection, limit: int) -> None:
        self._conn = conn
        self.limit = limit
        self._frames: deque[tuple[dict[str, Any], int]] = deque()
        self.bytes = 0
        self.overflowed = False
        self.closed = False
        self._waiters: set[trio.Event] = set()  # readers waiting for a frame

    def put(self, frame: dict[str, Any], size: int, last: bool) -> bool:
        """Hold ``frame``; False (and the inbox emptied) when it does not fit."""
        if self.overflowed:
            return False
        if self._frames and not last and self.bytes + size > self.limit:
            self.discard()
            self.overflowed = True
            self._wake()
            return False
        self._frames.append((frame, size))
        self.bytes += size
        self._conn.peak_request_bytes = max(self._conn.peak_request_bytes, self.bytes)
        self._conn.buffered_bytes += size
        self._conn.buffered_frames += 1
        self._wake()
        return True

    def close(self) -> None:
        self.closed = True
        self._wake()

    def discard(self) -> None:
        """Drop every frame held (the reader left, or fell too far behind)."""
        self._conn.buffered_bytes -= self.bytes
        self._conn.buffered_frames -= len(self._frames)
        self._frames.clear()
        self.bytes = 0

    @property
    def ready(self) -> bool:
        """A frame, or the inbox's end, is here: ``get`` would not wait."""
        return bool(self._frames) or self.overflowed or self.closed

    def _wake(self) -> None:
        for waiter in self._waiters:
            waiter.set()
        self._waiters.clear()

    async def wait(self, waiter: trio.Event) -> None:
        self._waiters.add(waiter)
        try:
            await waiter.wait()
        finally:
            self._waiters.discard(waiter)

    async def get(self) -> dict[str, Any] | None:
        """The next frame; None when the connection closed first."""
        while not self._frames:
            if self.overflowed:
                raise StreamOverflow(self.limit)
            if self.closed:
                return None
            await self.wait(trio.Event())
        frame, size = self._frames.popleft()
        self.bytes -= size
        self._conn.buffered_bytes -= size
        self._conn.buffered_frames -= 1
        return frame


class StationStream:
    """Frames of one streaming request. Iterate for events; ``result`` holds the final data."""

    def __init__(self, request_id: int, inbox: _Inbox) -> None:
        self.request_id = request_id
        self._inbox = inbox
        self.result: dict[str, Any] | None = None
        self.done = False

    def __aiter__(self) -> StationStream:
        return self

    @property
    def ready(self) -> bool:
        """Its next frame, or its end, is here: the next ``__anext__`` would not wait."""
        return self.done or self._inbox.ready

    async def __anext__(self) -> dict[str, Any]:
        if self.done:
            raise StopAsyncIteration
        try:
            frame = await self._inbox.get()
        except StreamOverflow:
            self.done = True  # the reader task has sent the station its cancel
            raise
        if frame is None:
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


async def first_ready(streams: list[StationStream]) -> int:
    """The position in ``streams`` of one whose next frame (or end) is here, waiting for the
    first to get one. Of several, the one with the most bytes waiting (an end first): when
    frames come faster than they are taken, every stream falls behind alike, and none
    waits in its inbox for another to end."""
    while True:
        ready = [i for i, stream in enumerate(streams) if stream.ready]
        if ready:
            return max(ready, key=lambda i: (streams[i].done or streams[i]._inbox.overflowed
                                             or streams[i]._inbox.closed,
                                             streams[i]._inbox.bytes))
        waiter = trio.Event()
        for stream in streams:
            stream._inbox._waiters.add(waiter)
        try:
            await waiter.wait()
        finally:
            for stream in streams:
                stream._inbox._waiters.discard(waiter)


class StationConnection:
    def __init__(self, stream: trio.SocketStream, max_frame_bytes: int,
                 buffer_bytes: int = DEFAULT_BUFFER_BYTES) -> None:
        self._stream = stream
        self._decoder = FrameDecoder(max_frame_bytes)
        self._send_lock = trio.Lock()
        self._ids = itertools.count(1)
        self._pending: dict[int, _Inbox] = {}
        self.buffer_bytes = buffer_bytes
        self.buffered_bytes = 0  # frames' bytes waiting in every request's inbox
        self.buffered_frames = 0
        self.peak_request_bytes = 0  # the most bytes one request's inbox has held
        self.overflows = 0  # requests ended for falling buffer_bytes behind
        self.on_overflow: Callable[[], None] | None = None  # called at each of them
        self._nursery: trio.Nursery | None = None  # where the reader's cancels are sent from
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
                    request_id = frame.get("id")
                    if not isinstance(request_id, int):
                        continue
                    inbox = self._pending.get(request_id)
                    if inbox is None:
                        continue
                    last = frame.get("kind") in ("result", "error")
                    if not inbox.put(frame, self._decoder.last_frame_bytes, last):
                        self._overflowed(request_id)
                    elif last:
                        self._pending.pop(request_id, None)
        except (trio.BrokenResourceError, trio.ClosedResourceError, ProtocolError, OSError):
            pass
        finally:
            self._fail_all()

    def _overflowed(self, request_id: int) -> None:
        """A request's reader fell too far behind: end it, never waiting for it here."""
        self._pending.pop(request_id, None)
        self.overflows += 1
        if self.on_overflow is not None:
            self.on_overflow()
        if self._nursery is not None:
            self._nursery.start_soon(self.send_cancel, request_id)

    def _fail_all(self) -> None:
        self.closed = True
        self._closed_event.set()
        for inbox in self._pending.values():
            inbox.close()
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
                     rid: str | None) -> tuple[int, _Inbox]:
        request_id = next(self._ids)
        inbox = _Inbox(self, self.buffer_bytes)
        self._pending[request_id] = inbox
        try:
            await self._send(request_frame(request_id, op, args, rid))
        except BaseException:
            self._pending.pop(request_id, None)
            raise
        return request_id, inbox

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
        request_id, inbox = await self._start(op, args, rid)
        stream = StationStream(request_id, inbox)
        try:
            yield stream
        finally:
            self._pending.pop(request_id, None)
            inbox.discard()
            if not stream.done and not self.closed and not inbox.overflowed:
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
    hello: bool = True, buffer_bytes: int = DEFAULT_BUFFER_BYTES,
) -> AsyncIterator[StationConnection]:
    """Connect to the station socket at ``path`` (and say ``hello`` unless told not to);
    ``buffer_bytes``: how far one request's reader may fall behind its frames."""
    try:
        stream = await trio.open_unix_socket(os.fspath(path))
    except OSError as exc:
        raise StationUnavailable(f"cannot connect to station socket {os.fspath(path)}: {exc}") from None
    conn = StationConnection(stream, max_frame_bytes, buffer_bytes)
    try:
        async with trio.open_nursery() as nursery:
            conn._nursery = nursery
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
