"""The station's end of the disk tier's I/O process (``station.tier.io.worker``).

``KVIOProcess`` starts the process over a socketpair and carries msgpack maps both ways;
``open`` hands it the tier's directory and layout and the memfd of KV blocks it works on,
and returns the index its files give (``SessionRecord``s, nothing read but manifests).

The writer writes a young save's blocks at ``kv_io_nice`` and, from ``rise_s`` after the
save on (a quarter of ``kv_write_behind_s``), at the station's own priority, so saves reach
disk while decode keeps every core busy. On a CPU host at ``kv_io_nice = 19`` it also yields
to the engine until then: the engine thread stamps a word of shared memory (``DecodeBeat``)
as each step starts and ends, and the process writes no block during a step or for
``BEAT_FRESH_S`` after one (``station.tier.io.worker``).

Why a process and not a thread: a writer thread in the station competes with decode for
the GIL (the engine thread waits for it between torch ops) as well as for the cores; in its
own process it competes for the cores only, at the priority ``kv_io_nice`` gives it
(docs/engine.md, "Why a process", has the measured trade-off).
"""

from __future__ import annotations

import math
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Sequence

from gnosis_daemon.logs import get_logger
from gnosis_daemon.protocol import FrameDecoder, encode
from station.tier.io.worker import MAX_FRAME_BYTES, DecodeBeat
from station.tier.format import SessionRecord

log = get_logger(__name__)

OPEN_TIMEOUT_S = 120.0  # torch's import, then a listing of the tier's directories
CLOSE_TIMEOUT_S = 120.0  # a clean stop's last writes
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


class IOProcessGone(RuntimeError):
    """The I/O process exited or stopped answering."""


class TierOpenFailed(RuntimeError):
    """The I/O process could not open the store; the message is its error, as is."""


class KVIOProcess:
    def __init__(self, log_level: str = "info", log_format: str = "auto", nice: int = 19,
                 launcher: Sequence[str] = ()) -> None:
        """``launcher``: a command the process is started under (its arguments follow), e.g.
        one that gives it a mount namespace of its own."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock = ours
        self.proc = subprocess.Popen(
            [*launcher, sys.executable, "-m", "station.tier.io.worker", str(theirs.fileno()),
             log_level, log_format, str(nice)], pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL)
        theirs.close()
        self._decoder = FrameDecoder(MAX_FRAME_BYTES)
        self._received: list[dict[str, Any]] = []
        self._send_lock = threading.Lock()
        self.beat: DecodeBeat | None = None  # open's, when the writer yields to decode
        log.info("kv_io_process_started", pid=self.proc.pid)

    def send(self, message: dict[str, Any], fds: tuple[int, ...] = ()) -> None:
        data = encode(message)
        with self._send_lock:
            try:
                sent = socket.send_fds(self.sock, [data], list(fds)) if fds else 0
                self.sock.sendall(data[sent:])
            except OSError as exc:
                raise IOProcessGone(f"the KV I/O process is gone: {exc}") from None

    def receive(self, timeout: float | None = None) -> dict[str, Any] | None:
        """The next message; None at EOF (the process exited). ``timeout``: IOProcessGone."""
        self.sock.settimeout(timeout)
        while not self._received:
            try:
                data = self.sock.recv(1 << 20)
            except TimeoutError:
                raise IOProcessGone("the KV I/O process did not answer in time") from None
            except OSError:
                data = b""
            if not data:
                return None
            self._received.extend(self._decoder.feed(data))
        return self._received.pop(0)

    def open(self, root: Path, fingerprint: str, block_size: int, block_shape: tuple[int, ...],
             dtype: Any, budget: int, area: Any, busy_wait_s: float,
             shared_scan_s: float | None = None, yields: bool = False,
             rise_s: float = 0.0, quarantine_budget: int = 1 << 30,
             tenant_share: float = 1.0) -> tuple[list[SessionRecord], dict[str, Any]]:
        """Open the store at ``root`` in the process, on ``area`` (``kv_cache.SharedBlocks``).
        ``busy_wait_s``: how long to wait for another process's lock on the store (a station
        that just died may leave its I/O process finishing a job). ``shared_scan_s``: the
        root is a fleet's shared tier, rescanned for the other replicas' sessions that often
        (``discovered`` messages follow). ``rise_s``: a save older than that is written at
        the station's priority; ``yields``: until then the writer also yields to the
        engine's steps (``stamp``). ``quarantine_budget``: the bytes damaged files may keep in
        quarantine/; ``tenant_share``: the share of ``budget`` a tenant holds before its own
        sessions are evicted first (``station.tier.store.pressure``).
        -> (its sessions, least recently used first; its stats). Raises ``TierOpenFailed``."""
        fds: tuple[int, ...] = (area.fd,)
        if yields:
            self.beat = DecodeBeat()
            fds += (self.beat.fd,)
        self.send({"op": "open", "root": str(root), "fingerprint": fingerprint,
                   "block_size": block_size, "block_shape": list(block_shape), "dtype": str(dtype),
                   "dtype_bytes": dtype.itemsize,
                   "budget": budget, "busy_wait_s": busy_wait_s, "area_blocks": area.num_blocks,
                   "area_bytes": area.nbytes, "shared_scan_s": shared_scan_s, "yields": yields,
                   "rise_s": rise_s, "quarantine_budget": quarantine_budget,
                   "tenant_share": tenant_share},
                  fds=fds)
        if self.beat is not None:  # the process has its own descriptor now; the mapping stays
            os.close(self.beat.fd)
        records: list[SessionRecord] = []
        while True:
            message = self.receive(OPEN_TIMEOUT_S)
            if message is None:
                raise IOProcessGone(f"the KV I/O process exited (status {self.proc.wait()})")
            if message["kind"] == "sessions":
                records.extend(SessionRecord.from_wire(item) for item in message["records"])
            elif message["kind"] == "opened":
                if message["error"]:
                    raise TierOpenFailed(message["error"])
                return records, message["stats"]

    def stamp(self, running: bool) -> None:
        """The engine thread: a step starts (``running``: the writer waits however long it
        takes) or has ended (the writer waits ``BEAT_FRESH_S`` more). Stamped only at a
        step's start, a prefill step longer than that looked like a pause: the writer wrote
        beside it, and the moment a long prompt's first token went out it started on its
        save, beside the next request's first token."""
        if self.beat is not None:
            self.beat.stamp(math.inf if running else None)

    def cpu_s(self) -> float | None:
        """The process's CPU seconds so far, every thread's, user and system (Linux's
        ``/proc``; None elsewhere or once it is gone): what the tier's work has cost."""
        try:
            fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            return None
        return round((int(fields[11]) + int(fields[12])) / _CLOCK_TICKS, 3)  # utime, stime

    def abandon(self) -> None:
        """Close our end without a job: the process sees EOF and exits."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.stop(10.0)

    def stop(self, timeout: float = CLOSE_TIMEOUT_S) -> None:
        """Wait for the process to exit (after ``close`` was sent or the socket closed)."""
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            log.error("kv_io_process_killed", pid=self.proc.pid, timeout_s=timeout)
            self.proc.kill()
            self.proc.wait()
        self.sock.close()
