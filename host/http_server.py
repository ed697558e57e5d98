"""hypercorn's HTTP/1.1 server with three guards it does not have, below the ASGI app (which
never sees a request's raw framing, nor the socket its answer is written to):

- a request that carries both ``Content-Length`` and ``Transfer-Encoding`` (h11 frames it by
  ``Transfer-Encoding``) is answered, then its connection is closed, as RFC 9112 (6.3)
  requires of a server: bytes after it that a proxy may have framed differently (a smuggled
  request) are never read as a request;
- ``Upgrade: h2c`` is not honoured (hypercorn answers 101 and hands the connection to its
  HTTP/2 machinery): the request is answered over HTTP/1.1 like any other, and the HTTP/2
  prior-knowledge preface (``PRI * HTTP/2.0``) is an HTTP/1.1 request for ``*`` (a 404). On
  a cleartext port this host speaks HTTP/1.1 only;
- a write the client does not take: hypercorn writes each response's bytes shielded from
  cancellation, so a client that stops reading (its socket's buffers full) held the request,
  its slot and its station sequence for as long as it kept the socket open. Here a write
  that makes no progress (not one byte taken) for ``stall_timeout_s`` closes the
  connection; hypercorn then reports the client gone, the request's task is cancelled and
  its station request with it.

``install`` puts the server class in place of hypercorn's for this process (hypercorn's
trio worker builds one per connection by that module-level name).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable

import trio
from hypercorn.events import Closed, Event, RawData
from hypercorn.protocol import ProtocolWrapper
from hypercorn.protocol.events import Response
from hypercorn.protocol.events import Event as StreamEvent
from hypercorn.protocol.h11 import H11Protocol
from hypercorn.trio import run as trio_run
from hypercorn.trio.tcp_server import TCPServer

from gnosis_daemon.logs import get_logger

log = get_logger("host.http")


class GuardedH11(H11Protocol):
    """hypercorn's HTTP/1.1 protocol without protocol switches, closing after an ambiguously
    framed request."""

    close_after_response = False

    async def _check_protocol(self, event: Any) -> None:
        # hypercorn switches to HTTP/2 here (h2c upgrade, prior knowledge): never.
        names = {name.lower() for name, _ in event.headers}
        if b"content-length" in names and b"transfer-encoding" in names:
            self.close_after_response = True

    async def stream_send(self, event: StreamEvent) -> None:
        if isinstance(event, Response) and event.status_code >= 200 and \
                self.close_after_response:
            # h11 ends the connection after a response that says so.
            event = replace(event, headers=[*event.headers, (b"connection", b"close")])
        await super().stream_send(event)


async def send_or_stall(stream: Any, data: bytes, stall_timeout_s: float) -> bool:
    """Write ``data``; False when the peer took no byte of it for ``stall_timeout_s``.

    A plain socket is written through its non-blocking ``send``: each call takes what the
    kernel accepts now, and a cancelled wait for room has sent nothing, so the timer restarts
    on every byte taken (a slow reader is never cut, only one that reads nothing)."""
    sock = getattr(stream, "socket", None)
    if sock is None:  # a TLS stream: one bound for the whole write
        with trio.move_on_after(stall_timeout_s):
            await stream.send_all(data)
            return True
        return False
    view = memoryview(data)
    while view:
        with trio.move_on_after(stall_timeout_s):
            sent = await sock.send(view)
            view = view[sent:]
            continue
        return False
    return True


def server_class(stall_timeout_s: float, on_stall: Callable[[], None]) -> type[TCPServer]:
    """hypercorn's trio ``TCPServer`` with ``GuardedH11`` and the write-stall bound."""

    class GuardedServer(TCPServer):
        _wrapper: ProtocolWrapper

        @property
        def protocol(self) -> ProtocolWrapper:
            return self._wrapper

        @protocol.setter
        def protocol(self, wrapper: ProtocolWrapper) -> None:
            # TCPServer.run builds the wrapper, which builds hypercorn's H11Protocol: swap it
            # before the first byte is read.
            if type(wrapper.protocol) is H11Protocol:
                wrapper.protocol = GuardedH11(
                    wrapper.app, wrapper.config, wrapper.context, wrapper.task_group,
                    wrapper.state, wrapper.ssl, wrapper.client, wrapper.server, wrapper.send)
            self._wrapper = wrapper

        async def protocol_send(self, event: Event) -> None:
            if not isinstance(event, RawData):
                await super().protocol_send(event)
                return
            async with self.send_lock:
                try:
                    with trio.CancelScope(shield=True):
                        taken: bool | None = await send_or_stall(self.stream, event.data,
                                                                 stall_timeout_s)
                except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                    taken = None
                if taken is False:
                    on_stall()
                    log.warning("http_client_stalled", client=_peer(self.stream),
                                unsent_bytes=len(event.data), stall_timeout_s=stall_timeout_s)
                    with trio.CancelScope(shield=True):
                        await self._close()
            if not taken:
                await self.protocol.handle(Closed())

    return GuardedServer


def _peer(stream: Any) -> str | None:
    try:
        host, port = stream.socket.getpeername()[:2]
    except (AttributeError, OSError, ValueError):
        return None
    return f"{host}:{port}"


def install(stall_timeout_s: float, on_stall: Callable[[], None]) -> None:
    """Serve this process's HTTP connections with ``server_class``."""
    trio_run.TCPServer = server_class(stall_timeout_s, on_stall)  # type: ignore[misc]
