"""Paged-KV block pool and automatic prefix cache (pure Python: no torch here).

The pool owns ``num_blocks`` fixed-size blocks; the KV tensors live elsewhere
(``station.forward.kv_cache``) and are addressed by ``block_id``. Vocabulary follows vLLM v1's
``block_pool.py``: ``ref_cnt``, ``touch``, ``BlockHash``, a free queue whose order IS the
eviction order.

Free queue: an ``OrderedDict`` of block ids. ``allocate`` pops from the head and drops the
popped block's cached hash (eviction). ``free`` appends cached blocks to the tail in
reverse order, so a finished sequence's LAST blocks are evicted first (its first blocks,
the shared prefix most likely reused, live longest). A freed block that carries no hash is
worthless to keep and goes to the head, so it is reused before any cached block.

Prefix cache: a full block is keyed by ``hash_block(parent_hash, token_ids, extra_keys)``,
a sha256 chain (deterministic across processes, unlike ``hash()``). ``extra_keys`` carry
the model fingerprint and a salted tenant digest, so tenants and models never share
blocks. A lookup also compares the block's stored token ids, so a hash collision can never
serve wrong KV.

Tails (reuse inside a block): every cached block is also filed under its tail key
(``tail_key``: the hash of its parent chain and extra keys, no tokens) and its first token.
Besides the full blocks, a freed sequence's partial last block is filed there
(``cache_partial_block``: no block hash, its few computed tokens kept), so a prompt that
ends inside a block, or departs from an earlier one mid-block, finds the cached block whose
tokens share the longest prefix with its own (``longest_tail``, tokens compared). That block
is never handed out: the caller copies it into a fresh block of its own
(``station.core.tails``). A partial block is evictable like a full one, and leaves the index
when it is reallocated, so it is never served after its slots were written again.

Pinning (KV sessions): a pinned block is never evicted; a pinned block whose ``ref_cnt``
drops to 0 stays out of the free queue until its last unpin.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from dataclasses import dataclass
from typing import NewType, Sequence

BlockHash = NewType("BlockHash", bytes)
ExtraKeys = tuple[str, ...]


def hash_block(parent_hash: BlockHash | None, block_token_ids: Sequence[int],
               extra_keys: ExtraKeys = ()) -> BlockHash:
    """sha256 of a canonical encoding of (parent hash, block tokens, extra keys)."""
    h = hashlib.sha256()
    h.update(b"P" + (parent_hash if parent_hash is not None else b"-"))
    h.update(b"T" + struct.pack(f"<I{len(block_token_ids)}q", len(block_token_ids), *block_token_ids))
    for key in extra_keys:
        raw = key.encode("utf-8")
        h.update(b"K" + struct.pack("<I", len(raw)) + raw)
    return BlockHash(h.digest())


def prefix_extra_keys(model_fingerprint: str, tenant_salt: str, tenant: str) -> ExtraKeys:
    """Extra keys of every block hash: the model and a salted digest of the tenant.

    The tenant goes in only as a digest keyed by the server-side salt, so block hashes
    never reveal tenant names and a client cannot forge another tenant's keys.
    """
    tenant_digest = hashlib.sha256(
        struct.pack("<I", len(tenant_salt)) + tenant_salt.encode() + tenant.encode()
    ).hexdigest()
    return (model_fingerprint, tenant_digest)


def tail_key(parent_hash: BlockHash | None, extra_keys: ExtraKeys = ()) -> BlockHash:
    """The key the blocks following ``parent_hash`` (None: a first block) are filed under in
    the tail index: the chain and the extra keys, no tokens, so no full block's hash."""
    return hash_block(parent_hash, (), extra_keys)


def block_hashes_for(token_ids: Sequence[int], block_size: int, extra_keys: ExtraKeys,
                     known: list[BlockHash] | None = None) -> list[BlockHash]:
    """Chained hashes of every full block of ``token_ids``, extending ``known`` (reused prefix)."""
    hashes = list(known or [])
    parent = hashes[-1] if hashes else None
    for i in range(len(hashes), len(token_ids) // block_size):
        parent = hash_block(parent, token_ids[i * block_size:(i + 1) * block_size], extra_keys)
        hashes.append(parent)
    return hashes


_EXT_PREFIX = b"gnosis-kv-v1"
_EXT_MASK = (1 << 63) - 1


def ext_block_hash(parent: int | None, token_ids: Sequence[int]) -> int:
    """A block's external hash, what KV events name it by (``station.serving.kv_events``):
    token ids only, chained, so a router can follow it; no model, no tenant.
    ``sha256(b"gnosis-kv-v1" + parent as 8 bytes big-endian (0 for none) + each token as
    4 bytes little-endian)``, its first 8 bytes big-endian, masked to 63 bits."""
    h = hashlib.sha256(_EXT_PREFIX)
    h.update((parent or 0).to_bytes(8, "big"))
    h.update(struct.pack(f"<{len(token_ids)}I", *token_ids))
    return int.from_bytes(h.digest()[:8], "big") & _EXT_MASK


def ext_block_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """External hashes of every full block of ``token_ids``."""
    out: list[int] = []
    parent = None
    for i in range(len(token_ids) // block_size):
        parent = ext_block_hash(parent, token_ids[i * block_size:(i + 1) * block_size])
        out.append(parent)
    return out


@dataclass(slots=True, eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    pin_cnt: int = 0
    block_hash: BlockHash | None = None
    token_ids: tuple[int, ...] = ()  # a cached block's tokens (fewer for a partial one), to verify a hit
    tail_key: BlockHash | None = None  # filed in the tail index under this key (``tail_key``)
    # With KV events on (``BlockPool.events``): the block's external hash (tokens only,
    # chained: what routers are told) and its parent's; None otherwise.
    ext_hash: int | None = None
    ext_parent: int | None = None

    @property
    def held(self) -> bool:
        return self.ref_cnt > 0 or self.pin_cnt > 0


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        assert num_blocks > 0 and block_size > 0
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # Order is the eviction order: head = next to allocate.
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.high_water = 0  # one past the highest block id ever handed out (the pool's used span)
        self.cached_block_hash_to_block: dict[BlockHash, KVBlock] = {}
        # The tail index: (tail key, first token) -> the cached blocks (full and partial) that
        # follow that chain and start with that token.
        self.tails: dict[tuple[BlockHash, int], dict[int, KVBlock]] = {}
        self.num_partial_blocks = 0  # cached partial blocks (in the tail index, no hash)
        self.num_pinned_blocks = 0  # distinct blocks with pin_cnt > 0 (an int: safe to read anywhere)
        self.num_allocated = 0  # blocks handed out by ``allocate`` since start (stats)
        # KV events (``station.serving.kv_events.Listener``): told when a block enters the
        # prefix cache, leaves it, or the cache is reset. None: no events, no extra work.
        self.events = None

    # -- figures
    @property
    def num_free_blocks(self) -> int:
        """Blocks that ``allocate`` may hand out (free, including cached but unreferenced)."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self.cached_block_hash_to_block)

    @property
    def num_held_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def stats(self) -> dict[str, int]:
        """The pool's figures for the ``stats`` op (plain counters: any thread may read them)."""
        return {"block_size": self.block_size, "blocks_total": self.num_blocks,
                "blocks_free": self.num_free_blocks,  # allocatable, cached-but-unreferenced included
                "blocks_cached": self.num_cached_blocks, "blocks_held": self.num_held_blocks,
                "blocks_cached_partial": self.num_partial_blocks,
                "blocks_allocated": self.num_allocated}

    def free_queue_ids(self) -> list[int]:
        """The eviction order, head first (for tests and diagnostics)."""
        return list(self._free)

    # -- prefix cache
    def get_computed_blocks(self, token_ids: Sequence[int], block_hashes: Sequence[BlockHash],
                            capped: bool = True) -> list[KVBlock]:
        """Cached blocks holding the longest verified prefix of ``token_ids``.

        ``capped``: at least the last token is recomputed (its logits are needed), so a hit
        covers at most ``len(token_ids) - 1`` tokens. The blocks are not touched here.
        """
        bs = self.block_size
        max_blocks = (max(len(token_ids) - 1, 0) if capped else len(token_ids)) // bs
        hits: list[KVBlock] = []
        for i in range(min(max_blocks, len(block_hashes))):
            block = self.cached_block_hash_to_block.get(block_hashes[i])
            if block is None or block.token_ids != tuple(token_ids[i * bs:(i + 1) * bs]):
                break  # a miss, or a hash collision: never serve KV of other tokens
            hits.append(block)
        return hits

    def num_evictable_in(self, blocks: Sequence[KVBlock]) -> int:
        """How many of ``blocks`` sit in the free queue (touching them removes them from it)."""
        return sum(1 for b in blocks if not b.held)

    def cache_full_block(self, block: KVBlock, block_hash: BlockHash, token_ids: Sequence[int],
                         parent: KVBlock | None = None, tail: BlockHash | None = None) -> bool:
        """Register a full, computed block under ``block_hash``; False if that key is taken.

        A duplicate (another block already caches the same key) stays unhashed: it is
        freed to the head of the queue and reused first. ``parent``: the block before it in
        its sequence (None for a first block), whose external hash chains this one's.
        ``tail``: its tail key, to file it in the tail index too.
        """
        assert len(token_ids) == self.block_size
        if block.block_hash is not None:
            return block.block_hash == block_hash
        self._unfile_tail(block)  # never filed as partial while it is written, but be sure
        events = self.events
        if events is not None and block.ext_hash is None:
            if parent is None or parent.ext_hash is not None:
                block.ext_parent = parent.ext_hash if parent is not None else None
                block.ext_hash = ext_block_hash(block.ext_parent, token_ids)
        if block_hash in self.cached_block_hash_to_block:
            return False
        block.block_hash = block_hash
        block.token_ids = tuple(token_ids)
        self.cached_block_hash_to_block[block_hash] = block
        if tail is not None:
            block.tail_key = tail
            self.tails.setdefault((tail, block.token_ids[0]), {})[block.block_id] = block
        if events is not None and block.ext_hash is not None:
            events.stored(block.ext_hash, block.ext_parent, block.token_ids)
        return True

    def cache_partial_block(self, block: KVBlock, tail: BlockHash, token_ids: Sequence[int]) -> bool:
        """File a sequence's partial last block (``token_ids``: its computed tokens, fewer than
        a block) under ``tail`` as it is freed; False when a cached block there already holds
        these tokens (and maybe more). Partial blocks it extends leave the index."""
        assert 0 < len(token_ids) < self.block_size and block.block_hash is None
        tokens = tuple(token_ids)
        for other in list(self.tails.get((tail, tokens[0]), {}).values()):
            if other is block:
                continue
            if other.token_ids[:len(tokens)] == tokens:
                return False
            if other.block_hash is None and tokens[:len(other.token_ids)] == other.token_ids:
                self._unfile_tail(other)  # this one holds all of it and more
                if not other.held:  # worthless now: reused first
                    self._free.move_to_end(other.block_id, last=False)
        self._unfile_tail(block)
        block.tail_key, block.token_ids = tail, tokens
        self.tails.setdefault((tail, tokens[0]), {})[block.block_id] = block
        self.num_partial_blocks += 1
        return True

    def longest_tail(self, tail: BlockHash, token_ids: Sequence[int]) -> tuple[KVBlock | None, int]:
        """The cached block filed under ``tail`` whose tokens share the longest prefix with
        ``token_ids`` (the tokens that follow the chain), and that prefix's length; (None, 0)
        for none. Nothing is taken."""
        best, best_n = None, 0
        for block in self.tails.get((tail, token_ids[0]), {}).values() if token_ids else ():
            n = 0
            for mine, theirs in zip(token_ids, block.token_ids):
                if mine != theirs:
                    break
                n += 1
            if n > best_n:
                best, best_n = block, n
                if n == len(token_ids):
                    break  # none can share more
        return best, best_n

    def cached_ext_blocks(self) -> list[tuple[int, int | None, tuple[int, ...]]]:
        """Every cached block's ``(ext_hash, ext_parent, token_ids)``, parents before their
        children (a re-sync of the router's view: ``kv_events``)."""
        by_ext = {b.ext_hash: b for b in self.cached_block_hash_to_block.values()
                  if b.ext_hash is not None}
        depth: dict[int, int] = {}
        for ext in by_ext:
            path: list[int] = []
            e: int | None = ext
            while e is not None and e in by_ext and e not in depth:
                path.append(e)
                e = by_ext[e].ext_parent
            level = depth[e] if e is not None and e in depth else -1
            for x in reversed(path):
                level += 1
                depth[x] = level
        blocks = sorted(by_ext.items(), key=lambda item: depth[item[0]])
        return [(ext, b.ext_parent, b.token_ids) for ext, b in blocks]

    # -- reference counting
    def touch(self, blocks: Sequence[KVBlock]) -> None:
        """Take a reference on (cached) blocks, pulling them out of the free queue."""
        for block in blocks:
            if not block.held:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    def allocate(self, num_blocks: int) -> list[KVBlock]:
        """Pop ``num_blocks`` from the free-queue head (evicting their cached hashes)."""
        assert self.can_allocate(num_blocks), "allocate() without can_allocate()"
        self.num_allocated += num_blocks
        out: list[KVBlock] = []
        for _ in range(num_blocks):
            block_id, _ = self._free.popitem(last=False)
            if block_id >= self.high_water:
                self.high_water = block_id + 1
            block = self.blocks[block_id]
            assert not block.held
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def free(self, blocks: Sequence[KVBlock]) -> None:
        """Drop one reference on each block of a sequence (given in block-table order)."""
        for block in reversed(blocks):  # the last blocks reach the queue first: evicted first
            assert block.ref_cnt > 0, f"block {block.block_id} freed more often than taken"
            block.ref_cnt -= 1
            if not block.held:
                self._enqueue_free(block)

    # -- pinning (KV sessions)
    def pin(self, blocks: Sequence[KVBlock]) -> None:
        for block in blocks:
            if not block.held:
                del self._free[block.block_id]
            if block.pin_cnt == 0:
                self.num_pinned_blocks += 1
            block.pin_cnt += 1

    def unpin(self, blocks: Sequence[KVBlock]) -> None:
        for block in reversed(blocks):
            assert block.pin_cnt > 0, f"block {block.block_id} unpinned more often than pinned"
            block.pin_cnt -= 1
            if block.pin_cnt == 0:
                self.num_pinned_blocks -= 1
            if not block.held:
                self._enqueue_free(block)

    def forget(self, blocks: Sequence[KVBlock], chain: Sequence[BlockHash], extra_keys: ExtraKeys) -> None:
        """Drop ``blocks`` and the tails filed after each hash of ``chain`` from the prefix
        cache (a forgotten session's), where nothing holds them: reused first from now on."""
        keys = {tail_key(h, extra_keys) for h in chain}
        filed = [b for (key, _), by_id in self.tails.items() if key in keys for b in by_id.values()]
        for block in (*blocks, *filed):
            if not block.held:
                self._evict(block)
                self._free.move_to_end(block.block_id, last=False)

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash (e.g. after the model changed)."""
        for block in self.blocks:
            block.ext_hash = block.ext_parent = None
            self._unfile_tail(block)
        for block in self.cached_block_hash_to_block.values():
            block.block_hash = None
            block.token_ids = ()
        self.cached_block_hash_to_block.clear()
        if self.events is not None:
            self.events.cleared()

    # -- internals
    def _enqueue_free(self, block: KVBlock) -> None:
        self._free[block.block_id] = None
        if block.block_hash is None and block.tail_key is None:
            self._free.move_to_end(block.block_id, last=False)

    def _unfile_tail(self, block: KVBlock) -> None:
        """Take ``block`` out of the tail index (a partial block forgets its tokens too)."""
        if block.tail_key is None:
            return
        key = (block.tail_key, block.token_ids[0])
        siblings = self.tails[key]
        del siblings[block.block_id]
        if not siblings:
            del self.tails[key]
        block.tail_key = None
        if block.block_hash is None:
            block.token_ids = ()
            self.num_partial_blocks -= 1

    def _evict(self, block: KVBlock) -> None:
        self._unfile_tail(block)
        if block.block_hash is not None:
            if self.cached_block_hash_to_block.get(block.block_hash) is block:
                del self.cached_block_hash_to_block[block.block_hash]
                if self.events is not None and block.ext_hash is not None:
                    self.events.removed(block.ext_hash)
            block.block_hash = None
            block.token_ids = ()
        block.ext_hash = block.ext_parent = None
