"""KV sessions: liquid memory's storage (pure Python: no torch here).

A session pins the blocks that hold the KV of a token prefix under a name, so the prefix
outlives the request that computed it. Saving copies no tensor: it takes a pin on the
sequence's own full blocks (``BlockPool.pin``); a pinned block is never evicted, whatever
its ``ref_cnt``. A session only ever holds FULL blocks, so no sequence ever writes into a
pinned block again: loading one needs no copy-on-write.

The registry is bounded by a count (``settings.kv_session_budget``) and expires LRU:
saving past the budget drops the least recently used session, and when the pool runs
out of blocks the engine calls ``reclaim`` before it preempts running work (a running
request is worth more than a parked prefix).

Thread-safety: none. Every call happens on the engine thread.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Sequence

from station.block_pool import BlockPool, KVBlock


@dataclass(slots=True, eq=False)
class KVSession:
    session_id: str
    tenant: str
    token_ids: tuple[int, ...]  # the tokens whose KV the blocks hold (a multiple of block_size)
    blocks: list[KVBlock]
    last_used: float  # wall clock seconds, for listings

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


class SessionRegistry:
    def __init__(self, pool: BlockPool, budget: int, clock: Callable[[], float] = time.time) -> None:
        assert budget > 0
        self.pool = pool
        self.budget = budget
        self.clock = clock
        self._sessions: OrderedDict[str, KVSession] = OrderedDict()  # LRU first
        self.num_expired = 0

    def __len__(self) -> int:
        return len(self._sessions)

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._sessions

    def get(self, session_id: str) -> KVSession | None:
        return self._sessions.get(session_id)

    def sessions(self) -> list[KVSession]:
        """Every session, least recently used first."""
        return list(self._sessions.values())

    @property
    def pinned_blocks(self) -> int:
        """Distinct blocks pinned by sessions (sessions of one conversation share blocks).

        Only sessions pin, so this is the pool's counter: a plain int that ``stats`` may
        read from another thread without iterating anything the engine mutates.
        """
        return self.pool.num_pinned_blocks

    def save(self, session_id: str, tenant: str, token_ids: Sequence[int],
             blocks: Sequence[KVBlock]) -> KVSession:
        """Pin ``blocks`` (the KV of ``token_ids``) under ``session_id``, replacing any old one."""
        assert len(blocks) * self.pool.block_size == len(token_ids), "sessions hold full blocks"
        # Pin the new blocks before unpinning the old: blocks both share never touch the
        # free queue, so they cannot be evicted in between.
        self.pool.pin(blocks)
        old = self._sessions.pop(session_id, None)
        if old is not None:
            self.pool.unpin(old.blocks)
        session = KVSession(session_id, tenant, tuple(token_ids), list(blocks), self.clock())
        self._sessions[session_id] = session
        while len(self._sessions) > self.budget:
            self._expire(next(iter(self._sessions)))
        return session

    def use(self, session: KVSession) -> None:
        """Mark a session used (a load): it becomes the most recently used."""
        session.last_used = self.clock()
        self._sessions.move_to_end(session.session_id)

    def delete(self, session_id: str) -> bool:
        session = self._sessions.pop(session_id, None)
        if session is None:
            return False
        self.pool.unpin(session.blocks)
        return True

    def clear(self) -> None:
        for session_id in list(self._sessions):
            self.delete(session_id)

    def reclaim(self, num_blocks: int, keep: str | None = None) -> int:
        """Expire LRU sessions until ``num_blocks`` can be allocated; returns how many expired.

        Expires nothing when even dropping every session (but ``keep``) would not make
        room: then the blocks are held by running work and expiring would only lose data.
        """
        pool = self.pool
        if pool.can_allocate(num_blocks):
            return 0
        kept_ids = {b.block_id for b in self._sessions[keep].blocks} if keep in self._sessions else set()
        # Blocks that only sessions hold (no sequence references them) come back when unpinned.
        releasable = {b.block_id for s in self._sessions.values() if s.session_id != keep
                      for b in s.blocks if b.ref_cnt == 0 and b.block_id not in kept_ids}
        if pool.num_free_blocks + len(releasable) < num_blocks:
            return 0
        expired = 0
        for session_id in list(self._sessions):
            if pool.can_allocate(num_blocks):
                break
            if session_id == keep:
                continue
            self._expire(session_id)
            expired += 1
        return expired

    def _expire(self, session_id: str) -> None:
        self.delete(session_id)
        self.num_expired += 1
