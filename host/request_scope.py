"""Each HTTP request's scope in the host: its request id, its record and canonical log line,
cleanup that runs however the task ends, and the bound on requests in flight."""

from __future__ import annotations

import re
import time
import uuid
from typing import Any

import trio
from quart.asgi import ASGIHTTPConnection
from quart_trio.asgi import TrioASGIHTTPConnection

from gnosis_daemon.logs import bind_request
from host import errors
from host.errors import ApiError
from host.metrics import Metrics, RequestRecord, current_record, emit

_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")


class RequestConnection(TrioASGIHTTPConnection):
    """Wraps each HTTP request's task: request id, cleanup and the canonical log line.

    A streamed response holds a station stream between the view returning and the body
    ending; the body may never even start (client gone before the headers went out). The
    record's closers run here, shielded, however the task ends, so the station always
    hears ``cancel`` for a generation nobody will read.

    quart-trio cancels the request's task as soon as the ASGI server reports the client
    gone, and hypercorn reports that from inside the response's last send when it closes
    the connection (a response sent before the request body was read: 401, 413, 429). A
    cancel there aborts hypercorn's close and leaves the socket open and unread, so once the
    last body message is being sent the disconnect no longer cancels: the task ends by itself.
    """

    _response_sent = False

    async def handle_messages(self, nursery: trio.Nursery, request: Any,  # type: ignore[override]
                              receive: Any) -> None:
        await ASGIHTTPConnection.handle_messages(self, request, receive)
        if not self._response_sent:
            nursery.cancel_scope.cancel()

    async def handle_request(self, nursery: trio.Nursery, req: Any, send: Any) -> None:
        async def send_tracked(message: dict[str, Any]) -> None:
            if message.get("type") == "http.response.body" and not message.get("more_body"):
                self._response_sent = True
            await send(message)

        await self._handle_request(nursery, req, send_tracked)

    async def _handle_request(self, nursery: trio.Nursery, req: Any, send: Any) -> None:
        given = req.headers.get("X-Request-Id", "")
        request_id = given if _REQUEST_ID.match(given) else "req-" + uuid.uuid4().hex
        record = RequestRecord(request_id, req.method, req.path)
        token = current_record.set(record)
        counters: Metrics = self.app.gnosis_metrics  # type: ignore[attr-defined]
        counters.inflight += 1
        try:
            with bind_request(request_id):
                try:
                    await super().handle_request(nursery, req, send)
                except trio.Cancelled:
                    record.outcome = record.outcome or "client_disconnected"
                    raise
                finally:
                    with trio.CancelScope(shield=True):
                        for closer in reversed(record.closers):
                            await closer()
                    if record.outcome is None:
                        record.outcome = "ok" if (record.status or 500) < 400 else "error"
                    emit(record, counters)
        finally:
            counters.inflight -= 1
            current_record.reset(token)


def current() -> RequestRecord:
    record = current_record.get()
    assert record is not None, "request handled outside RequestConnection"
    return record


class Admission:
    """Completions and embeddings in flight in this host, bounded by ``limit``."""

    def __init__(self, limit: int) -> None:
        assert limit >= 1
        self.limit = limit
        self.inflight = 0

    def admit(self, record: RequestRecord) -> None:
        """Count the request in until its task ends (streams included), or raise 429."""
        if self.inflight >= self.limit:
            raise ApiError(429, f"The server is at its limit of {self.limit} requests in "
                           f"flight; retry shortly.", "requests", None, "rate_limit_exceeded",
                           {"Retry-After": str(errors.RETRY_AFTER_S)})
        self.inflight += 1
        record.admitted = time.monotonic()

        async def release() -> None:
            self.inflight -= 1

        record.closers.append(release)
