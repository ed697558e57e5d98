"""Reuse inside a block without a model: a freed sequence's partial last block (and a full
block a prompt ends inside) serves the next prompt's tokens up to the one before its last,
copied into the sequence's own block. Exact block ids, exact copies, exact queue order."""

from __future__ import annotations

from station.core.block_pool import tail_key
from station.core.kv_manager import KVCacheManager
from station.core.scheduler import Scheduler
from station.core.sequence import Sequence
from tests.station.core.test_kv_forks import Copies
from tests.station.core.test_kv_manager import Clock, ids, make_seq

BS = 4


def manager(num_blocks: int, copies: Copies) -> KVCacheManager:
    return KVCacheManager(num_blocks, BS, 2, model_fingerprint="fp", tenant_salt="salt",
                          clock=Clock(), copy_block=copies)


def admit(kv: KVCacheManager, seq_id: str, tokens, tenant: str = "") -> Sequence:
    """Admit like the scheduler does; the sequence's computed count is where it starts."""
    seq = make_seq(kv, seq_id, tokens, tenant)
    computed = kv.find_computed_blocks(seq)
    assert kv.allocate_slots(seq, seq.num_tokens - computed.num_cached_tokens, computed)
    return seq


def compute_and_free(kv: KVCacheManager, seq: Sequence, num_computed: int | None = None) -> None:
    """Pretend the forward computed ``num_computed`` tokens (all by default), then free it."""
    seq.num_computed_tokens = seq.num_tokens if num_computed is None else num_computed
    kv.cache_full_blocks(seq)
    kv.free(seq)


def test_the_same_prompt_again_starts_at_its_last_token_from_a_copy_of_the_tail():
    copies = Copies()
    kv = manager(8, copies)
    first = admit(kv, "a", range(10))  # 2 full blocks + 2 tokens
    assert first.num_computed_tokens == 0 and ids(first.blocks) == [0, 1, 2]
    compute_and_free(kv, first)
    tail = kv.pool.blocks[2]
    assert (tail.block_hash, tail.token_ids) == (None, (8, 9)) and kv.pool.num_partial_blocks == 1
    assert kv.pool.free_queue_ids() == [3, 4, 5, 6, 7, 2, 1, 0]  # the tail goes before its chain
    again = make_seq(kv, "b", range(10))
    computed = kv.find_computed_blocks(again)
    assert ids(computed.blocks) == [0, 1] and computed.tail is tail
    assert computed.num_cached_tokens == 9  # never the last prompt token
    assert kv.allocate_slots(again, 1, computed)
    assert ids(again.blocks) == [0, 1, 3] and again.num_computed_tokens == 9
    assert copies.made == [(2, 3)]  # into its own block: it writes token 9 and on there
    assert tail.token_ids == (8, 9) and tail.ref_cnt == 0  # the cached one stays as it was
    assert kv.pool.free_queue_ids() == [4, 5, 6, 7, 2]  # and its LRU place is refreshed
    assert kv.pool.stats()["blocks_cached_partial"] == 1


def test_a_prompt_that_extends_or_departs_mid_block_reuses_up_to_the_shared_token():
    copies = Copies()
    kv = manager(16, copies)
    compute_and_free(kv, admit(kv, "a", range(10)))
    longer = admit(kv, "b", [*range(10), 50, 51, 52])
    assert ids(longer.blocks) == [0, 1, 3, 4]
    assert (longer.num_computed_tokens, copies.made) == (10, [(2, 3)])
    departs = admit(kv, "c", [*range(9), 99, 98])
    assert (departs.num_computed_tokens, copies.made[-1]) == (9, (2, 5))
    elsewhere = admit(kv, "d", [*range(8), 77, 9])  # the block's first token differs
    assert elsewhere.num_computed_tokens == 8 and len(copies.made) == 2


def test_a_prompt_ending_inside_a_cached_full_block_takes_a_prefix_of_it():
    copies = Copies()
    kv = manager(8, copies)
    compute_and_free(kv, admit(kv, "a", range(8)))  # two full blocks, no partial one
    assert kv.pool.num_partial_blocks == 0
    again = admit(kv, "b", range(8))  # the hit stops at 1 block: 7 // 4
    assert ids(again.blocks) == [0, 2] and again.num_computed_tokens == 7
    assert copies.made == [(1, 2)] and kv.pool.blocks[1].block_hash is not None


def test_a_held_full_block_serves_a_copy_of_its_prefix():
    copies = Copies()
    kv = manager(8, copies)
    running = admit(kv, "a", [*range(8), 40])
    running.num_computed_tokens = 8
    kv.cache_full_blocks(running)  # block 1 is full, computed, and still held
    other = admit(kv, "b", [*range(6), 60])
    assert other.num_computed_tokens == 6 and copies.made == [(1, 3)]
    assert [b.ref_cnt for b in running.blocks] == [2, 1, 1]


def test_another_tenants_identical_prompt_reuses_nothing():
    copies = Copies()
    kv = manager(8, copies)
    compute_and_free(kv, admit(kv, "a", range(10), tenant="alice"))
    bob = admit(kv, "b", range(10), tenant="bob")
    assert bob.num_computed_tokens == 0 and copies.made == []
    alice = make_seq(kv, "c", range(10), tenant="alice")
    assert kv.find_computed_blocks(alice).num_cached_tokens == 9
    # The tail key is the chain before the block with the tenant's keys: bob's differs.
    assert tail_key(None, kv.extra_keys("alice")) != tail_key(None, kv.extra_keys("bob"))


def test_a_pool_under_pressure_evicts_cached_tails_before_failing():
    copies = Copies()
    kv = manager(3, copies)
    compute_and_free(kv, admit(kv, "a", range(6)))  # block 0 full, block 1 partial (4, 5)
    assert kv.pool.free_queue_ids() == [2, 1, 0] and kv.pool.num_partial_blocks == 1
    big = admit(kv, "b", range(100, 112))  # needs every block: the tail is evicted with the rest
    assert ids(big.blocks) == [2, 1, 0]
    assert kv.pool.num_partial_blocks == 0 and kv.pool.tails == {}
    assert kv.pool.blocks[1].token_ids == ()
    compute_and_free(kv, big)
    again = admit(kv, "c", range(6))  # block 1 was written since: nothing stale is served
    assert again.num_computed_tokens == 0 and copies.made == []


def test_a_tail_is_dropped_rather_than_counted_against_a_full_pool():
    copies = Copies()
    kv = manager(2, copies)
    compute_and_free(kv, admit(kv, "a", range(6)))
    again = make_seq(kv, "b", range(6))
    computed = kv.find_computed_blocks(again)
    assert computed.tail is kv.pool.blocks[1] and computed.num_cached_tokens == 5
    # Keeping the tail for its copy would need 3 blocks of 2: it starts after the full block.
    assert kv.allocate_slots(again, 1, computed)
    assert ids(again.blocks) == [0, 1] and again.num_computed_tokens == 4
    assert copies.made == [] and kv.pool.num_partial_blocks == 0


def test_a_reused_block_is_never_served_as_its_old_tail():
    copies = Copies()
    kv = manager(4, copies)
    compute_and_free(kv, admit(kv, "a", range(6)))  # queue [2, 3, 1, 0]: block 1 holds (4, 5)
    other = admit(kv, "b", range(200, 212))  # takes 2, 3 and then 1
    assert ids(other.blocks) == [2, 3, 1] and kv.pool.num_partial_blocks == 0
    compute_and_free(kv, other)  # block 1 is full now, of other tokens under another chain
    assert kv.pool.blocks[1].token_ids == (208, 209, 210, 211)
    again = admit(kv, "c", range(6))
    assert again.num_computed_tokens == 4 and copies.made == []


def test_a_tail_covered_by_a_cached_one_is_not_filed_and_a_longer_one_replaces_it():
    copies = Copies()
    kv = manager(8, copies)
    compute_and_free(kv, admit(kv, "a", range(10)))  # block 2 holds (8, 9)
    longer = admit(kv, "b", range(11))  # starts at 10 from a copy in block 3
    compute_and_free(kv, longer)  # block 3 holds (8, 9, 10): block 2 is worth nothing now
    assert (kv.pool.blocks[2].token_ids, kv.pool.blocks[3].token_ids) == ((), (8, 9, 10))
    assert kv.pool.num_partial_blocks == 1 and kv.pool.free_queue_ids()[0] == 2
    same = admit(kv, "c", range(10))  # 9 tokens from block 3's copy
    assert same.num_computed_tokens == 9 and copies.made[-1] == (3, same.blocks[2].block_id)
    compute_and_free(kv, same)  # (8, 9) is in block 3 already: its block is not filed
    assert kv.pool.num_partial_blocks == 1 and same.blocks == []


def test_a_preempted_sequence_leaves_the_tokens_it_computed():
    copies = Copies()
    kv = manager(8, copies)
    seq = admit(kv, "a", range(14))
    compute_and_free(kv, seq, num_computed=6)  # preempted mid-prefill: 6 of 14 computed
    assert kv.pool.blocks[1].token_ids == (4, 5)
    again = admit(kv, "a", range(14))
    assert again.num_computed_tokens == 6 and copies.made == [(1, again.blocks[1].block_id)]


def test_reset_prefix_cache_forgets_the_tails():
    copies = Copies()
    kv = manager(8, copies)
    compute_and_free(kv, admit(kv, "a", range(10)))
    kv.pool.reset_prefix_cache()
    assert kv.pool.tails == {} and kv.pool.num_partial_blocks == 0
    assert admit(kv, "b", range(10)).num_computed_tokens == 0


def test_no_copy_hook_no_tails():
    kv = KVCacheManager(8, BS)
    compute_and_free(kv, admit(kv, "a", range(10)))
    assert kv.pool.num_partial_blocks == 0
    assert admit(kv, "b", range(10)).num_computed_tokens == 8


def test_the_scheduler_starts_a_tail_hit_at_its_last_token_and_reports_it():
    copies = Copies()
    kv = manager(8, copies)
    sched = Scheduler(kv, max_batch_size=4, prefill_chunk_tokens=16)
    first = make_seq(kv, "a", range(10))
    sched.add(first)
    out = sched.schedule()
    assert [(s.seq_id, n) for s, n in out.prefills] == [("a", 10)]
    sched.on_step_done(out)
    sched.finish(first, "stop")
    again = make_seq(kv, "b", range(10))
    sched.add(again)
    out = sched.schedule()
    assert [(s.seq_id, n) for s, n in out.prefills] == [("b", 1)]  # one row: the last token
    assert (again.num_cached_tokens, again.num_admitted_cached_tokens) == (9, 9)
    assert (sched.prefix_cache_queries_tokens, sched.prefix_cache_hits_tokens) == (20, 9)
    sched.on_step_done(out)
    assert again.num_computed_tokens == 10 and sched.prefill_tokens == 11
