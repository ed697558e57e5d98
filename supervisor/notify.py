"""systemd's notify protocol (sd_notify(3)) without libsystemd.

One datagram per call on an ``AF_UNIX``/``SOCK_DGRAM`` socket to ``$NOTIFY_SOCKET`` (read by
settings.py as ``settings.notify_socket``): newline-separated ``KEY=value`` lines. An address
that starts with ``@`` is in the abstract namespace (the ``@`` becomes a NUL byte).

Error handling: notifying is best effort. Without a socket every call is a no-op returning
False; a send that fails (systemd gone, socket removed) is logged once and returns False. It
never raises into the supervisor's loop: systemd being unreachable must not stop the service.
"""

from __future__ import annotations

import socket
from typing import Any


def socket_address(notify_socket: str) -> str | bytes:
    """``$NOTIFY_SOCKET`` as an address ``socket.connect`` accepts."""
    if notify_socket.startswith("@"):
        return b"\0" + notify_socket[1:].encode()
    return notify_socket


def format_message(**fields: Any) -> bytes:
    """``READY=1\\nSTATUS=...``: values are one line each (a newline would start a new key)."""
    assert fields, "an empty notification says nothing"
    lines = []
    for key, value in fields.items():
        if isinstance(value, bool):
            value = int(value)
        text = " ".join(str(value).splitlines())
        lines.append(f"{key}={text}")
    return "\n".join(lines).encode()


class Notifier:
    def __init__(self, notify_socket: str | None, logger: Any = None) -> None:
        self.address = socket_address(notify_socket) if notify_socket else None
        self._log = logger
        self._warned = False

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def notify(self, **fields: Any) -> bool:
        if self.address is None:
            return False
        payload = format_message(**fields)
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
                sock.setblocking(False)  # a full receive queue must not stall the event loop
                sock.connect(self.address)
                sock.send(payload)
            return True
        except OSError as exc:
            if not self._warned and self._log is not None:
                self._log.warning("notify_failed", error=str(exc), message=payload.decode())
            self._warned = True
            return False

    def ready(self, status: str) -> bool:
        return self.notify(READY=1, STATUS=status)

    def status(self, status: str) -> bool:
        return self.notify(STATUS=status)

    def watchdog(self) -> bool:
        return self.notify(WATCHDOG=1)

    def stopping(self, status: str = "stopping") -> bool:
        return self.notify(STOPPING=1, STATUS=status)
