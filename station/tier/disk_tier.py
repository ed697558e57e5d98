"""The disk tier's engine side: write-behind and read-back through the I/O process.

The engine thread never touches a file: the tier's I/O process
(``station.tier.io.worker``) does, on KV blocks in shared memory (the CPU pool
itself, or a staging area that is also the host tier: ``station.tier.slots``). The engine hands
jobs over and applies the answers at its next step boundary (``before_step``), so decode
never waits on a disk (docs/engine.md, "The disk tier"):

* **write-behind**: every saved session (``KVCacheManager.take_writes``) is queued at
  once, its blocks referenced until the job is done. Done, the session is ``durable`` (an
  eviction moves it to the disk index), or, evicted meanwhile, a disk session. A newer save
  of an id replaces its queued job. Save to durable is the write-behind lag. Uses of a
  durable session are sent as ``touch`` (a session's first at once, later ones at most every
  10 s, ``jobs.Touches``): the disk budget evicts the least recently used.
  Queued writes are never dropped for being many: past half the pool their parts go out
  ``urgent`` (written at the station's priority at once), and new work waits for blocks
  the writer frees. Only a disk that stalls (a write part in flight for ``stall_s``, with half the
  pool queued) has its oldest jobs given up, each counted and logged by session id.
* **read-back**: a request whose session only the disk (or the host tier) holds waits in
  the scheduler while its blocks are read, checked and copied into fresh pool blocks;
  others keep decoding. A file that fails a check is quarantined, the request a miss.

Write jobs (writes, deletes, touches) go ``WRITES_IN_FLIGHT`` at once on a CPU pool the
process maps (a long engine step on a loaded host still hands the writer all it can do),
one at a time in parts of at most half a staging area, beside one load. If the I/O process
dies the tier is down: jobs in flight fail (a load's request runs as a miss), sessions stay
in the pool only, ``stats`` says why.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any, Callable

from gnosis_daemon.logs import get_logger
from station.core.kv_manager import KVCacheManager
from station.core.kv_results import LoadPlan, SessionOutcome
from station.core.sessions import KVSession
from station.tier.io.process import CLOSE_TIMEOUT_S, IOProcessGone, KVIOProcess
from station.tier.figures import TierFigures
from station.tier import jobs
from station.tier.jobs import LoadJob, WriteJob
from station.tier.shared import apply_discovered, apply_lost
from station.tier.slots import PoolSlots, StagingSlots

log = get_logger(__name__)


class DiskTier:
    """Owned by the engine; its methods run on the engine thread (``close`` after it stopped)."""

    def __init__(self, io: KVIOProcess, store_stats: dict[str, Any], kv: KVCacheManager,
                 slots: PoolSlots | StagingSlots, wake: Callable[[], None],
                 on_load_done: Callable[[LoadPlan, SessionOutcome | None], None], write_behind_s: float = 1.0) -> None:
        self.io, self.kv, self.slots, self.write_behind_s = io, kv, slots, write_behind_s
        self.stall_s = max(jobs.STALL_MIN_S, jobs.STALL_BOUNDS * write_behind_s)
        self._wake = wake  # tells the engine thread an answer is waiting
        self._on_load_done = on_load_done  # the scheduler's: admit the load's waiters
        self.figures = TierFigures()
        self.store_stats = store_stats  # the store's, as of the process's last answer
        self.down: str | None = None  # why the I/O process is gone
        self._lock = threading.Condition()
        self._answers: collections.deque[dict[str, Any] | None] = collections.deque()
        self._jobs: collections.OrderedDict[tuple[str, str], WriteJob] = collections.OrderedDict()
        self._inflight: dict[int, WriteJob] = {}  # write parts handed over, by message id
        self._max_inflight = jobs.WRITES_IN_FLIGHT if isinstance(slots, PoolSlots) else 1
        self._loads: collections.deque[LoadJob] = collections.deque()
        self._load: LoadJob | None = None  # in flight
        self._next_id = 0
        self._closed = False
        self.touches = jobs.Touches()  # uses on their way to the disk's LRU
        self._flushing = False  # a clean stop: every pending use is handed over
        self._reader = threading.Thread(target=self._read_loop, name="kv-io-reader", daemon=True)
        self._reader.start()

    # -- engine thread
    def before_step(self, stepping: bool = False) -> None:
        """Apply the process's answers, queue what was saved and used since, hand jobs over."""
        if stepping:  # a step follows: a writer that yields to decode waits (station.tier.io.worker)
            self.io.stamp(running=True)
        while True:
            with self._lock:
                if not self._answers:
                    break
                answer = self._answers.popleft()
            self._apply(answer)
        for session in self.kv.take_writes():
            self.touches.drop(session.session_id)  # an older use must not follow its write
            self._queue_write(session)
        self.touches.add(self.kv.take_touches())
        for session_id, last_used in self.touches.due(flush=self._flushing):
            if ("write", session_id) not in self._jobs:  # a queued write carries the use
                self._queue(WriteJob("touch", session_id, time.perf_counter(), last_used=last_used))
        self._drop_if_stalled()
        self._pump()

    def after_step(self) -> None:
        """The step ``before_step(stepping=True)`` announced has ended (or failed)."""
        self.io.stamp(running=False)

    def stats(self) -> dict[str, Any]:
        """The tier's figures for ``stats`` (another thread may read them)."""
        return {**self.figures.as_dict(), "kv_io_down": self.down, **self.slots.stats(),
                "kv_io_cpu_s": self.io.cpu_s(), **{f"disk_{k}": v for k, v in self.store_stats.items()}}

    def has_work(self) -> bool:  # answers to apply, or sessions saved or used to hand over
        return bool(self._answers or self.kv.to_write or self.kv.to_touch  # len() is atomic
                    or self.touches.wait_s() == 0)

    def wait_s(self) -> float | None:
        """Seconds until a session's use is due to be handed over (the engine's idle wait)."""
        return self.touches.wait_s()

    def busy(self) -> bool:  # loads in flight: the scheduler's waiters are admitted at their end
        with self._lock:
            return bool(self._loads) or self._load is not None or bool(self._answers)

    def writing(self, session_id: str) -> bool:
        """A write of ``session_id`` is queued or in flight."""
        return ("write", session_id) in self._jobs or any(
            j.op == "write" and j.session_id == session_id for j in self._inflight.values())

    def holds_blocks(self) -> bool:
        """Write jobs reference pool blocks: they come free as the writer gets through them."""
        return self._held_blocks() > 0

    def wait_for_writer(self, timeout_s: float = jobs.WRITER_WAIT_S) -> None:
        """Sleep until the I/O process answers (or ``timeout_s``): work that waits for blocks
        the writer holds waits here, leaving the cores to the writer, instead of spinning."""
        with self._lock:
            if not self._answers:
                self._lock.wait(timeout_s)

    def submit_loads(self, plans: list[LoadPlan]) -> None:
        now = time.perf_counter()
        if self.down:  # the requests run as misses
            for plan in plans:
                self._answer_load(LoadJob(plan, now), SessionOutcome.UNREADABLE)
            return
        with self._lock:
            self._loads.extend(LoadJob(plan, now) for plan in plans)
        self._pump()

    def delete(self, session_id: str) -> None:
        """Forget a session's files (``kv_session.delete``), after a write in flight of it."""
        for op in ("write", "touch"):
            job = self._jobs.pop((op, session_id), None)
            if job is not None:
                self._release(job)
        for job in self._inflight.values():
            if job.session_id == session_id:
                job.cancelled = True
        self._queue(WriteJob("delete", session_id, time.perf_counter()))
        self._pump()

    def close(self, flush: bool) -> None:
        """Stop the I/O process; with ``flush``, after every queued write reached disk (a
        clean stop). The engine thread has stopped: this thread applies the last answers."""
        deadline = time.monotonic() + CLOSE_TIMEOUT_S
        self._flushing = flush  # every pending use goes too
        self.before_step()  # the last saves
        if not flush:
            for job in self._jobs.values():
                self._release(job)
            self._jobs.clear()
        while not self.down and (self._jobs or self._inflight) and time.monotonic() < deadline:
            self.before_step()
            with self._lock:
                if not self._answers and (self._jobs or self._inflight):
                    self._lock.wait(0.5)
        self._closed = True
        try:
            self.io.send({"op": "close", "flush": flush})
        except IOProcessGone:
            pass
        self.io.stop(max(1.0, deadline - time.monotonic()))
        self._reader.join(5.0)

    # -- the queue
    def _queue_write(self, session: KVSession) -> None:
        if not session.blocks or self.down:  # nothing to keep, or nowhere to keep it
            return
        if any(j.session is session for j in (*self._jobs.values(), *self._inflight.values())):
            return  # saved again unchanged (KVCacheManager._saved_again): that job lands it
        block_ids = self.kv.hold_blocks(session.blocks)  # the job's: they stay as they are
        self._jobs.pop(("touch", session.session_id), None)
        self._queue(WriteJob("write", session.session_id, time.perf_counter(), session=session,
                         block_ids=block_ids))
        self._drop_if_stalled()

    def _held_blocks(self) -> int:
        """The pool blocks write jobs reference, queued and in flight."""
        return sum(len(j.block_ids) for j in (*self._jobs.values(), *self._inflight.values()))

    def _pressed(self) -> bool:
        """Write jobs, queued and in flight, hold more than half the pool."""
        return self._held_blocks() > self.kv.num_blocks // 2

    def _drop_if_stalled(self) -> None:
        """A stalled disk must not pin the pool for ever: with half of it queued and no write
        part in flight for ``stall_s``, the oldest queued writes go (never the newest), each
        counted and logged by name; an evicted one is lost (``kv_sessions_lost`` counts it)."""
        if not self._inflight:
            return
        waited = time.perf_counter() - min(j.sent_at for j in self._inflight.values())
        while waited > self.stall_s and self._pressed():  # (the cheap test first: every step)
            key = next((k for k, j in self._jobs.items() if j.block_ids), None)  # the oldest
            if key is None or key == next(reversed(self._jobs)):
                break
            job = self._jobs.pop(key)
            resident = self.kv.sessions.get(job.session_id) is job.session
            log.error("kv_tier_write_dropped", session_id=job.session_id,
                      tenant=job.session.tenant if job.session else None,
                      queued_s=round(time.perf_counter() - job.queued_at, 3),
                      stalled_s=round(waited, 3), resident=resident)
            self._release(job)
            self.figures.dropped_writes += 1

    def _queue(self, job: WriteJob) -> None:
        if self.down:
            return
        old = self._jobs.pop((job.op, job.session_id), None)
        self._jobs[(job.op, job.session_id)] = job
        if old is not None:  # superseded before it was sent
            self._release(old)
        self.figures.queued_writes = len(self._jobs) + len(self._inflight)

    def _release(self, job: WriteJob) -> None:  # drop the references a write job held
        if job.block_ids:
            self.kv.release_blocks(job.block_ids)
            job.block_ids = []

    def _pump(self) -> None:
        """Hand queued jobs over (up to ``_max_inflight``), and a load part when none is."""
        if self.down or self._closed:
            return
        while self._jobs and len(self._inflight) < self._max_inflight and not self.down and \
                jobs.may_send(list(self._inflight.values()), next(iter(self._jobs.values())), self.kv.num_blocks):
            self._send_part(self._jobs.popitem(last=False)[1])
        if self._load is None and self._loads:
            with self._lock:
                self._load = self._loads.popleft()
            self._send_load_part(self._load)

    def _send(self, message: dict[str, Any]) -> None:
        """Hand a job part over; a process that is gone takes the tier down (fails its jobs)."""
        try:
            self.io.send(message)
        except IOProcessGone as exc:
            self._io_gone(str(exc))

    def _send_part(self, job: WriteJob) -> None:
        self._next_id += 1
        message: dict[str, Any] = {"op": job.op, "job": self._next_id, "session_id": job.session_id,
                                   "age_s": time.perf_counter() - job.queued_at,  # since the save
                                   "tenant": job.session.tenant if job.session else None}
        job.slots = []
        job.sent_at = time.perf_counter()
        self._inflight[self._next_id] = job
        pin = self.kv.pins.get(job.session_id)  # a TTL pin's expiry goes with it
        if job.op == "touch":
            message["last_used"] = job.last_used
            if pin is not None:
                message["expires_at"] = pin.expires_at
        elif job.op == "write":
            session, bs = job.session, self.kv.block_size
            assert session is not None  # a write carries its session
            n = min(len(job.block_ids) - job.sent, self.slots.part_blocks, self.slots.room())
            job.hashes = list(session.file_hashes[job.sent:job.sent + n])
            job.slots = self.slots.stage_out(job.block_ids[job.sent:job.sent + n], job.hashes)
            message.update(slots=job.slots, hashes=job.hashes, urgent=self._pressed(),
                           tokens=list(session.token_ids[job.sent * bs:(job.sent + n) * bs]))
            job.sent += n
            message["final"] = job.sent == len(job.block_ids)
            if message["final"]:
                message["session"] = {"session_id": session.session_id, "tenant": session.tenant,
                                      "token_ids": list(session.token_ids),
                                      "hashes": list(session.file_hashes),
                                      "last_used": session.last_used,
                                      "expires_at": pin.expires_at if pin else None,
                                      "ttl_s": pin.ttl_s if pin else None}
        self._send(message)

    def _send_load_part(self, load: LoadJob) -> None:
        on_disk, bs, blocks = load.plan.session, self.kv.block_size, load.plan.blocks
        n = min(len(blocks) - load.sent, self.slots.part_blocks, self.slots.room())
        first, load.sent = load.sent, load.sent + n
        load.block_ids = [b.block_id for b in blocks[first:load.sent]]
        load.hashes = list(on_disk.file_hashes[first:load.sent])
        load.slots, load.missing = self.slots.load_part(load.block_ids, load.hashes)
        if not load.missing:  # the host tier holds the whole part: done at the next boundary
            with self._lock:  # (not now: the scheduler is in the middle of a step)
                self._answers.append({"kind": "loaded", "ok": True})
            return
        load.from_disk = True
        tokens = on_disk.token_ids
        self._send({"op": "load", "load": id(load), "slots": [load.slots[i] for i in load.missing],
                      "hashes": [load.hashes[i] for i in load.missing],
                      "tokens": [t for i in load.missing
                                 for t in tokens[(first + i) * bs:(first + i + 1) * bs]]})

    # -- answers (engine thread)
    def _apply(self, answer: dict[str, Any] | None) -> None:
        if answer is None:
            self._io_gone("the KV I/O process exited")
        elif answer["kind"] == "written" and answer.get("job") in self._inflight:
            self._write_answer(self._inflight.pop(answer["job"]), answer)
        elif answer["kind"] == "loaded" and self._load is not None:
            self._load_part_done(self._load, answer)
        elif answer["kind"] == "discovered":
            apply_discovered(self.kv, self.figures, self.writing, answer)
        if answer is not None and answer.get("lost"):  # the tier's directory was deleted
            for resident in apply_lost(self.kv, self.writing, answer["lost"]):
                self._queue_write(resident)
        self._pump()

    def _load_part_done(self, load: LoadJob, answer: dict[str, Any]) -> None:
        ok = answer["ok"]
        self.slots.loaded(load.slots, load.block_ids, load.hashes, load.missing, ok)
        if ok and load.sent < len(load.plan.blocks):
            self._send_load_part(load)
            return
        self._load = None
        load.plan.session.read_from = "disk" if load.from_disk else "host"
        error = (None if ok else SessionOutcome.QUARANTINED if answer.get("quarantined")
                 else SessionOutcome.UNREADABLE)
        self._answer_load(load, error)

    def _write_answer(self, job: WriteJob, answer: dict[str, Any]) -> None:
        self.slots.written(job.slots, job.hashes, answer["ok"])
        job.slots = []
        self._forget_evicted(evicted := answer.get("evicted", []))  # a full disk's too
        if answer["ok"] and not answer["final"] and not job.cancelled:
            self._send_part(job)
            return
        self.figures.queued_writes = len(self._jobs) + len(self._inflight)
        self._release(job)
        if job.op == "touch":
            self.figures.touches += answer["ok"]
        if job.op != "write" or job.cancelled:
            return
        if not answer["ok"]:
            self.figures.write_errors += 1
            return
        self.figures.writes += 1
        lag_s = time.perf_counter() - job.queued_at
        self.figures.lag_ms.append(lag_s * 1000)
        if lag_s > self.write_behind_s:
            # A SIGKILL in that window would have lost it: the disk is slower than the saves.
            self.figures.late_writes += 1
            log.warning("kv_tier_write_late", session_id=job.session_id,
                        lag_s=round(lag_s, 3), bound_s=self.write_behind_s)
        if job.session_id in evicted:
            return
        assert job.session is not None  # a write carries its session
        if self.kv.sessions.get(job.session_id) is job.session:
            job.session.durable = True
        else:  # evicted from the pool while its write was on the way: on disk now
            self.kv.landed(job.session)

    def _forget_evicted(self, evicted: list[str]) -> None:
        """Sessions the disk budget removed leave the disk index; a resident one is not durable."""
        for session_id in evicted:
            self.kv.disk.remove(session_id)
            resident = self.kv.sessions.get(session_id)
            if resident is not None:
                resident.durable = False

    def _answer_load(self, load: LoadJob, error: SessionOutcome | None) -> None:
        if error is None:
            self.figures.loads += 1
            self.figures.load_ms.append((time.perf_counter() - load.queued_at) * 1000)
        else:
            self.figures.load_failures += 1
            if not self.down:
                # Its KV is no longer all there: drop the manifest too (the bad file is kept,
                # quarantined; the good blocks go with the next eviction unless shared).
                self.delete(load.plan.session.session_id)
        self.kv.finish_load(load.plan, error)
        self._on_load_done(load.plan, error)

    def _io_gone(self, why: str) -> None:
        """The I/O process is gone: fail what it held; the pool serves on without a tier."""
        if self.down:
            return
        self.down = why
        if not self._closed:
            log.error("kv_tier_down", reason=why)
        inflight = list(self._inflight.values())
        self._inflight.clear()
        for job in inflight:
            self.slots.written(job.slots, job.hashes, False)
        for pending in inflight + list(self._jobs.values()):
            self._release(pending)
            self.figures.write_errors += pending.op == "write"
        self._jobs.clear()
        self.figures.queued_writes = 0
        if self._load is not None:
            load = self._load
            self.slots.loaded(load.slots, load.block_ids, load.hashes, load.missing, False)
        with self._lock:
            loads = ([self._load] if self._load is not None else []) + list(self._loads)
            self._load = None
            self._loads.clear()
        for load in loads:
            self._answer_load(load, SessionOutcome.UNREADABLE)
        for on_disk in list(self.kv.disk.sessions()):  # none can be read back now
            self.kv.disk.remove(on_disk.session_id)

    # -- reader thread
    def _read_loop(self) -> None:
        while True:
            message = self.io.receive()
            if message is not None:
                if isinstance(message.get("stats"), dict) and message["stats"]:
                    self.store_stats = message["stats"]
                message = None if message["kind"] == "closed" else message
            with self._lock:
                self._answers.append(message)
                self._lock.notify_all()
            self._wake()
            if message is None:
                return
