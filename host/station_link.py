"""The host's one long-lived connection to the station.

``StationLink.run`` connects to the station socket, says ``hello``, calls ``on_connect``
(liquid memory negotiates capabilities there), publishes the connection, and waits until it is lost;
then it reconnects with a doubling backoff, forever. Every (re)connect re-reads ``hello``,
so a restarted station's new pid, model and capabilities are picked up with no host restart.

Resource handling: the connection (socket + reader task) lives inside ``run``; cancelling
``run`` closes it, and requests still on it get ``StationUnavailable``.

Error handling: a refused or lost connection, and a station that does not answer ``hello``
in time, are retried; anything else propagates (a bug, not a station outage).

A station that refused its model (``gnosis_daemon.refusal``) leaves a refusal file and no
socket: while the link is down, ``refusal`` reads that file and ``current()`` raises
``StationRefused`` (a 503 that names the reason and invites no retry). The file is trusted
only while no station answers, and only when it is newer than the last station this link
reached: a station that answers ``hello`` is never described by an older refusal. The link
keeps reconnecting meanwhile, so an operator's restart of the station is picked up.
"""

from __future__ import annotations

import os
import time
from typing import Any, Awaitable, Callable

import trio

from gnosis_daemon.client import (
    DEFAULT_BUFFER_BYTES,
    StationConnection,
    StationError,
    StationUnavailable,
    open_station_client,
)
from gnosis_daemon.logs import get_logger
from gnosis_daemon.refusal import describe, read_refusal

log = get_logger("host.station_link")

OnConnect = Callable[[StationConnection, dict[str, Any]], Awaitable[None]]


class StationRefused(StationUnavailable):
    """No station, because it refused its model: permanent until an operator acts."""

    def __init__(self, refusal: dict[str, Any]) -> None:
        super().__init__(describe(refusal))
        self.retryable = False
        self.refusal = refusal


async def _no_probe(conn: StationConnection, hello: dict[str, Any]) -> None:
    return None


class StationLink:
    def __init__(self, socket_path: str | os.PathLike[str], *, max_frame_bytes: int,
                 hello_timeout_s: float = 5.0, backoff_initial_s: float = 0.1,
                 backoff_max_s: float = 2.0, on_connect: OnConnect | None = None,
                 refusal_file: str | os.PathLike[str] | None = None,
                 buffer_bytes: int = DEFAULT_BUFFER_BYTES) -> None:
        assert 0 < backoff_initial_s <= backoff_max_s
        self.socket_path = os.fspath(socket_path)
        self.max_frame_bytes = max_frame_bytes
        self.buffer_bytes = buffer_bytes  # how far one request may fall behind its frames
        self.on_overflow: Callable[[], None] | None = None  # a request ended for it
        self._peak_request_bytes = 0  # of the connections before this one
        self.hello_timeout_s = hello_timeout_s
        self.backoff_initial_s = backoff_initial_s
        self.backoff_max_s = backoff_max_s
        self.on_connect: OnConnect = on_connect or _no_probe
        self.hello: dict[str, Any] | None = None  # the last station's hello (kept while down)
        self.capabilities: dict[str, Any] = {}  # effective flags; on_connect may refine them
        self.connects = 0  # successful connects, the first included
        self.last_error: str | None = None
        self.connected_at: int = 0  # unix time of the last connect (/v1/models "created")
        self._conn: StationConnection | None = None
        self.refusal_file = None if refusal_file is None else os.fspath(refusal_file)
        self._connected_wall: float | None = None  # time.time() of the last connect
        self._refusal_read: tuple[tuple[int, int, int], dict[str, Any] | None] | None = None

    # -- what request handlers use
    @property
    def connected(self) -> bool:
        return self._conn is not None and not self._conn.closed

    @property
    def reconnects(self) -> int:
        """Connects after the first: the station restarts this host has seen."""
        return max(0, self.connects - 1)

    @property
    def model_id(self) -> str | None:
        return ((self.hello or {}).get("model") or {}).get("id")

    @property
    def refusal(self) -> dict[str, Any] | None:
        """The station's refusal of its model (the refusal file's document) while no station
        is connected; None when one is, or when there is no file newer than the last one
        this link reached."""
        if self.connected or self.refusal_file is None:
            return None
        try:
            info = os.stat(self.refusal_file)
        except OSError:
            return None
        if self._connected_wall is not None and info.st_mtime < self._connected_wall:
            return None  # older than the last station that answered hello: stale
        key = (info.st_ino, info.st_mtime_ns, info.st_size)
        if self._refusal_read is None or self._refusal_read[0] != key:
            self._refusal_read = (key, read_refusal(self.refusal_file))
        return self._refusal_read[1]

    def buffered(self) -> dict[str, float]:
        """Station frames waiting in this host for their requests' readers (/metrics)."""
        conn = self._conn
        if conn is not None:
            self._peak_request_bytes = max(self._peak_request_bytes, conn.peak_request_bytes)
        return {"station_buffered_bytes": float(conn.buffered_bytes if conn else 0),
                "station_buffered_frames": float(conn.buffered_frames if conn else 0),
                "station_request_buffer_peak_bytes": float(self._peak_request_bytes)}

    def current(self) -> StationConnection:
        conn = self._conn
        if conn is None or conn.closed:
            refusal = self.refusal
            if refusal is not None:
                raise StationRefused(refusal)
            raise StationUnavailable(self.last_error or "not connected to the station yet")
        return conn

    # -- the task
    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        delay = self.backoff_initial_s
        while True:
            try:
                async with open_station_client(self.socket_path, hello=False,
                                               max_frame_bytes=self.max_frame_bytes,
                                               buffer_bytes=self.buffer_bytes) as conn:
                    conn.on_overflow = self.on_overflow
                    with trio.fail_after(self.hello_timeout_s):
                        hello = await conn.request("hello")
                    conn.hello = hello
                    await self._on_connected(conn, hello)
                    delay = self.backoff_initial_s
                    await conn.wait_closed()
                    self.last_error = "station connection lost"
            except (StationError, trio.TooSlowError) as exc:
                # StationUnavailable (refused, lost) or an error answer to hello: retry.
                self.last_error = str(exc) or type(exc).__name__
            finally:
                was_connected = self._conn is not None
                self._conn = None
                if was_connected:
                    log.warning("station_disconnected", reason=self.last_error)
            await trio.sleep(delay)
            delay = min(delay * 2, self.backoff_max_s)

    async def _on_connected(self, conn: StationConnection, hello: dict[str, Any]) -> None:
        self.hello = hello
        self.capabilities = {k: v for k, v in (hello.get("capabilities") or {}).items() if v}
        # The hook may refine self.capabilities (active probing) before requests see the link.
        await self.on_connect(conn, hello)
        self.connects += 1
        self.last_error = None
        self._connected_wall = time.time()
        self.connected_at = int(self._connected_wall)
        self._conn = conn
        log.info("station_connected", station_pid=hello.get("pid"), model=self.model_id,
                 capabilities=sorted(self.capabilities), reconnects=self.reconnects)
