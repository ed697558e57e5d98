"""The KV cache manager's side of the disk tier: what it hands the write-behind, what it
keeps of an evicted session, and how a disk session comes back (pure Python).

``KVCacheManager`` (``station.core.kv_manager``) takes these methods as its own (a base
class, for the size of one module, not for a second concept of state): the attributes
named below are the manager's. ``hold_blocks`` / ``release_blocks`` keep blocks as they are
for a disk write; ``take_writes`` / ``take_touches`` are the saves and uses since the tier
last looked; an evicted durable session becomes a ``DiskSession`` (``_offload``); ``begin_load``
/ ``finish_load`` bring one back (``station.tier.disk_tier`` reads its files between the two).
A TTL pin (``station.core.pins``) keeps its place in the pin table across these moves: the
table is keyed by session id, whichever tier holds it; a read-back refreshes it.

Thread-safety: none. Every call happens on the engine thread.
"""

from __future__ import annotations

from typing import Sequence as Seq

from station.core.block_pool import BlockPool, ExtraKeys, KVBlock, tail_key
from station.core.disk_sessions import DiskSession, DiskSessions
from station.core.kv_results import LoadPlan, SessionOutcome
from station.core.pins import PinTable
from station.core.sessions import KVSession, SessionRegistry


class DiskTierSide:
    pool: BlockPool
    sessions: SessionRegistry
    pins: PinTable
    disk: DiskSessions
    disk_tier: bool
    block_size: int
    to_write: list[KVSession]
    to_touch: dict[str, float]
    num_offloaded: int
    num_lost: int
    num_disk_loads: int
    num_quarantined_loads: int
    num_unreadable_loads: int

    def extra_keys(self, tenant: str) -> ExtraKeys:
        raise NotImplementedError

    def hold_blocks(self, blocks: Seq[KVBlock]) -> list[int]:
        """Take a reference on each of ``blocks`` (a write job reads them: they are neither
        freed nor reused until ``release_blocks``). -> their block ids."""
        self.pool.touch(blocks)
        return [block.block_id for block in blocks]

    def release_blocks(self, block_ids: Seq[int]) -> None:
        """Drop the references ``hold_blocks`` took."""
        self.pool.free([self.pool.blocks[i] for i in block_ids])

    def adopt_disk_session(self, on_disk: DiskSession) -> None:
        """Index a session another replica wrote to the shared disk tier; the pool's copy of
        that id (an older turn of it), if any, is deleted and its blocks unpinned (its TTL pin
        too: the caller pins it again when the other replica's manifest says so)."""
        self.sessions.delete(on_disk.session_id)
        self.pins.drop(on_disk.session_id)
        self.disk.add(on_disk)

    def enable_disk_tier(self, sessions: Seq[DiskSession] = ()) -> None:
        """Keep evicted durable sessions on disk from now on; ``sessions``: the tier's
        index as the station's start found it."""
        self.disk_tier = True
        self.disk.add_all(sessions)

    def take_writes(self) -> list[KVSession]:
        """Sessions saved since the last call that are still resident (to write behind)."""
        writes = [s for s in self.to_write if self.sessions.get(s.session_id) is s]
        self.to_write = []
        return writes

    def take_touches(self) -> dict[str, float]:
        """Durable sessions used since the last call (their files' last use to update)."""
        touches, self.to_touch = self.to_touch, {}
        return touches

    def landed(self, session: KVSession) -> None:
        """The write-behind of ``session`` reached disk after the pool had evicted it (and
        counted it lost): it is a disk session now, unless its id was saved again since."""
        if self.sessions.get(session.session_id) is not None or session.session_id in self.disk:
            return
        self._offload(session)
        self.num_lost -= 1

    def _take_evictions(self) -> None:
        for session in self.sessions.evicted:
            if self.disk_tier and session.durable:
                self._offload(session)
            else:
                self.pins.drop(session.session_id)
                self.num_lost += 1
        self.sessions.evicted = []

    def _offload(self, session: KVSession) -> None:
        """``session``, gone from the pool, is a disk session (its files are all written)."""
        self.disk.add(DiskSession(session.session_id, session.tenant, session.token_ids,
                                  session.block_hashes, session.file_hashes, session.last_used))
        self.num_offloaded += 1

    def begin_load(self, on_disk: DiskSession) -> LoadPlan | None:
        """Fresh blocks for a disk session's KV (expiring pool sessions to make room, the
        durable ones to disk); None when the pool cannot hold it now."""
        n = len(on_disk.block_hashes)
        if not self.pool.can_allocate(n):
            self.sessions.reclaim(n, None, on_disk.tenant)
            self._take_evictions()
        if not self.pool.can_allocate(n):
            return None
        on_disk.loading = True
        return LoadPlan(on_disk, tuple(self.pool.allocate(n)))

    def finish_load(self, plan: LoadPlan, error: SessionOutcome | None) -> KVSession | None:
        """The loader filled ``plan.blocks`` (``error`` None) or could not (``QUARANTINED``: a
        file failed a check; ``UNREADABLE``): cache and pin the blocks as the session again,
        or forget the session. -> the resident session."""
        on_disk = plan.session
        on_disk.loading = False
        current = self.disk.get(on_disk.session_id) is on_disk
        if error is not None or not current:  # failed, or deleted / saved again meanwhile
            self.pool.free(plan.blocks)
            if error is not None:
                self.disk.remove(on_disk.session_id)
                if error is SessionOutcome.QUARANTINED:
                    self.num_quarantined_loads += 1
                else:
                    self.num_unreadable_loads += 1
            return None
        bs, keys, hashes = self.block_size, self.extra_keys(on_disk.tenant), on_disk.block_hashes
        for i, (block, block_hash) in enumerate(zip(plan.blocks, hashes)):
            self.pool.cache_full_block(block, block_hash, on_disk.token_ids[i * bs:(i + 1) * bs],
                                       plan.blocks[i - 1] if i else None,
                                       tail_key(hashes[i - 1] if i else None, keys))
        self.disk.remove(on_disk.session_id)  # after: KV events say GPU, then drop DISK
        session = self.sessions.save(on_disk.session_id, on_disk.tenant, on_disk.token_ids,
                                     plan.blocks, on_disk.block_hashes)
        session.durable = True
        session.file_hashes = on_disk.file_hashes
        self.to_touch[session.session_id] = session.last_used
        self.pins.refresh(session.session_id)  # a read-back is a hit
        self.pool.free(plan.blocks)  # the loader's references: the session's pins keep them
        self.num_disk_loads += 1
        self._take_evictions()
        return session
