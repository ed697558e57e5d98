"""Is a child alive and answering? One probe per child kind.

- station: connect to its socket and say ``hello`` (readiness: capability flags and model
  identity come back) or send ``health`` (watchdog). The socket's trio thread answers
  ``health`` inline, so a station whose engine loop or tokenizer workers are stuck still
  answers it: the probe fails when the answer's ``serving`` figures say so
  (``gnosis_daemon.liveness.stall_reason``, bounds ``engine_stall_s`` and
  ``tokenizer_stall_s``), and the supervisor restarts it as it does an unresponsive one.
- host: ``GET /health`` over a raw HTTP/1.1 request on trio (the supervisor does not need an
  HTTP client library). Any HTTP status counts as alive: a host whose station is down answers
  503, and restarting the host would not help. With ``health_requires_key`` the probe sends
  one of the configured API keys (``probe_api_key``), so it reads the real /health body (the
  supervisor publishes its liquid-memory fields) instead of a 401.

Error handling: every failure to get an answer raises ``ProbeFailed`` with a message for the
log; callers bound the time with their own deadline (a SIGSTOPped child accepts connections
in the kernel backlog but never answers).
"""

from __future__ import annotations

import contextlib
import json
import os
from typing import Any, Iterator

import trio

from gnosis_daemon.api_keys import load_keyring
from gnosis_daemon.client import StationError, open_station_client
from gnosis_daemon.liveness import stall_reason
from gnosis_daemon.settings import Settings

MAX_HEALTH_BYTES = 1 << 20


class ProbeFailed(Exception):
    """The child did not answer the probe (refused, closed, malformed, or an error reply)."""


@contextlib.contextmanager
def _probe_failure(what: str) -> Iterator[None]:
    """Expected failures become ``ProbeFailed`` (the station client raises them as
    themselves, never wrapped in an exception group); anything else propagates."""
    try:
        yield
    except (StationError, OSError) as exc:
        raise ProbeFailed(f"{what}: {exc}") from None


async def station_hello(path: str | os.PathLike[str], max_frame_bytes: int) -> dict[str, Any]:
    with _probe_failure("station hello"):
        async with open_station_client(path, max_frame_bytes=max_frame_bytes) as conn:
            assert conn.hello is not None
            return conn.hello


async def station_health(path: str | os.PathLike[str], max_frame_bytes: int,
                         engine_stall_s: float | None = None,
                         tokenizer_stall_s: float | None = None) -> dict[str, Any]:
    """The station's ``health`` answer; ``ProbeFailed`` when it gives none, or when its
    serving side is stuck past the bounds given (None: that check is off)."""
    with _probe_failure("station health"):
        async with open_station_client(path, max_frame_bytes=max_frame_bytes, hello=False) as conn:
            answer = await conn.request("health")
    inf = float("inf")
    stuck = stall_reason(answer.get("serving"), inf if engine_stall_s is None else engine_stall_s,
                         inf if tokenizer_stall_s is None else tokenizer_stall_s)
    if stuck is not None:
        raise ProbeFailed(f"station health: serving is stuck: {stuck}")
    return answer


def connect_address(host: str) -> str:
    """Where to connect to reach a server bound to ``host`` (wildcards mean this machine)."""
    if host in ("", "0.0.0.0"):
        return "127.0.0.1"
    if host in ("::", "[::]"):
        return "::1"
    return host.strip("[]")


def _dechunk(body: bytes) -> bytes:
    out = bytearray()
    while body:
        line, _, rest = body.partition(b"\r\n")
        size = int(line.split(b";")[0].strip() or b"0", 16)
        if size == 0:
            break
        out += rest[:size]
        body = rest[size + 2:]
    return bytes(out)


def response_complete(raw: bytes) -> bool:
    """Whether ``raw`` holds a whole response. hypercorn answers ``Connection: close`` but
    does not close its side first, so reading until EOF would wait for its keep-alive timeout."""
    head, sep, body = raw.partition(b"\r\n\r\n")
    if not sep:
        return False
    for line in head.split(b"\r\n")[1:]:
        key, _, value = line.partition(b":")
        key = key.strip().lower()
        if key == b"content-length":
            try:
                return len(body) >= int(value.strip())
            except ValueError:
                return False
        if key == b"transfer-encoding" and b"chunked" in value.lower():
            return body.endswith(b"0\r\n\r\n")
    return False  # no length given: the body ends at EOF


def parse_response(raw: bytes) -> tuple[int, dict[str, Any]]:
    """(status code, JSON body or {}) from a complete response."""
    head, sep, body = raw.partition(b"\r\n\r\n")
    if not sep:
        raise ProbeFailed("host /health: incomplete HTTP response")
    lines = head.split(b"\r\n")
    parts = lines[0].split(b" ", 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/"):
        raise ProbeFailed(f"host /health: not an HTTP response: {lines[0][:80]!r}")
    try:
        status = int(parts[1])
    except ValueError:
        raise ProbeFailed(f"host /health: bad status line {lines[0][:80]!r}") from None
    headers = {}
    for line in lines[1:]:
        key, _, value = line.partition(b":")
        headers[key.strip().lower()] = value.strip().lower()
    if headers.get(b"transfer-encoding") == b"chunked":
        try:
            body = _dechunk(body)
        except ValueError:
            body = b""
    try:
        document = json.loads(body) if body else {}
    except ValueError:
        document = {}
    return status, document if isinstance(document, dict) else {"body": document}


def probe_api_key(settings: Settings) -> str | None:
    """The key the host probe sends: one configured key when ``/health`` needs one, else
    ``None``. The keys are read either way, so a bad keys file raises
    ``gnosis_daemon.api_keys.KeyFileError`` (a ``ValueError``) here, at the supervisor's
    start, instead of the host failing on it at every restart."""
    keyring = load_keyring(settings)
    return keyring.probe_key if settings.health_requires_key else None


async def host_health(host: str, port: int,
                      api_key: str | None = None) -> tuple[int, dict[str, Any]]:
    address = connect_address(host)
    try:
        stream = await trio.open_tcp_stream(address, port)
    except OSError as exc:
        raise ProbeFailed(f"host /health: cannot connect to {address}:{port}: {exc}") from None
    netloc = f"[{address}]:{port}" if ":" in address else f"{address}:{port}"
    auth = f"Authorization: Bearer {api_key}\r\n" if api_key else ""
    request = (f"GET /health HTTP/1.1\r\nHost: {netloc}\r\nAccept: application/json\r\n"
               f"{auth}User-Agent: gnosis-daemon-supervisor\r\nConnection: close\r\n\r\n"
               ).encode()
    raw = bytearray()
    try:
        async with stream:
            await stream.send_all(request)
            while len(raw) < MAX_HEALTH_BYTES and not response_complete(bytes(raw)):
                chunk = await stream.receive_some(65536)
                if not chunk:
                    break
                raw += chunk
    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
        raise ProbeFailed(f"host /health: connection lost: {exc}") from None
    return parse_response(bytes(raw))
