"""A shared tier's rescan (``station.tier.shared.apply_discovered``) against this replica's own saves.

The rescan brings in manifests other replicas wrote. A session this replica holds under
the same id is dropped for the disk copy when that copy is a later turn; one this replica
saved in the step just run (still in ``kv.to_write``, queued for writing only at the next
step: answers are applied first) is newer than any manifest found, and must stay.
"""

from __future__ import annotations

from station.core.block_pool import block_hashes_for
from station.core.kv_manager import KVCacheManager
from station.tier.format import SessionRecord
from station.tier.shared import apply_discovered
from station.tier.figures import TierFigures

BS = 4
SID = "alice.conv.0"


def _replica() -> tuple[KVCacheManager, TierFigures]:
    kv = KVCacheManager(16, BS, 8)
    kv.enable_disk_tier()
    return kv, TierFigures()


def _no_write(session_id: str) -> bool:
    return False  # no write queued or being written here


def _their_manifest(kv: KVCacheManager, tokens: list[int]) -> list:
    hashes = block_hashes_for(tokens, BS, kv.extra_keys("alice"))
    return SessionRecord(SID, "alice", tuple(tokens), tuple(hashes), 1.0, 0.0).wire()


def test_a_session_saved_here_in_the_last_step_outlives_a_rescan():
    kv, figures = _replica()
    ours = kv.pin(SID, "alice", list(range(100, 112)), kv.pool.allocate(3))
    assert kv.to_write == [ours]  # saved, not yet queued for writing
    apply_discovered(kv, figures, _no_write, {"added": [_their_manifest(kv, list(range(200, 208)))]})
    assert kv.sessions.get(SID) is ours and kv.disk.get(SID) is None
    assert kv.take_writes() == [ours]  # and it is still written behind
    assert figures.shared_added == 0


def test_a_written_session_gives_way_to_another_replicas_later_turn():
    kv, figures = _replica()
    kv.pin(SID, "alice", list(range(100, 112)), kv.pool.allocate(3))
    kv.take_writes()  # queued at the next step and written since (no job left here)
    apply_discovered(kv, figures, _no_write, {"added": [_their_manifest(kv, list(range(100, 116)))]})
    assert kv.sessions.get(SID) is None  # the stale pool copy is dropped ...
    assert kv.disk.get(SID).num_tokens == 16  # ... for the disk one
    assert figures.shared_added == 1
