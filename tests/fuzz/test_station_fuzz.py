"""Fuzzing the station's socket protocol directly (the daemon of tests/fuzz/conftest.py).

Properties:

- every frame that decodes gets exactly one final frame (``result`` or ``error``) carrying its
  id (``None`` when it had no usable id), after at most its own ``event`` frames, and never an
  error code outside the documented set, ``internal`` included;
- bytes that cannot be decoded, or a frame past ``max_frame_bytes``, get one ``error`` frame
  with id ``None`` and code ``bad_request`` (after the answers to the valid frames before
  them), then that connection closes, and only that one: a bystander connection keeps being
  served;
- through ``gnosis_daemon.client`` (one connection, many requests in flight at once) every
  request ends with a result or a non-internal ``StationError``;
- after each example a fresh connection gets ``hello`` from the same station pid, and after
  the run the supervisor and the host counted no restart and no KV block is held by nobody.

Violations are collected over the whole run (deduplicated by kind, first reproducer kept),
then reported together; ``derandomize=True`` keeps runs reproducible.
"""

from __future__ import annotations

import socket
import time
from typing import Any

import msgpack
import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from gnosis_daemon.client import StationError, open_station_client
from gnosis_daemon.protocol import FrameDecoder, ProtocolError
from tests.fuzz.conftest import FUZZ_SETTINGS, MAX_FRAME_BYTES, Violations, Watch
from tests.fuzz.station_strategies import (
    KNOWN_OPS,
    UNDECODABLE,
    BadBytes,
    Frame,
    args_maps,
    bad_bytes,
    frames,
    oversized_array,
)

FRAME_TIMEOUT_S = 30.0  # a frame without its final frame by then is a hang
DOCUMENTED_CODES = {"unknown_op", "bad_request", "not_found", "capacity", "context_overflow",
                    "cancelled", "shutting_down"}  # and "internal", which is a bug
_EOF = object()


class RawConnection:
    """A plain blocking socket to the station, with its own reply decoder."""

    def __init__(self, path, timeout: float = FRAME_TIMEOUT_S) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        self.sock.connect(str(path))
        self.unpacker = msgpack.Unpacker(raw=False, strict_map_key=False)

    def send(self, payload: bytes) -> None:
        self.sock.sendall(payload)

    def next_frame(self) -> Any:
        """The next reply frame, or ``_EOF``; raises ``TimeoutError`` when none comes."""
        while True:
            try:
                return next(self.unpacker)
            except StopIteration:
                pass
            try:
                data = self.sock.recv(65536)
            except ConnectionResetError:
                return _EOF
            if not data:
                return _EOF
            self.unpacker.feed(data)

    def close(self) -> None:
        self.sock.close()


@pytest.fixture(scope="module")
def baseline(fuzz_daemon):
    return fuzz_daemon.baseline()


def _hello_pid(fuzz_daemon) -> int | str:
    """The pid a fresh connection's hello reports, or why there is none."""
    try:
        conn = RawConnection(fuzz_daemon.station_socket, timeout=10)
    except OSError as exc:
        return f"cannot connect: {exc}"
    try:
        conn.send(msgpack.packb({"v": 1, "id": 1, "op": "hello"}))
        frame = conn.next_frame()
        if isinstance(frame, dict) and frame.get("kind") == "result":
            return frame["data"]["pid"]
        return "connection closed: no hello" if frame is _EOF else f"hello answered {frame!r}"[:200]
    except OSError as exc:
        return f"hello failed: {exc!r}"
    finally:
        conn.close()


@pytest.fixture(scope="module")
def watch(baseline):
    return Watch(baseline.station_pid)


def _still_serving(fuzz_daemon, watch: Watch, violations: Violations, what: str) -> bool:
    pid = _hello_pid(fuzz_daemon)
    if pid == watch.pid:
        return True
    reason = "another pid answered" if isinstance(pid, int) else str(pid).split(":")[0]
    violations.add(f"the station stopped (fresh hello: {reason}) after", what)
    deadline = time.monotonic() + 90
    while not isinstance(pid, int) and time.monotonic() < deadline:
        time.sleep(0.2)
        pid = _hello_pid(fuzz_daemon)
    watch.pid = pid if isinstance(pid, int) else watch.pid
    return False


def _connect(fuzz_daemon, violations: Violations, what: str) -> RawConnection | None:
    try:
        return RawConnection(fuzz_daemon.station_socket)
    except OSError as exc:
        violations.add(f"cannot connect: {type(exc).__name__}", what)
        return None


def _final_frame(conn: RawConnection, frame: Frame, violations: Violations) -> bool:
    """Read up to ``frame``'s final reply; False when the connection is no longer usable."""
    what = frame.describe()
    while True:
        try:
            reply = conn.next_frame()
        except TimeoutError:
            violations.add(f"no final frame within {FRAME_TIMEOUT_S:g} s", what)
            return False
        if reply is _EOF:
            violations.add("connection closed instead of answering a decodable frame", what)
            return False
        if not isinstance(reply, dict) or reply.get("kind") not in ("event", "result", "error"):
            violations.add("a reply that is not a frame", f"{what} -> {reply!r}"[:400])
            continue
        if reply.get("id") != frame.expected_id or isinstance(reply.get("id"), bool):
            violations.add(f"reply id {reply.get('id')!r:.40} for a frame whose id is "
                           f"{frame.expected_id!r:.40}", f"{what} -> {str(reply)[:200]}")
            if reply.get("kind") == "event":
                continue
            return True
        if reply["kind"] == "event":
            continue
        if reply["kind"] == "error":
            error = reply.get("error") or {}
            if error.get("code") not in DOCUMENTED_CODES:
                op = frame.op if isinstance(frame.op, str) else type(frame.op).__name__
                violations.add(f"op {op!r:.30}: error code {error.get('code')!r}: "
                               f"{str(error.get('message'))[:120]}", what)
        return True


def test_the_frame_decoder_rejects_every_undecodable_kind():
    """In-process, no daemon: each kind of undecodable bytes is a fatal ProtocolError (which
    the station answers and closes that connection on), never another exception."""
    failures = []
    for name, payload in UNDECODABLE:
        try:
            list(FrameDecoder(MAX_FRAME_BYTES).feed(payload))
            failures.append(f"{name}: decoded without an error")
        except ProtocolError as exc:
            if not exc.fatal or exc.code != "bad_request":
                failures.append(f"{name}: {exc.code} fatal={exc.fatal}")
        except Exception as exc:  # noqa: BLE001 - what the property is about
            failures.append(f"{name} ({payload[:8].hex(' ')}): {type(exc).__name__}: {exc}")
    assert not failures, "\n".join(failures)


def test_random_frames_each_get_one_final_frame(fuzz_daemon, watch):
    violations = Violations()

    @settings(max_examples=150, **FUZZ_SETTINGS)
    @given(data=st.data())
    def run(data: st.DataObject) -> None:
        batch = [data.draw(frames(i), label=f"frame {i}") for i in range(data.draw(st.integers(1, 5)))]
        conn = _connect(fuzz_daemon, violations, batch[0].describe())
        if conn is None:
            return
        try:
            for frame in batch:
                try:
                    conn.send(frame.payload)
                except OSError as exc:
                    violations.add(f"send failed: {type(exc).__name__}", frame.describe())
                    break
                if not _final_frame(conn, frame, violations):
                    break
        finally:
            conn.close()
        _still_serving(fuzz_daemon, watch, violations, " | ".join(f.describe(160) for f in batch))

    run()
    assert not violations.seen, "product failures:\n" + violations.report()


def _expect_error_then_close(conn: RawConnection, case: str, violations: Violations,
                             prefix: list[Frame] = ()) -> None:
    for frame in prefix:
        reply = conn.next_frame()
        if not (isinstance(reply, dict) and reply.get("id") == frame.expected_id
                and reply.get("kind") == "result"):
            violations.add("a valid frame before bad bytes was not answered first",
                           f"{case} -> {reply!r}"[:400])
            return
    reply = conn.next_frame()
    if not (isinstance(reply, dict) and reply.get("kind") == "error" and reply.get("id") is None
            and (reply.get("error") or {}).get("code") == "bad_request"):
        shown = "EOF" if reply is _EOF else repr(reply)[:200]
        violations.add(f"bad bytes: {case.split(', then ')[-1].split(':')[0]} answered {shown}, "
                       "not one bad_request error with id null", case)
        return
    after = conn.next_frame()
    if after is not _EOF:
        violations.add("the connection stayed open after undecodable bytes", f"{case} -> {after!r:.200}")


def test_undecodable_bytes_close_only_that_connection(fuzz_daemon, watch):
    violations = Violations()
    crashed: set[str] = set()  # kinds of bad bytes that already stopped the station once

    @settings(max_examples=40, **FUZZ_SETTINGS)
    @given(bad=bad_bytes())
    def run(bad: BadBytes) -> None:
        if bad.name in crashed:
            return
        seen = Violations()  # this example's, kept only if the station survived it
        bystander = _connect(fuzz_daemon, violations, bad.describe())
        victim = _connect(fuzz_daemon, violations, bad.describe())
        try:
            if bystander is None or victim is None:
                return
            try:
                victim.send(b"".join(f.payload for f in bad.prefix) + bad.payload)
                _expect_error_then_close(victim, bad.describe(), seen, bad.prefix)
            except TimeoutError:
                seen.add(f"bad bytes: no answer and no close within {FRAME_TIMEOUT_S:g} s",
                         bad.describe())
            except OSError as exc:
                seen.add(f"bad bytes: {type(exc).__name__}", bad.describe())
            try:
                bystander.send(msgpack.packb({"v": 1, "id": "b", "op": "health"}))
                reply = bystander.next_frame()
            except OSError as exc:
                reply = exc
            if not (isinstance(reply, dict) and reply.get("kind") == "result"):
                seen.add("a bystander connection was not served after another one sent "
                         f"bad bytes: {reply!r:.100}", bad.describe())
        finally:
            for conn in (bystander, victim):
                if conn is not None:
                    conn.close()
        if _still_serving(fuzz_daemon, watch, violations, bad.describe()):
            for kind, (count, first) in seen.seen.items():
                for _ in range(count):
                    violations.add(kind, first)
        else:
            crashed.add(bad.name)

    run()
    assert not violations.seen, "product failures:\n" + violations.report()


def test_a_frame_past_max_frame_bytes_closes_its_connection(fuzz_daemon, watch):
    violations = Violations()
    payload = oversized_array()
    assert len(payload) > MAX_FRAME_BYTES
    conn = RawConnection(fuzz_daemon.station_socket)
    case = f"a tokenize frame of {len(payload)} bytes (an array of {MAX_FRAME_BYTES + 1} ints)"
    try:
        try:
            conn.send(payload)
        except (BrokenPipeError, ConnectionResetError):
            pass  # closed before the rest arrived: the answer is already on its way
        _expect_error_then_close(conn, case, violations)
    finally:
        conn.close()
    _still_serving(fuzz_daemon, watch, violations, case)
    assert not violations.seen, "product failures:\n" + violations.report()


def test_multiplexed_requests_through_the_client(fuzz_daemon, watch):
    violations = Violations()
    request = st.tuples(st.sampled_from(KNOWN_OPS + ("nope",)), args_maps())

    @settings(max_examples=30, **FUZZ_SETTINGS)
    @given(batch=st.lists(request, min_size=1, max_size=8))
    def run(batch: list[tuple[str, dict[str, Any]]]) -> None:
        async def one(conn, op: str, args: dict[str, Any]) -> None:
            try:
                await conn.request(op, args)
            except StationError as exc:
                if exc.code not in DOCUMENTED_CODES:
                    violations.add(f"client: op {op!r}: {exc.code}: {exc.message[:120]}",
                                   f"{op} {args!r:.300}")

        async def main() -> None:
            async with open_station_client(fuzz_daemon.station_socket,
                                           max_frame_bytes=MAX_FRAME_BYTES) as conn:
                with trio.fail_after(FRAME_TIMEOUT_S):
                    async with trio.open_nursery() as nursery:
                        for op, args in batch:
                            nursery.start_soon(one, conn, op, args)

        try:
            trio.run(main)
        except trio.TooSlowError:
            violations.add(f"client: requests unanswered after {FRAME_TIMEOUT_S:g} s",
                           repr(batch)[:400])
        except StationError as exc:  # connecting or hello failed
            violations.add(f"client: {exc.code}: {exc.message[:120]}", repr(batch)[:400])
        _still_serving(fuzz_daemon, watch, violations, repr(batch)[:400])

    run()
    assert not violations.seen, "product failures:\n" + violations.report()


def test_nothing_stopped_and_no_block_leaked(fuzz_daemon, baseline):
    problems = fuzz_daemon.unchanged_since(baseline)
    assert not problems, "\n".join(problems) + "\n" + fuzz_daemon.log_tail()
    assert fuzz_daemon.station("hello")["pid"] == baseline.station_pid
    leaked, stats = fuzz_daemon.leaked_blocks()
    assert leaked == 0, stats
