"""The disk tier's jobs as the engine side tracks them (``station.tier.disk_tier.DiskTier``): a write,
delete or touch of a session, handed over in parts; a load of a session's blocks."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable

from station.core.kv_results import LoadPlan
from station.core.sessions import KVSession

# The disk counts as stalled when the write part in flight has taken this many bounds (and
# at least STALL_MIN_S) while queued writes hold half the pool: only then is a save given up.
STALL_BOUNDS = 30
STALL_MIN_S = 30.0
WRITES_IN_FLIGHT = 16  # write jobs handed to the process at once (a CPU pool it maps)
WRITER_WAIT_S = 0.05  # work that waits for blocks held by queued writes looks again this often
TOUCH_EVERY_S = 10.0  # a session's later uses reach its manifest at most this often


@dataclass(slots=True)
class WriteJob:
    op: str  # write | delete | touch
    session_id: str
    queued_at: float
    session: KVSession | None = None  # a write's
    block_ids: list[int] = field(default_factory=list)  # a write's (referenced until done)
    last_used: float = 0.0  # a touch's
    sent: int = 0  # blocks handed over so far
    slots: list[int] = field(default_factory=list)  # the part in flight
    hashes: list[bytes] = field(default_factory=list)  # its blocks' file hashes
    sent_at: float = 0.0  # when its part in flight was handed over
    cancelled: bool = False  # deleted while in flight: no further part


@dataclass(slots=True)
class LoadJob:
    plan: LoadPlan
    queued_at: float
    sent: int = 0
    slots: list[int] = field(default_factory=list)  # the part in flight: a slot per block
    block_ids: list[int] = field(default_factory=list)
    hashes: list[bytes] = field(default_factory=list)
    missing: list[int] = field(default_factory=list)  # its blocks the I/O process reads
    from_disk: bool = False  # a part read a file (else the host tier held every block)


def may_send(inflight: list[WriteJob], job: WriteJob, pool_blocks: int) -> bool:
    """Whether ``job`` may join the jobs in flight. The blocks a stalled process holds cannot
    be taken back (it may read them yet, so a stalled disk only ever gives up queued jobs):
    beyond the first job, what is in flight holds at most a quarter of the pool."""
    held = sum(len(j.block_ids) for j in inflight)
    return not held or held + len(job.block_ids) <= pool_blocks // 4


class Touches:
    """Uses of durable sessions on their way to the disk's LRU (a touch rewrites the
    session's manifest). A session's first use is due at once; its later ones wait until
    ``every_s`` after the last handed over, and go as one touch with the newest use. A
    conversation's every turn uses its session: a touch per turn woke the I/O process beside
    the next turn's hit (about 1.2 ms of a 2,000-token hit's 7 ms here), where the LRU needs
    seconds, not milliseconds. A clean stop hands over every pending use (``due(flush=True)``);
    a killed station loses at most ``every_s`` of them."""

    def __init__(self, every_s: float = TOUCH_EVERY_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.every_s, self.clock = every_s, clock
        self._pending: dict[str, float] = {}  # session id -> its newest use not handed over
        self._sent_at: dict[str, float] = {}  # session id -> when its last touch went
        self._prune_at = 1024

    def add(self, uses: dict[str, float]) -> None:
        self._pending.update(uses)

    def drop(self, session_id: str) -> None:
        """A write of the session is queued: it carries the session's newest use."""
        self._pending.pop(session_id, None)

    def due(self, flush: bool = False) -> list[tuple[str, float]]:
        """The (session id, last use) to hand over now; they leave the pending ones."""
        now, out = self.clock(), []
        for session_id, last_used in list(self._pending.items()):
            if flush or now - self._sent_at.get(session_id, -math.inf) >= self.every_s:
                out.append((session_id, last_used))
                del self._pending[session_id]
                self._sent_at[session_id] = now
        if len(self._sent_at) > self._prune_at:  # forget what no longer waits (amortized)
            self._sent_at = {k: t for k, t in self._sent_at.items() if now - t < self.every_s}
            self._prune_at = max(1024, 2 * len(self._sent_at))
        return out

    def wait_s(self) -> float | None:
        """Seconds until the next pending use is due (0: now), None with none pending."""
        if not self._pending:
            return None
        now = self.clock()
        return max(0.0, min(self._sent_at.get(k, -math.inf) for k in self._pending) + self.every_s - now)
