"""The KV cache manager without a model, tested like vLLM's test_prefix_caching.py: exact
block ids, exact ref counts, exact eviction order."""

from __future__ import annotations

from station.core.kv_manager import KVCacheManager
from station.core.kv_results import ComputedBlocks, SessionOutcome
from station.core.sequence import Sequence
from station.core.requests import SamplingParams

BS = 4


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1
        return self.now


def manager(num_blocks: int, budget: int = 4, share: float = 1.0) -> KVCacheManager:
    return KVCacheManager(num_blocks, BS, budget, tenant_share=share, model_fingerprint="fp",
                          tenant_salt="salt", clock=Clock())


def make_seq(kv: KVCacheManager, seq_id: str, tokens, tenant: str = "",
             load_session: str | None = None, match_session: bool = False) -> Sequence:
    return Sequence(seq_id, list(tokens), SamplingParams(max_tokens=8),
                    extra_keys=kv.extra_keys(tenant), tenant=tenant, load_session=load_session,
                    match_session=match_session)


def admit(kv: KVCacheManager, seq: Sequence) -> ComputedBlocks:
    """Admit like the scheduler does, then pretend the whole prompt was computed."""
    computed = kv.find_computed_blocks(seq, seq.load_session)
    assert kv.allocate_slots(seq, seq.num_tokens - computed.num_cached_tokens, computed)
    seq.num_computed_tokens = seq.num_tokens
    kv.cache_full_blocks(seq)
    return computed


def ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


def test_two_sequences_share_a_prefix_with_exact_ids_and_ref_counts():
    kv = manager(10)
    a = make_seq(kv, "a", range(10))  # 2 full blocks + 2 tokens
    assert admit(kv, a).num_cached_tokens == 0
    assert ids(a.blocks) == [0, 1, 2]
    b = make_seq(kv, "b", [*range(8), 100, 101, 102])
    computed = admit(kv, b)
    assert ids(computed.blocks) == [0, 1] and computed.num_cached_tokens == 8
    assert computed.session_outcome is None
    assert ids(b.blocks) == [0, 1, 3]
    assert [blk.ref_cnt for blk in kv.pool.blocks[:5]] == [2, 2, 1, 1, 0]
    assert kv.pool.free_queue_ids() == [4, 5, 6, 7, 8, 9]


def test_free_then_readmit_hits_the_prefix_with_exact_ids():
    kv = manager(10)
    a, b = make_seq(kv, "a", range(10)), make_seq(kv, "b", [*range(8), 100, 101, 102])
    admit(kv, a)
    admit(kv, b)
    kv.free(a)
    kv.free(b)
    assert a.blocks == [] and b.blocks == []
    # Unhashed partial blocks go to the head (reused first), cached ones to the tail, the
    # last block of a sequence before its first.
    assert kv.pool.free_queue_ids() == [3, 2, 4, 5, 6, 7, 8, 9, 1, 0]
    c = make_seq(kv, "c", range(10))
    computed = admit(kv, c)
    assert ids(computed.blocks) == [0, 1] and computed.num_cached_tokens == 8
    assert ids(c.blocks) == [0, 1, 3]
    assert [blk.ref_cnt for blk in kv.pool.blocks[:4]] == [1, 1, 0, 1]


def test_a_hit_never_covers_the_last_prompt_token():
    kv = manager(10)
    admit(kv, make_seq(kv, "a", range(9)))
    again = make_seq(kv, "b", range(8))  # exactly the 2 cached blocks
    assert ids(kv.find_computed_blocks(again).blocks) == [0]


def test_eviction_takes_the_least_recently_freed_cached_blocks_last_block_first():
    kv = manager(4)
    x = make_seq(kv, "x", range(9))
    admit(kv, x)
    kv.free(x)
    assert kv.pool.free_queue_ids() == [2, 3, 1, 0]
    y = make_seq(kv, "y", [*range(100, 108), 200])
    admit(kv, y)
    assert ids(y.blocks) == [2, 3, 1]  # x's second block (1) evicted, its first (0) kept
    assert kv.pool.num_cached_blocks == 3  # x's block 0, y's blocks 2 and 3
    assert ids(kv.find_computed_blocks(make_seq(kv, "x2", range(9))).blocks) == [0]


def test_a_session_pin_keeps_blocks_out_of_eviction_until_reclaimed():
    kv = manager(4, budget=2)
    s = make_seq(kv, "s", range(9))
    admit(kv, s)
    assert kv.pin_sequence("s", s, 8) == 8
    kv.free(s)
    assert kv.pool.free_queue_ids() == [2, 3]  # pinned 0 and 1 are not evictable
    y = make_seq(kv, "y", range(100, 107))
    admit(kv, y)
    assert ids(y.blocks) == [2, 3] and kv.pool.num_free_blocks == 0
    assert ids(kv.find_computed_blocks(make_seq(kv, "s2", range(9))).blocks) == [0, 1]
    kv.free(y)
    assert kv.pool.free_queue_ids() == [3, 2]
    # Nothing but the session stands in the way: allocating reclaims it.
    z = make_seq(kv, "z", range(300, 315))
    assert not kv.allocate_slots(z, 15, kv.find_computed_blocks(z), reclaim=False)
    assert kv.get_session("s") is not None and z.blocks == []
    admit(kv, z)
    assert ids(z.blocks) == [3, 2, 1, 0]
    assert kv.get_session("s") is None and kv.sessions.num_expired == 1


def test_the_same_tokens_saved_again_keep_the_session_and_write_nothing_new():
    """Every turn saves its prompt again: unchanged, the session stays the same object (no
    re-pin, no re-hash), is used now, and the disk tier is handed nothing it holds: a
    durable session is touched, one not yet durable is handed over again (the tier skips
    it while a job carries it). Other tokens, another tenant or a TTL replace it."""
    kv = manager(8, budget=4)
    kv.enable_disk_tier()
    s = make_seq(kv, "s", range(9), tenant="t")
    admit(kv, s)
    kv.pin_sequence("a", s, 8)
    first = kv.get_session("a")
    assert kv.to_write == [first]
    kv.to_write.clear()
    used = first.last_used
    kv.pin_sequence("a", s, 8)  # its write on the way: handed over again, not replaced
    assert kv.get_session("a") is first and kv.to_write == [first] and first.last_used > used
    kv.to_write.clear()
    first.durable = True  # the write landed
    kv.pin_sequence("a", s, 8)
    assert kv.get_session("a") is first and kv.to_write == [] and "a" in kv.to_touch
    kv.pin_sequence("a", s, 4)  # fewer tokens: a new session, written
    second = kv.get_session("a")
    assert second is not first and second.token_ids == tuple(range(4)) and kv.to_write == [second]
    kv.pin_sequence("a", s, 4, ttl_s=60.0)  # a TTL pin now: replaced, written
    assert kv.get_session("a") is not second and "a" in kv.pins
    kv.free(s)


def test_reclaim_takes_the_tenant_over_its_share_first():
    kv = manager(8, budget=4, share=0.5)  # a tenant may pin up to 4 blocks
    a1 = make_seq(kv, "a1", range(5), tenant="alice")
    admit(kv, a1)
    kv.pin_sequence("a1", a1, 4)
    kv.free(a1)
    b1 = make_seq(kv, "b1", range(100, 109), tenant="bob")
    admit(kv, b1)
    kv.pin_sequence("b1", b1, 8)
    kv.free(b1)
    b2 = make_seq(kv, "b2", range(200, 213), tenant="bob")
    admit(kv, b2)
    kv.pin_sequence("b2", b2, 12)
    kv.free(b2)
    assert [ids(s.blocks) for s in kv.sessions.sessions()] == [[0], [1, 2], [3, 4, 5]]
    assert kv.pool.free_queue_ids() == [6, 7]
    assert kv.sessions.tenant_pinned_blocks("bob") == 5  # over alice's LRU session's head
    carol = make_seq(kv, "c", range(300, 311), tenant="carol")
    admit(kv, carol)
    assert [s.session_id for s in kv.sessions.sessions()] == ["a1", "b2"]
    assert ids(carol.blocks) == [6, 7, 2]
    assert kv.sessions.num_expired_over_share == 1


def test_a_loaded_session_serves_its_prefix_even_when_the_cache_forgot_it():
    kv = manager(10)
    s = make_seq(kv, "s", range(13), tenant="alice")
    admit(kv, s)
    kv.pin_sequence("s", s, 4)  # only the first block
    kv.free(s)
    t = make_seq(kv, "t", [*range(13), 99], tenant="alice", load_session="s")
    computed = kv.find_computed_blocks(t, "s")
    # The session's block, then the cache hits past it.
    assert ids(computed.blocks) == [0, 1, 2] and computed.num_cached_tokens == 12
    assert (computed.session_outcome, computed.num_session_tokens) == (SessionOutcome.LOADED, 4)
    kv.pool.reset_prefix_cache()
    computed = kv.find_computed_blocks(t, "s")
    assert ids(computed.blocks) == [0] and computed.num_cached_tokens == 4
    assert kv.allocate_slots(t, t.num_tokens - 4, computed)
    assert ids(t.blocks) == [0, 3, 4, 5] and kv.pool.blocks[0].ref_cnt == 1


def test_session_outcomes_compare_tenants_and_tokens():
    kv = manager(10)
    s = make_seq(kv, "s", range(9), tenant="alice")
    admit(kv, s)
    kv.pin_sequence("s", s, 8)
    kv.free(s)

    def outcome(tokens, tenant="alice", session="s"):
        seq = make_seq(kv, "q", tokens, tenant=tenant)
        computed = kv.find_computed_blocks(seq, session)
        return computed.session_outcome, ids(computed.blocks)

    assert outcome(range(9), session="nope") == (SessionOutcome.NOT_FOUND, [0, 1])
    assert outcome(range(9), tenant="bob") == (SessionOutcome.TENANT_MISMATCH, [])
    assert outcome([7, *range(1, 9)]) == (SessionOutcome.NO_COMMON_PREFIX, [])
    assert outcome(range(4)) == (SessionOutcome.NO_COMMON_PREFIX, [])  # never the last token
    assert outcome(range(6)) == (SessionOutcome.LOADED, [0])


def test_resident_blocks_and_loading_a_session_into_a_sequence():
    kv = manager(10)
    s = make_seq(kv, "s", range(9), tenant="alice")
    admit(kv, s)
    assert ids(kv.resident_blocks(list(range(8)), "alice")) == [0, 1]
    assert ids(kv.resident_blocks([0, 1, 2, 3, 9, 9, 9, 9], "alice")) == [0]
    assert kv.resident_blocks(list(range(8)), "bob") == []  # another tenant's keys
    session = kv.pin("named", "alice", list(range(8)), kv.resident_blocks(list(range(8)), "alice"))
    kv.free(s)
    held = make_seq(kv, "h", range(8), tenant="alice")
    assert kv.load_into(held, session) == 8
    assert ids(held.blocks) == [0, 1] and held.num_registered_blocks == 2
    assert [(b.ref_cnt, b.pin_cnt) for b in held.blocks] == [(1, 1), (1, 1)]
    assert kv.unpin("named") and not kv.unpin("named")
    kv.free(held)
    assert kv.pool.num_held_blocks == 0


def saved(kv: KVCacheManager, session_id: str, tokens, tenant: str = "alice") -> None:
    """Compute ``tokens`` in a sequence, pin its full blocks as ``session_id``, free it."""
    seq = make_seq(kv, session_id, tokens, tenant=tenant)
    admit(kv, seq)
    kv.pin_sequence(session_id, seq, len(seq.token_ids))
    kv.free(seq)


def test_matching_loads_the_tenants_session_with_the_deepest_shared_prefix():
    kv = manager(16)
    saved(kv, "short", range(4))  # block 0
    saved(kv, "long", [*range(8), 50, 51, 52, 53])  # blocks 0, 1, 2
    saved(kv, "other", [*range(8), 60, 61, 62, 63])  # blocks 0, 1, 3

    def match(tokens, tenant="alice"):
        seq = make_seq(kv, "q", tokens, tenant=tenant, match_session=True)
        computed = kv.find_computed_blocks(seq)
        name = computed.session.session_id if computed.session else None
        return name, computed.num_session_tokens, ids(computed.blocks)

    # Three blocks shared with "long" only: its blocks, the last prompt token left to compute.
    assert match([*range(8), 50, 51, 52, 53, 7]) == ("long", 12, [0, 1, 2])
    # Two blocks shared with both "long" and "other": the more recently used ("other").
    assert match([*range(8), 9]) == ("other", 8, [0, 1])
    # Never the block holding the last prompt token: 8 tokens match one block, not two.
    assert match(range(8)) == ("other", 4, [0])
    # One block, held by all three: the most recently used ("other": finding takes nothing
    # and touches no LRU order, only a load at allocate_slots does).
    assert match([0, 1, 2, 3, 99]) == ("other", 4, [0])
    assert match([1, 2, 3, 4, 5]) == (None, 0, [])  # no shared first block
    assert match([*range(8), 9], tenant="bob") == (None, 0, [])  # another tenant's hashes


def test_of_equal_matches_the_session_holding_a_block_past_them_is_taken():
    """Its next block can serve the prompt's partial tail; a session that ends where the
    match does cannot, however recently used."""
    kv = manager(16)
    saved(kv, "longer", [*range(8), 50])  # blocks 0, 1
    saved(kv, "shorter", range(4))  # block 0, used last
    seq = make_seq(kv, "q", [0, 1, 2, 3, 4, 5, 6], tenant="alice", match_session=True)
    computed = kv.find_computed_blocks(seq)
    assert (computed.session.session_id, computed.num_session_tokens) == ("longer", 4)


def test_matching_follows_saves_replacements_deletes_and_expiry():
    kv = manager(16, budget=2)
    saved(kv, "a", [*range(8), 9])
    seq = make_seq(kv, "q", [*range(8), 9, 10], tenant="alice", match_session=True)
    assert kv.find_computed_blocks(seq).session.session_id == "a"
    saved(kv, "a", [0, 1, 2, 3, 70, 71, 72, 73, 74])  # replaced: now shares one block
    computed = kv.find_computed_blocks(seq)
    assert (computed.session.session_id, computed.num_session_tokens) == ("a", 4)
    saved(kv, "b", range(100, 105))
    saved(kv, "c", range(200, 205))  # the budget of 2 expires "a", the least recently used
    assert kv.get_session("a") is None
    assert kv.find_computed_blocks(seq).session is None
    assert kv.unpin("c")
    seq = make_seq(kv, "q2", range(200, 206), tenant="alice", match_session=True)
    assert kv.find_computed_blocks(seq).session is None
    assert kv.sessions._by_hash.keys() == {h for s in kv.sessions.sessions() for h in s.block_hashes}


def test_an_explicit_load_session_wins_over_matching():
    kv = manager(16)
    saved(kv, "one", [*range(4), 9])
    saved(kv, "two", [*range(8), 9])
    seq = make_seq(kv, "q", [*range(8), 5], tenant="alice", load_session="one", match_session=True)
    computed = kv.find_computed_blocks(seq, "one")
    assert (computed.session.session_id, computed.num_session_tokens) == ("one", 4)
