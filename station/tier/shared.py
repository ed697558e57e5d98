"""What the I/O process found on disk, the engine side: a fleet's shared tier's rescan
(``discovered``), and sessions whose files were deleted under it (``lost``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from station.tier.format import SessionRecord
from station.tier.start import disk_session

if TYPE_CHECKING:
    from station.tier.disk_tier import DiskTier


def apply_discovered(tier: DiskTier, answer: dict[str, Any]) -> None:
    """A shared tier's rescan: sessions the other replicas saved (a conversation whose
    replica died, or moved) join the disk index; removed ones leave it."""
    for session_id in answer.get("removed", []):
        on_disk = tier.kv.disk.get(session_id)
        if on_disk is not None and not on_disk.loading:
            tier.kv.disk.remove(session_id)
            tier.figures.shared_removed += 1
        resident = tier.kv.sessions.get(session_id)
        if resident is not None:
            resident.durable = False
    for item in answer.get("added", []):
        record = SessionRecord.from_wire(item)
        sid = record.session_id
        on_disk = disk_session(tier.kv, record)
        known = tier.kv.disk.get(sid)
        if on_disk is None or (known is not None and known.loading):
            continue
        resident = tier.kv.sessions.get(sid)
        if resident is not None:
            if tuple(resident.file_hashes) == on_disk.file_hashes:
                continue  # the same KV: this replica's copy is current
            if tier.writing(sid) or any(pending is resident for pending in tier.kv.to_write):
                continue  # saved here since (queued, in writing, or in to_write): ours wins
            tier.kv.sessions.delete(sid)  # another replica saved a later turn of it
        tier.kv.disk.add(on_disk)
        tier.figures.shared_added += 1


def apply_lost(tier: DiskTier, lost: list[str]) -> None:
    """The tier's directory was deleted and recreated: its sessions leave the disk index,
    and the ones the pool still holds are written again (durable once more when they land)."""
    for session_id in lost:
        on_disk = tier.kv.disk.get(session_id)
        if on_disk is not None and not on_disk.loading:
            tier.kv.disk.remove(session_id)
        resident = tier.kv.sessions.get(session_id)
        if resident is not None and not tier.writing(session_id):
            resident.durable = False
            tier._queue_write(resident)
