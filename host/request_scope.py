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
    the connection (a response sent before the request body was read: 401, 413). A
    cancel there aborts hypercorn's close and leaves the socket open and unread, so once the
    last body message is being sent the disconnect no longer cancels: the task ends by itself.
    """

    _response_sent = False

    async def handle_messages(self, nursery: trio.Nursery, request: Any,  # type: ignore[override]
                              receive: Any) -> None:
        await ASGIHTTPConnection.handle_messages(self, request, receive)
        if not self._response_sent:
            nursery.cancel_scope.cancel()

    async def handle_request(self, nursery: trio.Nursery, req: Any,  # type: ignore[override]
                             send: Any) -> None:
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
    """Completions and embeddings in flight in this host, bounded by ``limit`` and, for each
    tenant, by ``tenant_limit``. A request is counted once its body is read (a client that
    sends its body slowly holds a connection, never a slot), until its task ends (streams
    included)."""

    def __init__(self, limit: int, tenant_limit: int | None = None) -> None:
        assert limit >= 1
        self.limit = limit
        self.tenant_limit = limit if tenant_limit is None else max(1, min(limit, tenant_limit))
        self.inflight = 0
        self.by_tenant: dict[str, int] = {}

    def admit(self, record: RequestRecord, tenant: str) -> None:
        """Count the request in until its task ends, or raise 429."""
        held = self.by_tenant.get(tenant, 0)
        if self.inflight >= self.limit:
            raise _busy(f"The server is at its limit of {self.limit} requests in flight; "
                        f"retry shortly.")
        if held >= self.tenant_limit:
            raise _busy(f"This API key's tenant is at its share of {self.tenant_limit} "
                        f"requests in flight; retry shortly.")
        self.inflight += 1
        self.by_tenant[tenant] = held + 1
        record.admitted = time.monotonic()

        async def release() -> None:
            self.inflight -= 1
            left = self.by_tenant[tenant] - 1
            if left:
                self.by_tenant[tenant] = left
            else:
                del self.by_tenant[tenant]

        record.closers.append(release)


def tenant_limit(limit: int, share: float, tenants: int) -> int:
    """Slots one tenant may hold: ``share`` of ``limit`` (at least one) where several tenants
    share the host, the whole limit for one tenant alone."""
    return limit if tenants <= 1 else max(1, int(limit * share))


def _busy(message: str) -> ApiError:
    return ApiError(429, message, "requests", None, "rate_limit_exceeded",
                    {"Retry-After": str(errors.RETRY_AFTER_S)})
