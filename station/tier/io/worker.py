"""The disk tier's I/O process (``python -m station.tier.io.worker FD LEVEL FORMAT NICE``).

The station starts it beside itself (``station.tier.io.process``) and it owns the
tier's ``KVStore``: every file read, written, hashed, fsynced, evicted or quarantined is
its work, on its own CPU time and its own GIL. KV bytes never cross the socket: the
station passes, once, a memfd of KV blocks (its CPU pool itself, or the staging area in
front of a GPU pool) and each job names slots of it.

Messages are msgpack maps over the Unix socket FD (the station's end sends, with ``open``,
the memfd). Jobs, in order:

* ``open`` -> ``sessions`` (chunks of the index the files give) then ``opened``;
* ``write`` parts: the blocks of the named slots the store lacks, and with the ``final``
  part the session's manifest, then the disk budget -> ``written`` (``evicted`` sessions).
  A block is written at ``NICE`` (``SCHED_IDLE`` at 19, on a thread of its own) until
  ``open``'s ``rise_s`` after the session was saved (``age_s``: the part's age when it was
  sent), then at the station's own priority, as is every block of an ``urgent`` part (the
  station's queue is deep): the writer's priority rises as a save nears its bound. With
  ``open``'s ``yields`` (and a second memfd, the engine's ``DecodeBeat``), no block is
  written while decode steps go on, until ``rise_s`` after the save;
* ``delete``, ``touch`` (a use, for the disk LRU) -> ``written``;
* ``load``: the named blocks, each verified, into the named slots -> ``loaded``;
* ``close`` (``flush``: after every write sent before it) -> ``closed``, and the process exits.

On a fleet's shared tier (``open``'s ``shared_scan_s``) the writer thread also rescans the
manifests that often and sends what the other replicas saved, replaced or removed as
``discovered`` (unasked: ``added`` records, ``removed`` ids).

Writes, deletes and touches run in order on one thread, loads on another, so a read-back
never waits behind a long write. Loads run at the station's priority: a request waits on
each one. At EOF (the station died, a SIGKILL included) the jobs
already received are finished, then the store closes: a crash loses only what was never
sent. SIGTERM and SIGINT are ignored: a service manager signalling the whole group must
not cut a clean stop's flush short; the station's ``close`` (or EOF) ends the process.
"""

from __future__ import annotations

import collections
import concurrent.futures
import mmap
import os
import signal
import socket
import struct
import sys
import threading
import time
from typing import Any

import numpy

from gnosis_daemon.logs import configure_logging, get_logger
from gnosis_daemon.protocol import FrameDecoder, encode
from station.core.block_pool import BlockHash
from station.tier.dtype import DTypeName
from station.tier.store.store import DiskFull, KVStore, Quarantined, StoreBusy
from station.tier.store.pressure import ROOT_CHECK_S

log = get_logger(__name__)

MAX_FRAME_BYTES = 256 * 1024 * 1024  # a part names block slots and tokens, never KV bytes
SESSIONS_PER_FRAME = 256
BEAT_FRESH_S = 0.05  # a step running or ended this recently: the engine is at work
YIELD_POLL_S = 0.005  # how often a yielding writer looks at the stamp again


class DecodeBeat:
    """Eight bytes of shared memory (a memfd the I/O process maps): the CLOCK_MONOTONIC
    time the engine's last step ended, or infinity while one runs, stamped by the engine
    thread, read by the writer."""

    FORMAT = "d"

    def __init__(self) -> None:
        self.fd = os.memfd_create("gnosis-decode-beat", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, struct.calcsize(self.FORMAT))
        self._map = mmap.mmap(self.fd, struct.calcsize(self.FORMAT))

    def stamp(self, at: float | None = None) -> None:
        """A step now (or ``at``, a CLOCK_MONOTONIC time)."""
        struct.pack_into(self.FORMAT, self._map, 0, time.monotonic() if at is None else at)

    @classmethod
    def age_s(cls, mapped: mmap.mmap) -> float:
        """Seconds since the last stamp (the I/O process's side; huge before the first)."""
        return time.monotonic() - struct.unpack_from(cls.FORMAT, mapped, 0)[0]


def lower_priority(nice: int) -> None:
    """Give the calling thread (Linux: nice and policy are per thread) ``nice``, and at 19
    ``SCHED_IDLE``: besides its smaller share, a SCHED_IDLE thread is preempted as soon as a
    decode thread wakes, where a nice-19 one may finish its slice first. Lowering needs no
    privilege; raising it back would, so the writer keeps a thread at each priority."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, max(nice, os.getpriority(os.PRIO_PROCESS, tid)))
        if nice == 19 and hasattr(os, "SCHED_IDLE"):
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except OSError:  # not allowed here: this thread runs at the station's priority
        pass


class Worker:
    def __init__(self, sock: socket.socket, nice: int = 19) -> None:
        self.sock = sock
        # The thread that writes blocks while their save is young (at ``nice``); later ones
        # are written by the writer thread itself, at the station's priority.
        self._low = (concurrent.futures.ThreadPoolExecutor(1, "kv-io-low", lower_priority, (nice,))
                     if nice > 0 else None)
        if self._low is not None:
            self._low.submit(lambda: None)  # its thread starts now, at its priority
        self.rise_s = 0.0  # a block of a save older than this is written at full priority
        self._send_lock = threading.Lock()
        self._fds: list[int] = []
        self.store: KVStore | None = None
        self.area: numpy.ndarray | None = None  # [L, 2, slots, bytes of a block's layer half]
        self.block_shape: tuple[int, ...] = ()
        self._cond = threading.Condition()
        self._jobs: collections.deque[dict[str, Any]] = collections.deque()  # writer's, in order
        self._loads: collections.deque[dict[str, Any]] = collections.deque()
        self._eof = False
        self.scan_s: float | None = None  # a shared tier's rescan period
        self._scanned = 0.0
        self.beat: mmap.mmap | None = None  # the engine's DecodeBeat, when the writer yields
        self.yielded_s = 0.0  # the writer's time spent waiting for decode to pause, in all
        self.risen_blocks = 0  # blocks written at full priority (late or urgent), in all

    def send(self, message: dict[str, Any]) -> None:
        data = encode(message)
        with self._send_lock:
            try:
                self.sock.sendall(data)
            except OSError:  # the station is gone: nobody is waiting for the answer
                pass

    def stats(self) -> dict[str, Any]:
        if self.store is None:
            return {}
        return {**self.store.stats(), "write_yield_s": round(self.yielded_s, 3),
                "write_risen_blocks": self.risen_blocks}

    # -- the socket (main thread)
    def run(self) -> None:
        writer = threading.Thread(target=self._write_loop, name="kv-io-writer")
        loader = threading.Thread(target=self._load_loop, name="kv-io-loader", daemon=True)
        writer.start()
        loader.start()
        decoder = FrameDecoder(MAX_FRAME_BYTES)
        while True:
            try:
                data, fds, _flags, _addr = socket.recv_fds(self.sock, 1 << 20, 4)
            except OSError:
                data, fds = b"", []
            self._fds.extend(fds)
            if not data:
                break
            for message in decoder.feed(data):
                if message.get("op") == "open":
                    self._open(message)
                elif message.get("op") == "load":
                    with self._cond:
                        self._loads.append(message)
                        self._cond.notify_all()
                else:
                    message["saved_at"] = time.monotonic() - message.get("age_s", 0.0)
                    with self._cond:
                        self._jobs.append(message)
                        self._cond.notify_all()
                    if message.get("op") == "close":
                        writer.join()
                        return
        with self._cond:  # EOF: finish what was sent, then close the store
            self._eof = True
            self._cond.notify_all()
        writer.join()

    def _open(self, message: dict[str, Any]) -> None:
        try:
            self.block_shape = tuple(message["block_shape"])
            dtype = DTypeName(message["dtype"], message["dtype_bytes"])
            fd = self._fds.pop(0)
            mapped = mmap.mmap(fd, message["area_bytes"])
            os.close(fd)
            if message.get("yields"):
                fd = self._fds.pop(0)
                self.beat = mmap.mmap(fd, struct.calcsize(DecodeBeat.FORMAT))
                os.close(fd)
            self.rise_s = float(message.get("rise_s") or 0.0)
            layers = self.block_shape[0]
            self.area = numpy.frombuffer(mapped, dtype=numpy.uint8).reshape(
                layers, 2, message["area_blocks"], -1)
            deadline = time.monotonic() + message["busy_wait_s"]
            while True:
                try:
                    self.scan_s = message.get("shared_scan_s")
                    self.store = KVStore(message["root"], message["fingerprint"],
                                         message["block_size"], self.block_shape, dtype,
                                         message["budget"], shared=self.scan_s is not None,
                                         quarantine_budget_bytes=message.get("quarantine_budget", 1 << 30),
                                         tenant_share=message.get("tenant_share", 1.0))
                    break
                except StoreBusy:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.2)
        except Exception as exc:  # an unusable directory: the station serves without the tier
            log.exception("kv_tier_open_failed", path=message.get("root"))
            error = str(exc) if isinstance(exc, StoreBusy) else f"{type(exc).__name__}: {exc}"
            self.send({"kind": "opened", "error": error, "stats": {}})
            return
        expired = self.store.drop_expired()
        if expired:
            log.info("kv_tier_pins_expired", sessions=len(expired))
        records = [r.wire() for r in self.store.load_sessions()]
        with self._cond:  # the writer thread waits without a timeout until it knows
            self._scanned = time.monotonic()
            self._cond.notify_all()
        for i in range(0, len(records), SESSIONS_PER_FRAME):
            self.send({"kind": "sessions", "records": records[i:i + SESSIONS_PER_FRAME]})
        self.send({"kind": "opened", "error": None, "stats": self.stats()})

    # -- writes, deletes, touches (writer thread)
    def _write_loop(self) -> None:
        checked = time.monotonic()  # when the tier's directories were last looked for
        while True:
            with self._cond:
                while not self._jobs and not self._eof:
                    due = checked + ROOT_CHECK_S
                    if self.scan_s is not None:
                        due = min(due, self._scanned + self.scan_s)
                    if due <= time.monotonic():
                        break
                    self._cond.wait(due - time.monotonic())
                if not self._jobs and self._eof:  # EOF and nothing left
                    break
                job = self._jobs.popleft() if self._jobs else None
            if self.scan_s is not None and time.monotonic() - self._scanned >= self.scan_s:
                self._rescan()
            if job is None or time.monotonic() - checked >= ROOT_CHECK_S:
                checked = time.monotonic()
                self._check_root()
            if job is None:
                continue
            if job["op"] == "close":
                if not job.get("flush"):
                    with self._cond:
                        self._jobs.clear()
                break
            self.send(self._do_write(job))
        if self._low is not None:
            self._low.shutdown()
        if self.store is not None:
            stats = self.stats()
            self.store.close()
            self.send({"kind": "closed", "stats": stats})

    def _check_root(self) -> None:
        """A tier directory deleted under the store: recreated, and the station told which
        sessions went with it (the engine writes the ones its pool still holds again)."""
        if self.store is None:
            return
        try:
            self.store.check_root()
        except OSError as exc:  # could not make it again (yet): the next look tries again
            log.warning("kv_tier_root_check_failed", error=str(exc))
        lost = self.store.take_lost()
        if lost:
            self.send({"kind": "lost", "lost": lost, "stats": self.stats()})

    def _rescan(self) -> None:
        """A shared tier: tell the station what the other replicas wrote or removed."""
        self._scanned = time.monotonic()
        if self.store is None:
            return
        try:
            added, removed = self.store.rescan()
        except OSError:  # the volume is unreachable now: the next look may do better
            log.exception("kv_tier_rescan_failed")
            return
        if added or removed:
            for i in range(0, max(len(added), 1), SESSIONS_PER_FRAME):
                self.send({"kind": "discovered", "added": [r.wire() for r in added[i:i + SESSIONS_PER_FRAME]],
                           "removed": removed if i == 0 else []})

    def _do_write(self, job: dict[str, Any]) -> dict[str, Any]:
        reply: dict[str, Any] = {"kind": "written", "job": job["job"], "final": job.get("final", True),
                                 "ok": False, "evicted": []}
        store = self.store
        try:
            if store is None:
                raise RuntimeError("the store is not open")
            if job["op"] == "delete":
                store.delete_session(job["session_id"])
            elif job["op"] == "touch":
                store.touch_session(job["session_id"], job["last_used"], job.get("expires_at"))
            elif job["op"] == "write":
                bs = store.layout.block_size
                tokens = job["tokens"]
                for i, (slot, block_hash) in enumerate(zip(job["slots"], job["hashes"])):
                    if not store.has_block(BlockHash(block_hash)):
                        self._write_block(store, BlockHash(block_hash), tokens[i * bs:(i + 1) * bs],
                                          slot, job["saved_at"], bool(job.get("urgent")),
                                          job.get("tenant"), job["session_id"])
                session = job.get("session")
                if session is not None:
                    store.write_session(session["session_id"], session["tenant"],
                                        session["token_ids"],
                                        [BlockHash(h) for h in session["hashes"]],
                                        session["last_used"], session.get("expires_at"),
                                        session.get("ttl_s"))
                    reply["evicted"] = list(store.evict_to_budget(session["tenant"]).sessions)
            else:
                raise ValueError(f"unknown job {job['op']!r}")
            reply["ok"] = True
        except DiskFull as exc:  # counted and reported (disk_full, last_error): no traceback
            log.warning("kv_tier_write_failed", op=job.get("op"), session_id=job.get("session_id"),
                        error=str(exc))
            reply["error"] = f"DiskFull: {exc}"
        except Exception as exc:  # a dead disk: the station keeps the session in the pool
            log.exception("kv_tier_write_failed", op=job.get("op"), session_id=job.get("session_id"))
            reply["error"] = f"{type(exc).__name__}: {exc}"
            if store is not None:
                store.last_error, store.last_error_at = reply["error"], time.time()
        if store is not None:  # what a full disk evicted, what a deleted directory lost
            reply["evicted"] += store.take_evicted()
            reply["lost"] = store.take_lost()
        reply["stats"] = self.stats()
        return reply

    def _write_block(self, store: KVStore, block_hash: BlockHash, tokens: list[int], slot: int,
                     saved_at: float, urgent: bool, tenant: str | None, session_id: str) -> None:
        """Write one block: at the low priority while its save is young, else at full."""
        def write() -> None:
            store.write_block(block_hash, tokens, self._block(slot), tenant, session_id)

        if not urgent and self._low is not None:
            self._yield_to_decode(saved_at)
            if time.monotonic() - saved_at < self.rise_s:
                self._low.submit(write).result()
                return
        if self._low is not None:
            self.risen_blocks += 1
        write()

    def _yield_to_decode(self, saved_at: float) -> None:
        """Wait while the engine is decoding (its beat is fresh), until ``rise_s`` after the
        session was saved: on a CPU host every core is decode's, and a block written beside a
        step costs the step more than the block's own CPU time (docs/engine.md, "Why a
        process"). A writer that is behind (its job older than that) waits for nothing."""
        if self.beat is None:
            return
        start = time.monotonic()
        while DecodeBeat.age_s(self.beat) < BEAT_FRESH_S and time.monotonic() - saved_at < self.rise_s:
            time.sleep(YIELD_POLL_S)
        self.yielded_s += time.monotonic() - start

    def _block(self, slot: int) -> numpy.ndarray:
        """The block's bytes as the pool holds them (per layer, its K then its V), flat."""
        assert self.area is not None  # mapped at open, before any job
        return numpy.ascontiguousarray(self.area[:, :, slot]).reshape(-1)

    # -- loads (loader thread)
    def _load_loop(self) -> None:
        while True:
            with self._cond:
                while not self._loads:
                    self._cond.wait()
                job = self._loads.popleft()
            reply: dict[str, Any] = {"kind": "loaded", "load": job["load"], "ok": False}
            try:
                if self.store is None or self.area is None:
                    raise RuntimeError("the store is not open")
                bs = self.store.layout.block_size
                tokens = job["tokens"]
                for i, (slot, block_hash) in enumerate(zip(job["slots"], job["hashes"])):
                    data = self.store.read_block(BlockHash(block_hash), tokens[i * bs:(i + 1) * bs],
                                                 raw=True)
                    self.area[:, :, slot] = data.reshape(self.area.shape[0], 2, -1)
                reply["ok"] = True
            except Exception as exc:  # noqa: BLE001 - a bad file is quarantined by the store, which says why
                log.warning("kv_tier_load_failed", error=str(exc))
                reply["error"] = f"{type(exc).__name__}: {exc}"
                reply["quarantined"] = isinstance(exc, Quarantined)
            reply["stats"] = self.stats()
            self.send(reply)


def main(argv: list[str]) -> int:
    sock_fd, level, fmt, nice = int(argv[1]), argv[2], argv[3], int(argv[4])
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    configure_logging("kv-io", level, fmt)
    Worker(socket.socket(fileno=sock_fd), nice).run()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
