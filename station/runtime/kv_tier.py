"""The disk tier's engine side: write-behind and read-back threads around ``KVStore``.

The engine thread never touches a file. It hands work to two threads and takes their
answers back at its next step boundary (``before_step``), so decode never waits on disk:

* **write-behind** (``Writer``): every saved session (``KVCacheManager.take_writes``) is
  queued at once. For as long as the job is queued the engine holds one reference on each of
  its blocks, so a block the writer has not read yet is never reused, however soon the
  session is evicted. The writer copies each block the store does not have yet (blocks are
  content-addressed: a conversation's shared prefix is written once), then the session's
  manifest, each file fsynced and renamed into place. When the job is done the engine
  marks the session ``durable``: from then on an eviction moves it to the disk index
  instead of losing it. A newer save of a session id replaces a job still queued for it.
  The delay from save to durable is the write-behind lag, reported as p50/p99.
* **read-back** (``Loader``): a request whose session only the disk holds waits in the
  scheduler while its blocks are read, checked (every file's checksum, model fingerprint,
  block size, shape, dtype and tokens) and copied into fresh pool blocks; other requests
  keep decoding. A file that fails a check is quarantined by the store and the request
  runs as a miss.

Threads and the GIL: file I/O and hashing (xxh3-128, a block's bytes) release it, and the
writer runs at the lowest CPU priority, so it takes the cores decode leaves; what it costs
decode on a saturated 2-core CPU is a `make bench` row (docs/benchmarks.md).
"""

from __future__ import annotations

import collections
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy
import torch

from gnosis_daemon.logs import get_logger
from station.core.kv_manager import KVCacheManager, LoadPlan
from station.core.sessions import KVSession

log = get_logger(__name__)

_LAG_WINDOW = 4096  # write-behind lags kept for the percentiles


@dataclass(slots=True)
class _WriteJob:
    session: KVSession
    block_ids: list[int]
    queued_at: float


@dataclass(slots=True)
class TierFigures:
    writes: int = 0  # sessions made durable
    write_errors: int = 0
    loads: int = 0
    load_failures: int = 0
    load_ms: collections.deque = field(default_factory=lambda: collections.deque(maxlen=_LAG_WINDOW))
    lag_ms: collections.deque = field(default_factory=lambda: collections.deque(maxlen=_LAG_WINDOW))
    queued_writes: int = 0
    late_writes: int = 0  # made durable later than kv_write_behind_s after the save

    def as_dict(self) -> dict[str, Any]:
        # Not "disk_*": those are the store's own figures (files written, bytes...).
        return {"write_behind_done": self.writes, "write_behind_errors": self.write_errors,
                "write_behind_late": self.late_writes,
                "read_back_done": self.loads, "read_back_failures": self.load_failures,
                "read_back_ms_p50": _pct(self.load_ms, 0.5),
                "read_back_ms_p99": _pct(self.load_ms, 0.99),
                "write_behind_lag_ms_p50": _pct(self.lag_ms, 0.5),
                "write_behind_lag_ms_p99": _pct(self.lag_ms, 0.99),
                "write_behind_queued": self.queued_writes}


def _yield_to_decode() -> None:
    """Give this thread the lowest CPU priority (Linux: a thread is a task with its own nice
    value): the write-behind takes the cores decode leaves idle. Measured on 2 cores with
    decode saturating both (`make bench`'s busy row): nice 0 kept the lag under 1 s and cut
    decode to 0.58x, nice 10 0.91x, nice 19 0.97x with the lag growing to seconds (counted
    as late writes). Decode comes first; with idle cores (a GPU host) the lag is tens of ms."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):  # not Linux, or not allowed: run at normal priority
        log.info("kv_writer_priority_unchanged")


def _pct(values: collections.deque, q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 3)


class DiskTier:
    """Owned by the engine; ``before_step`` and ``submit_loads`` run on the engine thread."""

    def __init__(self, store: Any, kv: KVCacheManager, kv_tensor: torch.Tensor,
                 wake: Callable[[], None], on_load_done: Callable[[LoadPlan, bool], None],
                 write_behind_s: float = 1.0) -> None:
        self.store = store
        self._on_load_done = on_load_done  # the scheduler's: admit the load's waiters
        self.write_behind_s = write_behind_s
        self.kv = kv
        self.kv_tensor = kv_tensor  # [L, 2, num_blocks, block_size, H, D]
        # On CPU the threads copy blocks through numpy, never a torch op: a torch copy of
        # that size runs an OpenMP parallel region, and libgomp then keeps a second thread
        # pool for the writer, more threads than cores, which throttles every parallel op
        # of the decode step (measured: decode beside the writer 0.72-0.80x idle through
        # torch copies; an external writer process doing the same I/O, 0.98x).
        self._kv_bytes = (kv_tensor.view(torch.uint8).numpy()
                          if kv_tensor.device.type == "cpu" else None)
        self._wake = wake  # tells the engine thread an answer is waiting
        self.figures = TierFigures()
        self._lock = threading.Condition()
        self._writes: collections.OrderedDict[str, _WriteJob] = collections.OrderedDict()
        self._loads: collections.deque[tuple[LoadPlan, float]] = collections.deque()
        self._answers: collections.deque[Callable[[], None]] = collections.deque()
        self._writing = 0  # jobs taken by the writer and not answered yet
        self._loading = False  # the loader is reading a plan
        self._closing = False
        self._threads = [threading.Thread(target=self._write_loop, name="kv-writer", daemon=True),
                         threading.Thread(target=self._load_loop, name="kv-loader", daemon=True)]
        for thread in self._threads:
            thread.start()

    # -- engine thread
    def before_step(self) -> None:
        """Apply the threads' answers, then queue the sessions saved since the last step."""
        while True:
            with self._lock:
                if not self._answers:
                    break
                answer = self._answers.popleft()
            answer()
        for session in self.kv.take_writes():
            self._queue_write(session)

    def stats(self) -> dict[str, Any]:
        """The tier's figures for ``stats`` (another thread may read them)."""
        return {**self.figures.as_dict(), **{f"disk_{k}": v for k, v in self.store.stats().items()}}

    def has_answers(self) -> bool:
        with self._lock:
            return bool(self._answers)

    def busy(self) -> bool:
        """Loads in flight: the scheduler's waiters will be admitted when they end."""
        with self._lock:
            return bool(self._loads) or self._loading or bool(self._answers)

    def submit_loads(self, plans: list[LoadPlan]) -> None:
        if not plans:
            return
        now = time.perf_counter()
        with self._lock:
            self._loads.extend((plan, now) for plan in plans)
            self._lock.notify_all()

    def delete(self, session_id: str) -> None:
        """Forget a session's files (``kv_session.delete``), after any queued write of it."""
        with self._lock:
            job = self._writes.pop(session_id, None)
            self._writes[session_id] = _WriteJob(None, [], time.perf_counter())  # type: ignore[arg-type]
            self.figures.queued_writes = len(self._writes) + self._writing
            self._lock.notify_all()
        if job is not None:
            self._release(job)

    def _queue_write(self, session: KVSession) -> None:
        if not session.blocks:  # nothing to keep (a probe's empty session)
            return
        blocks = list(session.blocks)
        self.kv.pool.touch(blocks)  # the writer's references: these blocks stay as they are
        job = _WriteJob(session, [b.block_id for b in blocks], time.perf_counter())
        with self._lock:
            old = self._writes.pop(session.session_id, None)
            self._writes[session.session_id] = job
            self.figures.queued_writes = len(self._writes) + self._writing
            self._lock.notify_all()
        if old is not None:  # superseded before it was written
            self._release(old)

    def _release(self, job: _WriteJob) -> None:
        """Drop the references a write job held on its blocks (engine thread)."""
        self.kv.pool.free([self.kv.pool.blocks[i] for i in job.block_ids])

    def close(self, flush: bool) -> None:
        """Stop the threads; with ``flush``, after every queued write reached disk (a clean
        stop). The engine thread has stopped: answers are dropped, nothing is freed."""
        with self._lock:
            if not flush:
                self._writes.clear()
            self._closing = True
            self._lock.notify_all()
        for thread in self._threads:
            thread.join()

    def _block_copy(self, block_id: int) -> torch.Tensor:
        """One block's KV as a contiguous CPU tensor (writer thread)."""
        if self._kv_bytes is None:  # CUDA: a device-to-host copy, no OpenMP
            return self.kv_tensor[:, :, block_id].to("cpu", copy=True)
        raw = numpy.ascontiguousarray(self._kv_bytes[:, :, block_id])
        return torch.from_numpy(raw).view(self.kv_tensor.dtype)

    def _block_fill(self, block_id: int, data: torch.Tensor) -> None:
        """Write one block's KV into the pool (loader thread; the block is the plan's alone)."""
        if self._kv_bytes is None:
            self.kv_tensor[:, :, block_id].copy_(data)
            return
        self._kv_bytes[:, :, block_id] = data.contiguous().view(torch.uint8).numpy()

    # -- writer thread
    def _write_loop(self) -> None:
        _yield_to_decode()
        while True:
            with self._lock:
                while not self._writes and not self._closing:
                    self._lock.wait()
                if not self._writes:
                    return
                session_id, job = self._writes.popitem(last=False)
                self._writing += 1
                self.figures.queued_writes = len(self._writes) + self._writing
            ok, evicted = self._write(session_id, job)
            self._answer(lambda job=job, ok=ok, evicted=evicted: self._write_done(job, ok, evicted))

    def _write(self, session_id: str, job: _WriteJob) -> tuple[bool, tuple[str, ...]]:
        """Write one job; -> (done, the sessions the disk budget then removed)."""
        try:
            if job.session is None:
                self.store.delete_session(session_id)
                return True, ()
            session = job.session
            bs = self.kv.block_size
            for i, (block_id, file_hash) in enumerate(zip(job.block_ids, session.file_hashes)):
                if not self.store.has_block(file_hash):
                    data = self._block_copy(block_id)
                    self.store.write_block(file_hash, session.token_ids[i * bs:(i + 1) * bs], data)
            self.store.write_session(session.session_id, session.tenant, session.token_ids,
                                     session.file_hashes, session.last_used)
            return True, self.store.evict_to_budget().sessions
        except Exception:  # a full disk or a dead one: the session stays in the pool only
            log.exception("kv_tier_write_failed", session_id=session_id)
            return False, ()

    def _write_done(self, job: _WriteJob, ok: bool, evicted: tuple[str, ...]) -> None:
        with self._lock:
            self._writing -= 1
            self.figures.queued_writes = len(self._writes) + self._writing
        self._forget_evicted(evicted)
        if job.session is None:
            return
        self._release(job)
        if not ok:
            self.figures.write_errors += 1
            return
        self.figures.writes += 1
        lag_s = time.perf_counter() - job.queued_at
        self.figures.lag_ms.append(lag_s * 1000)
        if lag_s > self.write_behind_s:
            # A SIGKILL in that window would have lost it: the disk is slower than the saves.
            self.figures.late_writes += 1
            log.warning("kv_tier_write_late", session_id=job.session.session_id,
                        lag_s=round(lag_s, 3), bound_s=self.write_behind_s)
        if self.kv.sessions.get(job.session.session_id) is job.session and job.session.session_id not in evicted:
            job.session.durable = True

    def _forget_evicted(self, evicted: tuple[str, ...]) -> None:
        """Sessions the disk budget removed are gone from the disk index, and a resident
        one is no longer durable."""
        for session_id in evicted:
            self.kv.disk.remove(session_id)
            resident = self.kv.sessions.get(session_id)
            if resident is not None:
                resident.durable = False

    # -- loader thread
    def _load_loop(self) -> None:
        while True:
            with self._lock:
                while not self._loads and not self._closing:
                    self._lock.wait()
                if self._closing:
                    return
                plan, queued_at = self._loads.popleft()
                self._loading = True
            ok = self._load(plan)
            ms = (time.perf_counter() - queued_at) * 1000
            with self._lock:  # one step: busy() never sees neither the load nor its answer
                self._loading = False
                self._answers.append(lambda plan=plan, ok=ok, ms=ms: self._load_done(plan, ok, ms))
            self._wake()

    def _load(self, plan: LoadPlan) -> bool:
        session = plan.session
        bs = self.kv.block_size
        try:
            for i, (block, file_hash) in enumerate(zip(plan.blocks, session.file_hashes)):
                data = self.store.read_block(file_hash, session.token_ids[i * bs:(i + 1) * bs])
                self._block_fill(block.block_id, data)
            return True
        except Exception as exc:  # the store quarantined the bad file and said why
            log.warning("kv_tier_load_failed", session_id=session.session_id, error=str(exc))
            return False

    def _load_done(self, plan: LoadPlan, ok: bool, ms: float) -> None:
        if ok:
            self.figures.loads += 1
            self.figures.load_ms.append(ms)
        else:
            self.figures.load_failures += 1
            # Its KV is no longer all there: drop the manifest too (the bad file is kept,
            # quarantined; the good blocks go with the next eviction unless shared).
            self.delete(plan.session.session_id)
        self.kv.finish_load(plan, ok)
        self._on_load_done(plan, ok)

    def _answer(self, answer: Callable[[], None]) -> None:
        with self._lock:
            self._answers.append(answer)
        self._wake()
