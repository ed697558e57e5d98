"""The one owner of KV state: block pool, prefix cache and KV sessions (pure Python).

Modelled on vLLM v1's ``KVCacheManager``: the scheduler decides *who* runs, this decides
*which blocks* they run on, and the two talk through a small typed result
(``ComputedBlocks``) so neither knows the other's internals. Admission is two-phase:

* ``find_computed_blocks(seq, load_session)`` looks up, without taking anything, the blocks
  a sequence can start from: a loaded session's blocks for the prefix it shares with the
  prompt, then prefix-cache hits past them. Both compare tokens, not only hashes, so a hash
  collision or a session of other tokens can never serve wrong KV. Like a cache hit, a
  session never covers the last prompt token: its logits are needed. A cached tail past
  those blocks (``station.core.tails``) gives the next tokens too, copied, never shared.
* ``allocate_slots(seq, num_new_tokens, computed)`` takes those blocks and fresh ones for
  the new tokens, expiring KV sessions (LRU, tenant-fair: ``SessionRegistry.reclaim``)
  before it gives up; False tells the scheduler to wait or preempt.

Sessions are pinned here too (``pin`` / ``unpin`` / ``load_into``); ``resident_blocks`` says
whether the KV of a token list is still in the pool (``kv_session.save``); ``begin_load`` /
``finish_load`` bring a disk-tier session back (``station.core.disk_side``: the tier's
side of the manager); ``fork`` gives an ``n > 1`` choice its parent's prompt KV (the partial block
copied by ``copy_block``); ``hold_blocks`` keeps blocks as they are for a disk write.

Thread-safety: none. Every call happens on the engine thread (``stats`` only reads ints).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence as Seq

from gnosis_daemon.logs import get_logger
from gnosis_daemon.tokens import common_prefix_len
from station.core.block_pool import (BlockHash, BlockPool, ExtraKeys, KVBlock, block_hashes_for,
                                     prefix_extra_keys)
from station.core.disk_side import DiskTierSide
from station.core.disk_sessions import DiskSession, DiskSessions
from station.core.kv_results import ComputedBlocks, SessionOutcome
from station.core.pins import PinTable, read_from_pins
from station.core.sequence import Sequence
from station.core.sessions import KVSession, SessionRegistry
from station.core.prompt_ends import PromptEnds
from station.core.tails import find_tail, leave_tail, tail_of

log = get_logger(__name__)


class KVCacheManager(DiskTierSide):
    def __init__(self, num_blocks: int, block_size: int, session_budget: int = 1, *,
                 tenant_share: float = 1.0, model_fingerprint: str = "", tenant_salt: str = "",
                 clock: Callable[[], float] = time.time, bytes_per_block: int = 0,
                 pin_tenant_bytes: int = 2 * 1024 ** 3,
                 copy_block: Callable[[int, int], None] | None = None) -> None:
        self.pool = BlockPool(num_blocks, block_size)
        # (src, dst) block ids: the KV tensors' copy, for forks and tails (none: no tails)
        self.copy_block, self.ends = copy_block, PromptEnds()  # ends: kept only with tails
        self.pins = PinTable(clock, bytes_per_block, pin_tenant_bytes)  # TTL pins, both tiers
        self.sessions = SessionRegistry(self.pool, session_budget, clock=clock,
                                        tenant_share=tenant_share, pins=self.pins)
        self.sessions.offload_pins = lambda session: self.disk_tier and session.durable
        self.block_size, self.model_fingerprint, self.tenant_salt = block_size, model_fingerprint, tenant_salt
        # The disk tier behind the pool (``enable_disk_tier``): sessions whose KV only the disk
        # holds, those saved since the engine last took them (to write behind), and what
        # became of evicted sessions.
        self.disk = DiskSessions()
        self.disk_tier = False
        self.to_write: list[KVSession] = []
        self.to_touch: dict[str, float] = {}  # durable sessions used since: id -> last_used
        self.num_offloaded = 0  # evicted from the pool, kept on disk
        self.num_lost = 0  # evicted before the write-behind made them durable
        self.num_disk_loads = self.num_quarantined_loads = self.num_unreadable_loads = 0

    # -- figures
    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_held_blocks(self) -> int:
        return self.pool.num_held_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def stats(self) -> dict[str, Any]:
        """The pool's, the sessions' and the disk index's figures for the ``stats`` op: plain
        counters, so another thread may read them (they may be one step stale)."""
        return {**self.pool.stats(), **self.sessions.stats(), **self.pins.stats(),
                "kv_disk_sessions": len(self.disk),
                "kv_sessions_offloaded": self.num_offloaded, "kv_sessions_lost": self.num_lost,
                "kv_disk_loads": self.num_disk_loads, "kv_disk_quarantined_loads": self.num_quarantined_loads,
                "kv_disk_unreadable_loads": self.num_unreadable_loads, **self.ends.stats()}

    def extra_keys(self, tenant: str) -> ExtraKeys:
        """The extra keys of every block hash of ``tenant`` (model and salted tenant)."""
        return prefix_extra_keys(self.model_fingerprint, self.tenant_salt, tenant)

    # -- admission (two-phase)
    def find_computed_blocks(self, seq: Sequence, load_session: str | None = None) -> ComputedBlocks:
        """The blocks ``seq`` can start from, then the tail that holds its next tokens (to
        copy); takes no reference and changes no LRU order."""
        computed = self._find_blocks(seq, load_session)
        if self.copy_block is None or computed.session_outcome is SessionOutcome.ON_DISK:
            return computed  # (a disk read comes first: the sequence asks again after it)
        return find_tail(self.pool, seq, computed, self.ends)

    def _find_blocks(self, seq: Sequence, load_session: str | None) -> ComputedBlocks:
        """The full blocks of ``find_computed_blocks``: a session's, then cache hits."""
        bs = self.block_size
        seq.block_hashes = block_hashes_for(seq.token_ids, bs, seq.extra_keys, seq.block_hashes)
        hits = self.pool.get_computed_blocks(seq.token_ids, seq.block_hashes)
        if not load_session and seq.match_session:
            # The tenant's session with the deepest shared prefix; never past the block
            # that holds the last prompt token (its logits are needed).
            max_blocks = (seq.num_tokens - 1) // bs
            found, depth = self.sessions.deepest_match(seq.tenant, seq.block_hashes, max_blocks)
            on_disk, disk_depth = self.disk.deepest_match(seq.tenant, seq.block_hashes, max_blocks)
            if on_disk is not None and disk_depth > depth:
                return self._from_disk_session(on_disk, disk_depth, hits)
            load_session = found.session_id if found is not None else None
        if not load_session:
            return ComputedBlocks.hits_only(hits, bs)
        session = self.sessions.get(load_session)
        if session is None:
            on_disk = self.disk.get(load_session)
            if on_disk is None:
                return ComputedBlocks.hits_only(hits, bs, SessionOutcome.NOT_FOUND)
            if on_disk.tenant != seq.tenant:
                return ComputedBlocks.hits_only(hits, bs, SessionOutcome.TENANT_MISMATCH)
            n = min(common_prefix_len(on_disk.token_ids, seq.token_ids), seq.num_tokens - 1) // bs
            if n == 0:
                return ComputedBlocks.hits_only(hits, bs, SessionOutcome.NO_COMMON_PREFIX)
            return self._from_disk_session(on_disk, n, hits)
        if session.tenant != seq.tenant:
            return ComputedBlocks.hits_only(hits, bs, SessionOutcome.TENANT_MISMATCH)
        # Full blocks only, and never the last prompt token (its logits are needed).
        usable = min(common_prefix_len(session.token_ids, seq.token_ids), seq.num_tokens - 1)
        n = usable // bs
        if n == 0:
            return ComputedBlocks.hits_only(hits, bs, SessionOutcome.NO_COMMON_PREFIX)
        # Cache hits past the session hold the same prefix's KV: keep them too.
        blocks = (*session.blocks[:n], *hits[n:])
        return ComputedBlocks(blocks, len(blocks) * bs, session, SessionOutcome.LOADED, n * bs)

    def _from_disk_session(self, on_disk: DiskSession, num_blocks: int,
                           hits: Seq[KVBlock]) -> ComputedBlocks:
        """A disk-tier session sharing ``num_blocks`` full blocks with the prompt: read back
        first, unless the prefix cache still holds those blocks (the session was evicted, its
        freed blocks not reused yet): then it is loaded from the pool as it stands."""
        bs = self.block_size
        if num_blocks > len(hits):
            return ComputedBlocks(tuple(hits), len(hits) * bs,
                                  session_outcome=SessionOutcome.ON_DISK, disk_session=on_disk)
        return ComputedBlocks(tuple(hits), len(hits) * bs, session_outcome=SessionOutcome.LOADED,
                              num_session_tokens=num_blocks * bs, cached_disk_session=on_disk)

    def allocate_slots(self, seq: Sequence, num_new_tokens: int,
                       computed: ComputedBlocks | None = None, *, reclaim: bool = True) -> bool:
        """Give ``seq`` blocks for ``num_new_tokens`` more tokens; False when they do not fit.

        With ``computed`` (admission, ``seq`` holds nothing yet) the sequence takes those
        blocks, a copy of the tail, and fresh ones past them, and its computed count is
        theirs (the tail is dropped rather than counted against a full queue); without it
        (a running sequence) only fresh ones past its computed tokens. Before failing,
        sessions are expired to make room (``reclaim``), never the one ``seq`` loads; a
        decode's block is needed by no tenant in particular, so fairness falls back to LRU.
        """
        tail = None
        if computed is None:
            start, tenant, keep = seq.num_computed_tokens, None, None
            hits: Seq[KVBlock] = ()
            num_held = len(seq.blocks)
        else:
            assert not seq.blocks, "admission of a sequence that holds blocks"
            start, tenant, keep = computed.num_cached_tokens, seq.tenant, seq.load_session
            hits, tail = computed.blocks, computed.tail
            num_held = len(hits)
            if computed.session is not None:
                self._use(computed.session)
            elif computed.cached_disk_session is not None:  # the disk's LRU learns of it
                on_disk = computed.cached_disk_session
                on_disk.last_used = self.sessions.clock()
                self.to_touch[on_disk.session_id] = on_disk.last_used
                self.pins.refresh(on_disk.session_id)
        num_new = self.num_blocks_for(start + num_new_tokens) - num_held
        if num_new <= 0 and computed is None:
            return True
        num_new = max(num_new, 0)
        # Cached hits (and the tail) in the free queue count against it: touching removes them.
        taken = (*hits, tail) if tail is not None else hits
        if tail is not None and not self.pool.can_allocate(num_new + self.pool.num_evictable_in(taken)):
            tail, taken, start = None, hits, len(hits) * self.block_size  # not worth a block of room
        if not self.pool.can_allocate(num_new + self.pool.num_evictable_in(taken)) and reclaim:
            needed = num_new + self.pool.num_evictable_in(taken)
            expired = self.sessions.reclaim(needed, keep, tenant)
            if expired:
                log.info("kv_sessions_expired_for_room", expired=expired, blocks_needed=needed)
                self._take_evictions()
        # Re-counted: a reclaim may have put some of the hits back in the free queue.
        if not self.pool.can_allocate(num_new + self.pool.num_evictable_in(taken)):
            return False
        if computed is not None:
            self.pool.touch(taken)  # the tail too: allocating must not evict it before its copy
            seq.blocks, seq.num_registered_blocks, seq.num_computed_tokens = list(hits), len(hits), start
            if self.pins.num_pins and not seq.num_preemptions:  # what the prefill event reports
                n, read = read_from_pins(self.pins, seq.tenant, hits, self._block_hashes)
                seq.num_pin_read_tokens = n * self.block_size
                for sid in read:  # a durable pin's manifest learns of its later expiry
                    pinned = self.sessions.get(sid) or self.disk.get(sid)
                    if pinned is not None and (not isinstance(pinned, KVSession) or pinned.durable):
                        self.to_touch[sid] = pinned.last_used
        seq.blocks += self.pool.allocate(num_new)
        if tail is not None:
            assert self.copy_block is not None  # find_computed_blocks gives no tail without it
            self.copy_block(tail.block_id, seq.blocks[len(hits)].block_id)
            self.pool.free([tail])  # back in the queue as it was, its LRU place refreshed
        return True

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Offer ``seq``'s newly full, computed blocks to the prefix cache."""
        bs = self.block_size
        num_full = min(seq.num_computed_tokens // bs, len(seq.blocks))
        if num_full <= seq.num_registered_blocks:
            return
        if len(seq.block_hashes) < num_full:
            seq.block_hashes = block_hashes_for(seq.token_ids[:num_full * bs], bs, seq.extra_keys,
                                                seq.block_hashes)
        for i in range(seq.num_registered_blocks, num_full):
            self.pool.cache_full_block(seq.blocks[i], seq.block_hashes[i],
                                       seq.token_ids[i * bs:(i + 1) * bs],
                                       seq.blocks[i - 1] if i else None, tail_of(seq, i))
        seq.num_registered_blocks = num_full

    def free(self, seq: Sequence) -> None:
        """Release ``seq``'s blocks; its full ones stay in the prefix cache, its partial last
        one (its computed tokens past the full blocks) in the tail index, all evictable."""
        self.cache_full_blocks(seq)
        if self.copy_block is not None:  # (without one, no tail is ever served)
            leave_tail(self.pool, seq, self.ends)
        self.pool.free(seq.blocks)
        seq.blocks = []
        seq.num_registered_blocks = 0

    def fork(self, parent: Sequence, child: Sequence) -> bool:
        """Give ``child`` (holding nothing) the KV of ``parent``'s computed prompt: a reference
        on each full block (shared, nothing copied) and a fresh block holding a copy of the
        partial last one (copy-on-fork: from then on each writes its own last block). False,
        taking nothing, when the pool has no free block for that copy."""
        assert not child.blocks, "fork into a sequence that holds blocks"
        assert parent.num_computed_tokens >= parent.num_prompt_tokens, "the prompt is not computed"
        full, partial = divmod(parent.num_prompt_tokens, self.block_size)
        if partial and not self.pool.can_allocate(1):
            return False
        self.pool.touch(parent.blocks[:full])
        child.blocks = list(parent.blocks[:full])
        if partial:
            assert self.copy_block is not None, "a partial block to fork and no copy hook"
            [block] = self.pool.allocate(1)
            self.copy_block(parent.blocks[full].block_id, block.block_id)
            child.blocks.append(block)
        child.block_hashes = list(parent.block_hashes[:full])
        child.num_registered_blocks = full
        return True

    # -- KV sessions
    def get_session(self, session_id: str) -> KVSession | None:
        return self.sessions.get(session_id)

    def pin(self, session_id: str, tenant: str, token_ids: Seq[int], blocks: Seq[KVBlock],
            known_hashes: list[BlockHash] | None = None, ttl_s: float | None = None) -> KVSession:
        """Pin ``blocks`` (the KV of ``token_ids``, full blocks) as session ``session_id``,
        findable by its block hashes (``known_hashes``: a prefix of them already computed);
        ``ttl_s``: a TTL pin (``station.core.pins``), else an ordinary session."""
        old = self.sessions.get(session_id)
        if (ttl_s is None and old is not None and session_id not in self.pins
                and old.tenant == tenant and len(old.token_ids) == len(token_ids)
                and old.token_ids == tuple(token_ids)):
            return self._saved_again(old)
        hashes = block_hashes_for(token_ids, self.block_size, self.extra_keys(tenant),
                                  (known_hashes or [])[:len(blocks)])
        if ttl_s is None:
            self.pins.drop(session_id)
        else:  # before the save: the budget it applies does not count the pin
            self.pins.add(session_id, tenant, ttl_s, len(blocks))
        session = self.sessions.save(session_id, tenant, token_ids, blocks, hashes)
        self.disk.remove(session_id)  # a new save of an id replaces its copy on disk
        if self.disk_tier:
            self.to_write.append(session)
        self._take_evictions()
        return session

    def _saved_again(self, session: KVSession) -> KVSession:
        """The same tokens saved again under the same id (every turn of a conversation
        saves its prompt again): the session as it is, used now. Its blocks hold that KV
        already, so nothing is re-pinned or re-hashed, and the disk tier rewrites nothing:
        a durable one is touched, one whose write is on the way is handed over again (the
        tier skips a session a job already carries, and writes one whose write failed)."""
        self._use(session)
        if self.disk_tier and not session.durable:
            self.to_write.append(session)
        return session

    def pin_sequence(self, session_id: str, seq: Sequence, num_tokens: int,
                     ttl_s: float | None = None) -> int:
        """Pin the full blocks of ``seq``'s first ``num_tokens`` computed tokens; -> tokens pinned."""
        n = min(num_tokens, seq.num_computed_tokens, seq.num_tokens) // self.block_size
        assert n <= len(seq.blocks)
        self.pin(session_id, seq.tenant, seq.token_ids[:n * self.block_size], seq.blocks[:n],
                 seq.block_hashes, ttl_s)
        return n * self.block_size

    def unpin(self, session_id: str) -> bool:
        """Delete a session, from the pool and the disk tier's index (the engine deletes
        its files)."""
        on_disk = self.disk.remove(session_id) is not None
        self.pins.drop(session_id)
        return self.sessions.delete(session_id) or on_disk

    def load_into(self, seq: Sequence, session: KVSession) -> int:
        """Give an empty ``seq`` (its tokens are the session's) the session's blocks, shared
        not copied: sessions hold full blocks only. -> tokens whose KV it now holds."""
        assert not seq.blocks and tuple(seq.token_ids) == session.token_ids
        self.pool.touch(session.blocks)
        seq.blocks = list(session.blocks)
        seq.num_registered_blocks = len(session.blocks)
        self._use(session)
        return session.num_tokens

    def _block_hashes(self, session_id: str) -> Seq[BlockHash] | None:
        """The block hashes of the session ``session_id`` names, in the pool or on disk."""
        session = self.sessions.get(session_id) or self.disk.get(session_id)
        return session.block_hashes if session is not None else None

    def _use(self, session: KVSession) -> None:
        self.sessions.use(session)
        self.pins.refresh(session.session_id)
        if session.durable:  # the disk's LRU learns of it too
            self.to_touch[session.session_id] = session.last_used

    def resident_blocks(self, token_ids: Seq[int], tenant: str) -> list[KVBlock]:
        """The cached blocks holding the longest resident prefix of ``token_ids``'s full
        blocks (tokens compared, not only hashes); nothing is taken."""
        hashes = block_hashes_for(token_ids, self.block_size, self.extra_keys(tenant))
        return self.pool.get_computed_blocks(token_ids, hashes, capped=False)
