"""The supervisor's control socket and ``gnosis-daemon restart station|host``.

JSON lines over a Unix stream socket at ``settings.control_socket`` (mode 0600 inside the
0700 runtime dir: only the service user can restart children). One request per connection::

    {"op": "restart", "child": "station"}  ->  {"ok": true, "child": "station", "pid": <old pid>}
    {"op": "status"}                       ->  {"ok": true, "status": {...status document...}}
    anything else                          ->  {"ok": false, "error": "..."}

Resource handling: each connection is handled in its own task with a deadline and a bounded
line; a restart runs in the supervisor's nursery, so the reply does not wait for a model load.

Error handling: a malformed request gets ``ok: false`` and a reason; the server keeps serving.
The client turns "no socket" and "refused" into one clear message and exit code 1.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path
from typing import Any, Awaitable, Callable

import trio

from gnosis_daemon.unix_sockets import listen_private

MAX_LINE = 64 * 1024
CHILDREN = ("station", "host")

Handler = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]


class ControlError(Exception):
    """The control request cannot be sent or was refused; the message says why."""


def bind_unix_listener(path: Path) -> trio.SocketListener:
    """A listening socket at ``path``, 0600 from the start; a dead supervisor's file is replaced."""
    if path.exists():
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.settimeout(1.0)
            probe.connect(os.fspath(path))
        except OSError:
            path.unlink(missing_ok=True)  # stale: left by a supervisor that was killed
        else:
            raise ControlError(f"another supervisor already serves {path}: "
                               f"use another --runtime-dir or stop that one first")
        finally:
            probe.close()
    sock = listen_private(path, 16)
    return trio.SocketListener(trio.socket.from_stdlib_socket(sock))


def decode_request(line: bytes) -> dict[str, Any]:
    try:
        request = json.loads(line)
    except ValueError:
        raise ControlError("request is not JSON") from None
    if not isinstance(request, dict) or not isinstance(request.get("op"), str):
        raise ControlError('request must be an object with an "op" string')
    op = request["op"]
    if op == "restart":
        if request.get("child") not in CHILDREN:
            raise ControlError(f'restart needs "child": one of {", ".join(CHILDREN)}')
    elif op != "status":
        raise ControlError(f"unknown op {op!r} (expected restart or status)")
    return request


async def _handle(stream: trio.SocketStream, handler: Handler) -> None:
    async with stream:
        reply: dict[str, Any]
        with trio.move_on_after(10):
            buf = bytearray()
            while b"\n" not in buf and len(buf) <= MAX_LINE:
                chunk = await stream.receive_some(4096)
                if not chunk:
                    break
                buf += chunk
            line = bytes(buf).split(b"\n", 1)[0]
            try:
                if len(line) > MAX_LINE:
                    raise ControlError(f"request longer than {MAX_LINE} bytes")
                reply = await handler(decode_request(line))
            except ControlError as exc:
                reply = {"ok": False, "error": str(exc)}
            try:
                await stream.send_all(json.dumps(reply, default=str).encode() + b"\n")
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass  # the client went away; nothing to tell it


async def serve_control(path: Path, handler: Handler, *,
                        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """Serve the control socket until cancelled (removes the socket file when done)."""
    listener = bind_unix_listener(path)
    try:
        async with listener, trio.open_nursery() as nursery:
            task_status.started()
            while True:
                stream = await listener.accept()
                nursery.start_soon(_handle, stream, handler)
    finally:
        try:
            path.unlink()
        except FileNotFoundError:
            pass


def call(path: str | os.PathLike[str], request: dict[str, Any], timeout_s: float = 10.0
         ) -> dict[str, Any]:
    """Blocking client: one request, its reply."""
    path = os.fspath(path)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout_s)
        try:
            sock.connect(path)
        except (FileNotFoundError, ConnectionRefusedError):
            raise ControlError(
                f"the supervisor is not running (no control socket answers at {path}; "
                f"start it with `gnosis-daemon run`, or pass the same --runtime-dir)") from None
        except PermissionError:
            raise ControlError(f"no permission to use {path}: run as the service user") from None
        try:
            sock.sendall(json.dumps(request).encode() + b"\n")
            data = bytearray()
            while b"\n" not in data:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                data += chunk
        except OSError as exc:
            raise ControlError(f"control socket {path}: {exc}") from None
    try:
        reply = json.loads(bytes(data).split(b"\n", 1)[0])
    except ValueError:
        raise ControlError(f"control socket {path} gave no valid reply") from None
    if not isinstance(reply, dict):
        raise ControlError(f"control socket {path} gave no valid reply")
    return reply


def request_restart(settings: Any, child: str) -> int:
    """``gnosis-daemon restart station|host``."""
    try:
        reply = call(settings.control_socket, {"op": "restart", "child": child})
    except ControlError as exc:
        print(f"gnosis-daemon: {exc}", file=sys.stderr)
        return 1
    if not reply.get("ok"):
        print(f"gnosis-daemon: restart {child} refused: {reply.get('error')}", file=sys.stderr)
        return 1
    print(f"restarting {child} (was pid {reply.get('pid')}); "
          f"see `gnosis-daemon status` for the new pid")
    return 0
