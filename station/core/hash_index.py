"""Sessions by the chained hash of each of their blocks: how a prompt finds the session
that shares its longest prefix (pure Python).

A block hash chains every block before it, the model and the tenant, so one hash names a
whole shared prefix: the deepest of a prompt's block hashes that a session of the tenant
holds is the longest prefix any of them shares with it. Both tiers keep one of these: the
pool's ``SessionRegistry`` and the disk tier's ``DiskSessions``.
"""

from __future__ import annotations

import sys
from collections.abc import KeysView
from typing import Generic, Protocol, Sequence, TypeVar

from station.core.block_pool import BlockHash


class IndexedSession(Protocol):
    """What the index reads of a session (the pool's ``KVSession``, the tier's
    ``DiskSession``)."""

    @property
    def session_id(self) -> str: ...
    @property
    def tenant(self) -> str: ...
    @property
    def last_used(self) -> float: ...
    @property
    def block_hashes(self) -> Sequence[BlockHash]: ...


S = TypeVar("S", bound=IndexedSession)


class HashIndex(Generic[S]):
    """Block hash -> {session id: session}."""

    def __init__(self) -> None:
        self._by_hash: dict[BlockHash, dict[str, S]] = {}

    def __len__(self) -> int:
        return len(self._by_hash)

    def keys(self) -> KeysView[BlockHash]:
        return self._by_hash.keys()

    def sizeof(self) -> int:
        """Bytes of the index's own dicts (the hashes and the sessions are shared)."""
        return sys.getsizeof(self._by_hash) + sum(map(sys.getsizeof, self._by_hash.values()))

    def add(self, session: S) -> None:
        for block_hash in session.block_hashes:
            self._by_hash.setdefault(block_hash, {})[session.session_id] = session

    def remove(self, session: S) -> None:
        """Forget ``session``; an entry its replacement (same id) already made stays."""
        for block_hash in session.block_hashes:
            holders = self._by_hash.get(block_hash)
            if holders is not None and holders.get(session.session_id) is session:
                del holders[session.session_id]
                if not holders:
                    del self._by_hash[block_hash]

    def deepest_match(self, tenant: str, block_hashes: Sequence[BlockHash],
                      max_blocks: int) -> tuple[S | None, int]:
        """``tenant``'s session sharing the most leading blocks (at most ``max_blocks``)
        with a prompt whose block hashes are ``block_hashes``; of equals one that holds a block
        past them (whose tokens can serve the prompt's partial tail), then the most recently
        used, and how many blocks it shares ((None, 0) for none). O(prompt blocks):
        walks the prompt from its deepest block up and stops at the first hash a session
        of the tenant holds. Hashes only: the caller compares tokens before it trusts it."""
        by_hash = self._by_hash
        for depth in range(min(len(block_hashes), max_blocks) - 1, -1, -1):
            holders = by_hash.get(block_hashes[depth])
            if not holders:
                continue
            best: S | None = None
            for session in holders.values():
                if session.tenant == tenant and (best is None or _rank(session, depth) > _rank(best, depth)):
                    best = session
            if best is not None:
                return best, depth + 1
        return None, 0


def _rank(session: IndexedSession, depth: int) -> tuple[bool, float]:
    return len(session.block_hashes) > depth + 1, session.last_used
