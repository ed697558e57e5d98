"""Block pool and prefix cache, tested like vLLM's test_prefix_caching.py: exact ids, exact order."""

from __future__ import annotations

import pytest

from station.core import block_pool
from station.core.block_pool import BlockPool, block_hashes_for, hash_block, prefix_extra_keys
from station.core.kv_manager import KVCacheManager
from station.core.sequence import Sequence
from station.core.requests import SamplingParams

BS = 4
KEYS = prefix_extra_keys("model-fp", "salt", "")


def run_sequence(kv: KVCacheManager, tokens: list[int], keys=KEYS):
    """Admit a sequence as the scheduler does (prefix hit + fresh blocks), compute it, and
    cache its full blocks; -> its blocks (still referenced) and the tokens the hit covered."""
    seq = Sequence("s", list(tokens), SamplingParams(max_tokens=1), extra_keys=keys)
    computed = kv.find_computed_blocks(seq)
    assert kv.allocate_slots(seq, seq.num_tokens - computed.num_cached_tokens, computed)
    seq.num_computed_tokens = seq.num_tokens
    kv.cache_full_blocks(seq)
    return seq.blocks, computed.num_cached_tokens


def ids(blocks):
    return [b.block_id for b in blocks]


def test_hash_is_deterministic_and_chained():
    a = hash_block(None, [1, 2, 3, 4], KEYS)
    assert a == hash_block(None, [1, 2, 3, 4], KEYS)
    assert len(a) == 32
    assert hash_block(a, [5, 6, 7, 8], KEYS) != hash_block(None, [5, 6, 7, 8], KEYS)
    assert hash_block(None, [1, 2, 3, 4], ("other-model", KEYS[1])) != a
    assert hash_block(None, [1, 2], ()) != hash_block(None, [12], ())


def test_allocate_pops_head_in_id_order():
    pool = BlockPool(6, BS)
    assert ids(pool.allocate(2)) == [0, 1]
    assert pool.free_queue_ids() == [2, 3, 4, 5]
    assert pool.num_held_blocks == 2
    assert not pool.can_allocate(5)


def test_prefix_hit_exact_blocks_and_cap():
    kv = KVCacheManager(10, BS)
    pool = kv.pool
    tokens = list(range(10))  # 2 full blocks + 2 tokens
    blocks, hit = run_sequence(kv, tokens)
    assert ids(blocks) == [0, 1, 2] and hit == 0
    assert pool.num_cached_blocks == 2
    pool.free(blocks)
    # Uncached block 2 goes to the head; cached ones to the tail, last block first.
    assert pool.free_queue_ids() == [2, 3, 4, 5, 6, 7, 8, 9, 1, 0]

    blocks2, hit2 = run_sequence(kv, tokens)
    assert hit2 == 8 and ids(blocks2) == [0, 1, 2]
    assert [b.ref_cnt for b in blocks2] == [1, 1, 1]
    pool.free(blocks2)

    # Exactly 8 tokens: the hit is capped at 7 -> only 1 block may be served.
    eight = tokens[:8]
    hashes = block_hashes_for(eight, BS, KEYS)
    assert ids(pool.get_computed_blocks(eight, hashes)) == [0]
    # 9 tokens: both blocks (8 <= 9 - 1).
    nine = tokens[:9]
    assert ids(pool.get_computed_blocks(nine, block_hashes_for(nine, BS, KEYS))) == [0, 1]


def test_eviction_order_is_lru_with_last_blocks_first():
    kv = KVCacheManager(4, BS)
    pool = kv.pool
    a, _ = run_sequence(kv, [1] * 8)          # blocks 0,1 (chain differs so both cached)
    pool.free(a)
    assert pool.free_queue_ids() == [2, 3, 1, 0]
    b = pool.allocate(3)
    assert ids(b) == [2, 3, 1]                 # block 1 (a's last block) evicted first
    assert pool.num_cached_blocks == 1
    hashes = block_hashes_for([1] * 9, BS, KEYS)
    assert ids(pool.get_computed_blocks([1] * 9, hashes)) == [0]  # a's first block survives


def test_shared_prefix_ref_counting():
    kv = KVCacheManager(8, BS)
    pool = kv.pool
    prefix = [7, 7, 7, 7, 8, 8, 8, 8]
    a, _ = run_sequence(kv, prefix + [1, 2])
    b, hit = run_sequence(kv, prefix + [3, 4])
    assert hit == 8 and ids(b)[:2] == ids(a)[:2]
    assert [blk.ref_cnt for blk in a] == [2, 2, 1]
    pool.free(a)
    assert [blk.ref_cnt for blk in b] == [1, 1, 1]
    assert pool.free_queue_ids()[0] == a[2].block_id  # a's uncached tail block reused first
    pool.free(b)
    assert pool.num_held_blocks == 0
    assert all(blk.ref_cnt == 0 for blk in pool.blocks)


def test_hash_collision_never_serves_wrong_kv(monkeypatch):
    kv = KVCacheManager(8, BS)
    pool = kv.pool
    monkeypatch.setattr(block_pool, "hash_block", lambda parent, toks, keys=(): b"same")
    a, _ = run_sequence(kv, [1, 2, 3, 4, 5])
    pool.free(a)
    other = [9, 9, 9, 9, 5]
    hashes = block_pool.block_hashes_for(other, BS, KEYS)
    assert hashes == [b"same"]
    assert pool.get_computed_blocks(other, hashes) == []  # same key, different tokens
    assert ids(pool.get_computed_blocks([1, 2, 3, 4, 5], hashes)) == [0]


def test_tenant_salt_isolation():
    kv = KVCacheManager(8, BS)
    pool = kv.pool
    tokens = list(range(9))
    alice = prefix_extra_keys("fp", "salt", "alice")
    bob = prefix_extra_keys("fp", "salt", "bob")
    a, _ = run_sequence(kv, tokens, alice)
    pool.free(a)
    assert pool.get_computed_blocks(tokens, block_hashes_for(tokens, BS, bob)) == []
    assert len(pool.get_computed_blocks(tokens, block_hashes_for(tokens, BS, alice))) == 2
    # Another server salt: the same tenant name maps to different keys.
    assert prefix_extra_keys("fp", "other", "alice") != alice
    assert "alice" not in "".join(alice)


def test_pinned_blocks_are_never_evicted():
    kv = KVCacheManager(3, BS)
    pool = kv.pool
    a, _ = run_sequence(kv, list(range(8)))
    pool.pin(a)
    pool.free(a)
    assert [b.ref_cnt for b in a] == [0, 0] and [b.pin_cnt for b in a] == [1, 1]
    assert pool.free_queue_ids() == [2]
    assert not pool.can_allocate(2)
    assert ids(pool.allocate(1)) == [2]
    pool.unpin(a)
    assert pool.free_queue_ids() == [1, 0]
    assert pool.num_cached_blocks == 2


def test_touching_a_cached_free_block_removes_it_from_the_queue():
    kv = KVCacheManager(4, BS)
    pool = kv.pool
    a, _ = run_sequence(kv, list(range(5)))
    pool.free(a)
    assert pool.num_evictable_in(a[:1]) == 1
    pool.touch(a[:1])
    assert a[0].block_id not in pool.free_queue_ids()
    assert pool.num_free_blocks == 3
    with pytest.raises(AssertionError):
        pool.free([pool.blocks[3]])
