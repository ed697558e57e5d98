"""The disk tier's jobs as the engine side tracks them (``station.tier.disk_tier.DiskTier``): a write,
delete or touch of a session, handed over in parts; a load of a session's blocks."""

from __future__ import annotations

from dataclasses import dataclass, field

from station.core.kv_results import LoadPlan
from station.core.sessions import KVSession

# The disk counts as stalled when the write part in flight has taken this many bounds (and
# at least STALL_MIN_S) while queued writes hold half the pool: only then is a save given up.
STALL_BOUNDS = 30
STALL_MIN_S = 30.0
WRITES_IN_FLIGHT = 16  # write jobs handed to the process at once (a CPU pool it maps)
WRITER_WAIT_S = 0.05  # work that waits for blocks held by queued writes looks again this often


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
