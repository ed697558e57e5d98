"""What the I/O process found on disk, the engine side: a fleet's shared tier's rescan
(``discovered``), and sessions whose files were deleted under it (``lost``).

Both are handed the parts of the tier they change (the KV cache manager, the tier's figures)
and ``writing``, the tier's answer to "is a write of this session queued or in flight"."""

from __future__ import annotations

from typing import Any, Callable

from station.core.kv_manager import KVCacheManager
from station.core.sessions import KVSession
from station.tier.figures import TierFigures
from station.tier.format import SessionRecord
from station.tier.start import disk_session

Writing = Callable[[str], bool]  # session id -> a write of it is queued or in flight


def apply_discovered(kv: KVCacheManager, figures: TierFigures, writing: Writing,
                     answer: dict[str, Any]) -> None:
    """A shared tier's rescan: sessions the other replicas saved (a conversation whose
    replica died, or moved) join the disk index; removed ones leave it."""
    for session_id in answer.get("removed", []):
        on_disk = kv.disk.get(session_id)
        if on_disk is not None and not on_disk.loading:
            kv.disk.remove(session_id)
            figures.shared_removed += 1
        resident = kv.sessions.get(session_id)
        if resident is not None:
            resident.durable = False
    for item in answer.get("added", []):
        record = SessionRecord.from_wire(item)
        sid = record.session_id
        on_disk = disk_session(kv, record)
        known = kv.disk.get(sid)
        if on_disk is None or (known is not None and known.loading):
            continue
        resident = kv.sessions.get(sid)
        if resident is not None:
            if tuple(resident.file_hashes) == on_disk.file_hashes:
                continue  # the same KV: this replica's copy is current
            if writing(sid) or any(pending is resident for pending in kv.to_write):
                continue  # saved here since (queued, in writing, or in to_write): ours wins
        kv.adopt_disk_session(on_disk)  # a resident copy: another replica saved a later turn
        if record.expires_at is not None and record.ttl_s is not None:  # pinned over there
            kv.pins.add(sid, record.tenant, record.ttl_s, len(record.block_hashes),
                        expires_at=record.expires_at)
        figures.shared_added += 1


def apply_lost(kv: KVCacheManager, writing: Writing, lost: list[str]) -> list[KVSession]:
    """The tier's directory was deleted and recreated: its sessions leave the disk index,
    and the ones the pool still holds are no longer durable. Returns those, for the tier to
    write again (durable once more when they land)."""
    rewrite = []
    for session_id in lost:
        on_disk = kv.disk.get(session_id)
        if on_disk is not None and not on_disk.loading:
            kv.disk.remove(session_id)
        resident = kv.sessions.get(session_id)
        if resident is not None and not writing(session_id):
            resident.durable = False
            rewrite.append(resident)
    return rewrite
