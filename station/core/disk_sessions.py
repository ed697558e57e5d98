"""KV sessions that live only in the disk tier (pure Python: no torch here).

A resident session (``station.core.sessions``) pins its blocks in the pool. When the pool
or the session budget needs room, a session whose KV the write-behind has made durable is
not lost: the KV cache manager moves its record here, with no block, and the station can
load it back when a prompt asks for it (explicitly, or by ``match_session``). A session
that was not durable yet is lost as before (at most the write-behind delay's worth).

The records keep what matching and loading need: the tokens, the chained block hashes of
this run (for ``deepest_match``, like the resident registry) and the names of the block
files on disk (``file_hashes``: the same hashes unless the tenant salt changed since they
were written). ``loading`` marks a record whose blocks are being read back, so a second
request for it waits for that load instead of starting another.

Thread-safety: none. Every call happens on the engine thread.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

from station.core.block_pool import BlockHash
from station.core.hash_index import HashIndex


@dataclass(slots=True, eq=False)
class DiskSession:
    session_id: str
    tenant: str
    token_ids: tuple[int, ...]  # full blocks only
    block_hashes: tuple[BlockHash, ...]  # this run's chained hashes (matching, the cache)
    file_hashes: tuple[BlockHash, ...]  # the names of its block files
    last_used: float
    loading: bool = False
    read_from: str = "disk"  # where its last read-back found the KV: "host" (RAM) or "disk"
    # With KV events on: its blocks' external hashes (what the events name them by), kept
    # by the listener so a session's removal hashes nothing.
    ext_hashes: tuple[int, ...] | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


class DiskSessions:
    """The disk tier's session index: by id, and by block hash for matching."""

    def __init__(self) -> None:
        self._sessions: dict[str, DiskSession] = {}
        self._by_hash: HashIndex[DiskSession] = HashIndex()
        # KV events (``station.serving.kv_events.Listener``): told of every session that
        # joins or leaves, to publish their blocks as the DISK medium. None: no events.
        self.events = None

    def __len__(self) -> int:
        return len(self._sessions)

    def __contains__(self, session_id: object) -> bool:
        return session_id in self._sessions

    def get(self, session_id: str) -> DiskSession | None:
        return self._sessions.get(session_id)

    def sessions(self) -> list[DiskSession]:
        return list(self._sessions.values())

    def add(self, session: DiskSession) -> None:
        old = self._sessions.pop(session.session_id, None)
        if old is not None:
            self._by_hash.remove(old)
        self._sessions[session.session_id] = session
        self._by_hash.add(session)
        if self.events is not None:  # the new copy first: blocks both name stay published
            self.events.disk_added(session)
            if old is not None:
                self.events.disk_removed(old)

    def add_all(self, sessions: Iterable[DiskSession]) -> None:
        for session in sessions:
            self.add(session)

    def remove(self, session_id: str) -> DiskSession | None:
        session = self._sessions.pop(session_id, None)
        if session is None:
            return None
        self._by_hash.remove(session)
        if self.events is not None:
            self.events.disk_removed(session)
        return session

    def deepest_match(self, tenant: str, block_hashes: Sequence[BlockHash],
                      max_blocks: int) -> tuple[DiskSession | None, int]:
        """``HashIndex.deepest_match`` over the disk tier's sessions."""
        return self._by_hash.deepest_match(tenant, block_hashes, max_blocks)
