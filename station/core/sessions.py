"""KV sessions: liquid memory's storage (pure Python: no torch here).

A session pins the blocks that hold the KV of a token prefix under a name, so the prefix
outlives the request that computed it. Saving copies no tensor: it takes a pin on the
sequence's own full blocks (``BlockPool.pin``); a pinned block is never evicted, whatever
its ``ref_cnt``. A session only ever holds FULL blocks, so no sequence ever writes into a
pinned block again: loading one needs no copy-on-write.

The registry is bounded by a count (``settings.kv_session_budget``): saving past the
budget expires one session, and when the pool runs out of blocks the KV cache manager calls
``reclaim`` before it preempts running work (a running request is worth more than a
parked prefix).

Which session expires is fair between tenants (``settings.kv_session_tenant_share``): a
tenant is *over its share* when it holds more than ``share * budget`` sessions (for the
count budget) or more than ``share * pool blocks`` distinct pinned blocks (for
``reclaim``). The victim is, in this order: the requesting tenant's own least recently
used session when that tenant is over its share; else the least recently used session
of any tenant over its share; and only when no tenant is over its share, the least
recently used session of all. So one tenant flooding the registry with new prompts
evicts its own sessions, and a tenant under its share never loses a session to a tenant
over it. Per-tenant figures are kept incrementally (a count and a per-block pin count
for each tenant), so choosing a victim never walks the pool.

A live TTL pin (``station.core.pins``) is no victim: it does not count against the count
budget, and ``reclaim`` takes one only where ``offload_pins`` says it moves to the disk
tier (durable, a tier behind the pool), after every unpinned session.

Thread-safety: none. Every call happens on the engine thread.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

from station.core.block_pool import BlockHash, BlockPool, KVBlock
from station.core.hash_index import HashIndex
from station.core.pins import PinTable


@dataclass(slots=True, eq=False)
class KVSession:
    session_id: str
    tenant: str
    token_ids: tuple[int, ...]  # the tokens whose KV the blocks hold (a multiple of block_size)
    blocks: list[KVBlock]
    last_used: float  # wall clock seconds, for listings
    block_hashes: tuple[BlockHash, ...] = ()  # the chained (tenant-keyed) hash of each block
    durable: bool = False  # the disk tier holds all of it (write-behind confirmed)
    file_hashes: tuple[BlockHash, ...] = ()  # its block files' names, once durable

    def __post_init__(self) -> None:
        if not self.file_hashes:
            self.file_hashes = self.block_hashes

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(slots=True)
class _TenantUsage:
    sessions: int = 0
    blocks: dict[int, int] = field(default_factory=dict)  # block id -> this tenant's pins on it


class SessionRegistry:
    def __init__(self, pool: BlockPool, budget: int, clock: Callable[[], float] = time.time,
                 tenant_share: float = 1.0, pins: PinTable | None = None) -> None:
        assert budget > 0 and 0 < tenant_share <= 1
        self.pool = pool
        self.budget = budget
        self.clock = clock
        self.tenant_share = tenant_share
        self.pins = pins if pins is not None else PinTable(clock)
        # A live pin ``reclaim`` may take: it moves to the disk tier (the KV manager's rule).
        self.offload_pins: Callable[[KVSession], bool] = lambda session: False
        self._sessions: OrderedDict[str, KVSession] = OrderedDict()  # LRU first
        self._tenants: dict[str, _TenantUsage] = {}  # only tenants that hold a session
        # block hash -> the sessions holding a block of that hash at that depth (the hash
        # chains every block before it, so one hit names a whole shared prefix)
        self._by_hash: HashIndex[KVSession] = HashIndex()
        self.num_expired = 0
        # Sessions expired (budget or reclaim) since the KV cache manager last took them:
        # it moves the durable ones to the disk tier's index instead of losing them.
        self.evicted: list[KVSession] = []
        self.num_expired_over_share = 0  # of num_expired: victims whose tenant was over its share

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
    def num_tenants(self) -> int:
        """Tenants holding at least one session (a dict's size: safe to read anywhere)."""
        return len(self._tenants)

    @property
    def tenant_max_sessions(self) -> float:
        """A tenant holding more sessions than this is over its share of the budget."""
        return self.tenant_share * self.budget

    @property
    def tenant_max_blocks(self) -> float:
        """A tenant pinning more distinct blocks than this is over its share of the pool."""
        return self.tenant_share * self.pool.num_blocks

    def tenant_sessions(self, tenant: str) -> int:
        usage = self._tenants.get(tenant)
        return usage.sessions if usage is not None else 0

    def tenant_pinned_blocks(self, tenant: str) -> int:
        """Distinct blocks pinned by ``tenant``'s sessions."""
        usage = self._tenants.get(tenant)
        return len(usage.blocks) if usage is not None else 0

    @property
    def pinned_blocks(self) -> int:
        """Distinct blocks pinned by sessions (sessions of one conversation share blocks).

        Only sessions pin, so this is the pool's counter: a plain int that ``stats`` may
        read from another thread without iterating anything the engine mutates.
        """
        return self.pool.num_pinned_blocks

    def stats(self) -> dict[str, float]:
        """The registry's figures for the ``stats`` op (plain counters: any thread may read them)."""
        return {"kv_sessions": len(self), "kv_session_budget": self.budget,
                "kv_sessions_expired": self.num_expired, "pinned_blocks": self.pinned_blocks,
                "kv_session_tenants": self.num_tenants,
                "kv_session_tenant_max_sessions": self.tenant_max_sessions,
                "kv_session_tenant_max_blocks": self.tenant_max_blocks,
                "kv_sessions_expired_over_share": self.num_expired_over_share}

    def save(self, session_id: str, tenant: str, token_ids: Sequence[int],
             blocks: Sequence[KVBlock], block_hashes: Sequence[BlockHash] = ()) -> KVSession:
        """Pin ``blocks`` (the KV of ``token_ids``) under ``session_id``, replacing any old
        one. ``block_hashes`` (one per block) make it findable by ``deepest_match``."""
        assert len(blocks) * self.pool.block_size == len(token_ids), "sessions hold full blocks"
        assert not block_hashes or len(block_hashes) == len(blocks)
        # Pin the new blocks before unpinning the old: blocks both share never touch the
        # free queue, so they cannot be evicted in between.
        self.pool.pin(blocks)
        session = KVSession(session_id, tenant, tuple(token_ids), list(blocks), self.clock(),
                            tuple(block_hashes))
        self._account(session, +1)
        old = self._sessions.pop(session_id, None)
        if old is not None:
            self._account(old, -1)
            self.pool.unpin(old.blocks)
        self._sessions[session_id] = session
        # (the count first: no list of every session while there are no more than the budget)
        while (len(self._sessions) > self.budget
               and len(unpinned := self._unpinned(self._sessions.values())) > self.budget):
            over = self._over_sessions
            victim = self._choose(unpinned, over, tenant, session_id)
            if victim is None:
                # Only when the saver is over its share with this one session: then
                # share * budget < 1 and every other tenant is over it too. A guard.
                victim = next(s for s in unpinned if s.session_id != session_id)
            self._expire(victim.session_id, over(victim.tenant))
        return session

    def _unpinned(self, sessions: Iterable[KVSession]) -> list[KVSession]:
        """``sessions`` (in their order) but the live pins."""
        now = self.clock()
        return [s for s in sessions if not self.pins.live(s.session_id, now)]

    def _candidates(self, sessions: Iterable[KVSession]) -> list[KVSession]:
        """What ``reclaim`` may take, in its order: the unpinned sessions (LRU first), then
        the live pins that would move to the disk tier."""
        now, unpinned, offloadable = self.clock(), [], []
        for s in sessions:
            if not self.pins.live(s.session_id, now):
                unpinned.append(s)
            elif self.offload_pins(s):
                offloadable.append(s)
        return unpinned + offloadable

    def deepest_match(self, tenant: str, block_hashes: Sequence[BlockHash],
                      max_blocks: int) -> tuple[KVSession | None, int]:
        """``HashIndex.deepest_match`` over the pool's sessions."""
        return self._by_hash.deepest_match(tenant, block_hashes, max_blocks)

    def use(self, session: KVSession) -> None:
        """Mark a session used (a load): it becomes the most recently used."""
        session.last_used = self.clock()
        self._sessions.move_to_end(session.session_id)

    def delete(self, session_id: str) -> bool:
        session = self._sessions.pop(session_id, None)
        if session is None:
            return False
        self._account(session, -1)
        self.pool.unpin(session.blocks)
        return True

    def reclaim(self, num_blocks: int, keep: str | None = None, tenant: str | None = None) -> int:
        """Expire sessions until ``num_blocks`` can be allocated; returns how many expired.

        ``tenant`` is the tenant that needs the blocks (None: unknown), ``keep`` the session
        its request loads. Victims are chosen fairly (module docstring), by pinned blocks.
        The whole sequence of victims is planned first, and nothing is expired unless it
        makes room: when the blocks are held by running work, or the sessions fairness
        allows to drop do not free enough, expiring would only lose data.
        """
        if self.pool.can_allocate(num_blocks):
            return 0
        plan = self._plan_reclaim(num_blocks, keep, tenant)
        if plan is None:
            return 0
        for session_id, over in plan:
            self._expire(session_id, over)
        return len(plan)

    def _plan_reclaim(self, num_blocks: int, keep: str | None,
                      requester: str | None) -> list[tuple[str, bool]] | None:
        """The victims (and whether each one's tenant was over its share), or None."""
        free = self.pool.num_free_blocks
        alive = dict(self._sessions)  # LRU order; keep stays in it: its tenant's share counts
        pins: dict[int, int] = {}  # block id -> pins left, for the blocks the plan touches
        tenant_blocks = {t: len(u.blocks) for t, u in self._tenants.items()}
        tenant_pins: dict[tuple[str, int], int] = {}  # (tenant, block id) -> pins left
        limit = self.tenant_max_blocks
        plan: list[tuple[str, bool]] = []

        def over(t: str) -> bool:
            return tenant_blocks.get(t, 0) > limit

        while free < num_blocks:
            victim = self._choose(self._candidates(alive.values()), over, requester, keep)
            if victim is None:
                return None
            plan.append((victim.session_id, over(victim.tenant)))
            del alive[victim.session_id]
            usage = self._tenants[victim.tenant]
            for block in victim.blocks:
                left = pins.get(block.block_id, block.pin_cnt) - 1
                pins[block.block_id] = left
                if left == 0 and block.ref_cnt == 0:
                    free += 1
                key = (victim.tenant, block.block_id)
                mine = tenant_pins.get(key, usage.blocks[block.block_id]) - 1
                tenant_pins[key] = mine
                if mine == 0:
                    tenant_blocks[victim.tenant] -= 1
        return plan

    def _over_sessions(self, tenant: str) -> bool:
        return self.tenant_sessions(tenant) > self.tenant_max_sessions

    @staticmethod
    def _choose(sessions: Iterable[KVSession], over: Callable[[str], bool],
                requester: str | None, exclude: str | None) -> KVSession | None:
        """The fair victim among ``sessions`` (LRU first), never ``exclude``; None when a
        tenant is over its share but none of its sessions may go."""
        first_over: KVSession | None = None
        first_any: KVSession | None = None
        anyone_over = False
        for session in sessions:
            is_over = over(session.tenant)
            anyone_over = anyone_over or is_over
            if session.session_id == exclude:
                continue
            if is_over:
                if session.tenant == requester:
                    return session  # an over-share requester pays with its own LRU session
                if first_over is None:
                    first_over = session
            if first_any is None:
                first_any = session
        if first_over is not None:
            return first_over
        if anyone_over:
            return None
        return first_any

    def _account(self, session: KVSession, sign: int) -> None:
        usage = self._tenants.get(session.tenant)
        if usage is None:
            usage = self._tenants[session.tenant] = _TenantUsage()
        usage.sessions += sign
        if sign > 0:
            self._by_hash.add(session)
        else:
            self._by_hash.remove(session)  # not its replacement's entries
        for block in session.blocks:
            pins = usage.blocks.get(block.block_id, 0) + sign
            if pins:
                usage.blocks[block.block_id] = pins
            else:
                del usage.blocks[block.block_id]
        if usage.sessions == 0:
            del self._tenants[session.tenant]

    def _expire(self, session_id: str, over_share: bool = False) -> None:
        session = self._sessions.get(session_id)
        if session is not None:
            self.evicted.append(session)
        self.delete(session_id)
        self.num_expired += 1
        self.num_expired_over_share += over_share
