"""The KV store's in-memory index (``station.tier.store.store``): which block files and
session manifests exist, how many manifests name each block, the bytes they take, and
the counters ``stats()`` reports. No I/O here.

Every method is atomic under one lock held for dict work only, never across I/O, so the
engine thread's queries never wait on the disk. A check-then-act sequence spanning
several calls is made safe by the store's own mutation lock, which every writer holds.
"""

from __future__ import annotations

import threading
from collections import Counter
from pathlib import Path
from typing import Iterable, Sequence

from station.core.block_pool import BlockHash
from station.tier.format import SessionRecord

_COUNTERS = ("writes", "reads", "bytes_written", "bytes_read", "evicted_sessions",
             "evicted_blocks", "evicted_over_share", "incomplete_sessions", "tmp_removed",
             "disk_full", "disk_full_evicted", "lost", "lost_sessions", "quarantine_deleted")


class StoreIndex:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._blocks: dict[BlockHash, int] = {}  # hash -> file size
        self._sessions: dict[str, SessionRecord] = {}
        self._session_bytes: dict[str, int] = {}
        self._refs: Counter[BlockHash] = Counter()  # hash -> manifest entries naming it
        # tenant -> its manifests' entries naming each block, and its manifests' bytes: a
        # tenant's share of the disk is its manifests and the distinct blocks they name.
        self._tenant_refs: dict[str, Counter[BlockHash]] = {}
        self._tenant_manifest_bytes: Counter[str] = Counter()
        # Written (or found present) since the writer's last session: no manifest names
        # them yet, but one is about to, so eviction must spare them.
        self._pending: set[BlockHash] = set()
        self._dirty: set[Path] = set()  # directories whose names changed since their fsync
        self._bytes = 0
        self._counts: Counter[str] = Counter()
        self._quarantined: Counter[str] = Counter()

    # -- queries
    def has_block(self, block_hash: BlockHash) -> bool:
        with self._lock:
            return block_hash in self._blocks

    def count_present(self, block_hashes: Sequence[BlockHash]) -> int:
        with self._lock:
            n = 0
            while n < len(block_hashes) and block_hashes[n] in self._blocks:
                n += 1
            return n

    def count_missing(self, block_hashes: Iterable[BlockHash]) -> int:
        with self._lock:
            return sum(h not in self._blocks for h in block_hashes)

    def has_session(self, session_id: str) -> bool:
        with self._lock:
            return session_id in self._sessions

    def session(self, session_id: str) -> SessionRecord | None:
        with self._lock:
            return self._sessions.get(session_id)

    def sessions_lru(self) -> list[SessionRecord]:
        with self._lock:
            return sorted(self._sessions.values(), key=lambda r: r.last_used)

    def orphans(self) -> list[BlockHash]:
        """Blocks no manifest names and no writer is about to name."""
        with self._lock:
            return [h for h in self._blocks if self._refs[h] <= 0 and h not in self._pending]

    def removable(self, block_hash: BlockHash) -> bool:
        with self._lock:
            return (block_hash in self._blocks and self._refs[block_hash] <= 0
                    and block_hash not in self._pending)

    def tenant_bytes(self) -> dict[str, int]:
        """Each tenant's bytes on disk: its manifests and the distinct blocks they name."""
        with self._lock:
            return {t: self._tenant_manifest_bytes[t] + sum(self._blocks.get(h, 0) for h in refs)
                    for t, refs in self._tenant_refs.items()}

    def tenant_share_bytes(self, tenant: str) -> int:
        with self._lock:
            refs = self._tenant_refs.get(tenant, ())
            return self._tenant_manifest_bytes[tenant] + sum(self._blocks.get(h, 0) for h in refs)

    def session_ids(self) -> list[str]:
        with self._lock:
            return list(self._sessions)

    def block_hashes(self) -> list[BlockHash]:
        with self._lock:
            return list(self._blocks)

    @property
    def bytes(self) -> int:
        with self._lock:
            return self._bytes

    # -- blocks
    def add_block(self, block_hash: BlockHash, size: int) -> None:
        with self._lock:
            old = self._blocks.get(block_hash)
            self._bytes += size - (old or 0)
            self._blocks[block_hash] = size

    def forget_block(self, block_hash: BlockHash) -> None:
        with self._lock:
            size = self._blocks.pop(block_hash, None)
            if size is not None:
                self._bytes -= size
            self._pending.discard(block_hash)

    def pend(self, block_hash: BlockHash) -> bool:
        """Mark a block pending; returns whether its file is already there."""
        with self._lock:
            self._pending.add(block_hash)
            return block_hash in self._blocks

    def unpend(self, block_hash: BlockHash) -> None:
        with self._lock:
            self._pending.discard(block_hash)

    def clear_pending(self) -> None:
        with self._lock:
            self._pending.clear()

    # -- sessions
    def put_session(self, record: SessionRecord, size: int) -> None:
        """Add or replace a session. Blocks only a replaced version named become orphans."""
        with self._lock:
            if record.session_id in self._sessions:
                self._remove_session(record.session_id)
            self._sessions[record.session_id] = record
            self._session_bytes[record.session_id] = size
            self._bytes += size
            self._refs.update(record.block_hashes)
            self._tenant_refs.setdefault(record.tenant, Counter()).update(record.block_hashes)
            self._tenant_manifest_bytes[record.tenant] += size

    def remove_session(self, session_id: str) -> list[BlockHash]:
        """Forget a session; returns the blocks no manifest names any more."""
        with self._lock:
            return self._remove_session(session_id)

    def _remove_session(self, session_id: str) -> list[BlockHash]:
        record = self._sessions.pop(session_id)
        size = self._session_bytes.pop(session_id)
        self._bytes -= size
        self._refs.subtract(record.block_hashes)
        refs = self._tenant_refs[record.tenant]
        refs.subtract(record.block_hashes)
        for h in record.block_hashes:
            if refs.get(h, 1) <= 0:
                del refs[h]
        self._tenant_manifest_bytes[record.tenant] -= size
        if not refs and self._tenant_manifest_bytes[record.tenant] <= 0:
            del self._tenant_refs[record.tenant], self._tenant_manifest_bytes[record.tenant]
        freed = []
        for h in dict.fromkeys(record.block_hashes):
            if self._refs[h] <= 0:
                del self._refs[h]
                freed.append(h)
        return freed

    # -- bookkeeping
    def count(self, **increments: int) -> None:
        with self._lock:
            self._counts.update(increments)

    def count_quarantined(self, reason: str) -> None:
        with self._lock:
            self._quarantined[reason] += 1

    def mark_dirty(self, *directories: Path) -> None:
        with self._lock:
            self._dirty.update(directories)

    def take_dirty(self) -> set[Path]:
        with self._lock:
            dirty, self._dirty = self._dirty, set()
            return dirty

    def stats(self) -> dict[str, object]:
        with self._lock:
            return {"bytes": self._bytes, "blocks": len(self._blocks),
                    "sessions": len(self._sessions), "pending_blocks": len(self._pending),
                    "quarantined": dict(self._quarantined),
                    "quarantined_total": sum(self._quarantined.values()),
                    **{k: self._counts[k] for k in _COUNTERS}}
