"""Scheduler policy without a model: chunked prefill, prefix hits, waiting, preemption, abort."""

from __future__ import annotations

from station.core.block_pool import prefix_extra_keys
from station.core.kv_manager import KVCacheManager
from station.core.requests import SamplingParams
from station.core.scheduler import Scheduler
from station.core.sequence import Sequence, SequenceStatus

BS = 4
KEYS = prefix_extra_keys("fp", "", "")


def make_seq(seq_id: str, tokens: list[int]) -> Sequence:
    return Sequence(seq_id, list(tokens), SamplingParams(max_tokens=100), extra_keys=KEYS)


def step(sched: Scheduler):
    """Run one step the way the engine does, sampling a fake token where logits exist."""
    out = sched.schedule()
    sched.on_step_done(out)
    sampled = list(out.decodes) + [s for s, _ in out.prefills if s.num_computed_tokens == s.num_tokens]
    for seq in sampled:
        seq.token_ids.append(1000 + seq.num_tokens)
    return out


def summary(out):
    return ([s.seq_id for s in out.decodes], [(s.seq_id, n) for s, n in out.prefills],
            [s.seq_id for s in out.preempted])


def test_chunked_prefill_interleaves_with_decode():
    sched = Scheduler(KVCacheManager(16, BS), max_batch_size=8, prefill_chunk_tokens=4)
    sched.add(make_seq("a", range(3)))
    assert summary(step(sched)) == ([], [("a", 3)], [])
    sched.add(make_seq("b", range(100, 110)))
    assert summary(step(sched)) == (["a"], [("b", 4)], [])
    assert summary(step(sched)) == (["a"], [("b", 4)], [])
    assert summary(step(sched)) == (["a"], [("b", 2)], [])
    assert summary(step(sched)) == (["a", "b"], [], [])
    b = sched.running[1]
    assert b.num_tokens == 12 and b.num_computed_tokens == 11


def test_prefix_hit_skips_cached_tokens_and_counts():
    sched = Scheduler(KVCacheManager(16, BS), max_batch_size=8, prefill_chunk_tokens=64)
    pool = sched.kv.pool
    prompt = list(range(10))
    a = make_seq("a", prompt)
    sched.add(a)
    step(sched)
    sched.finish(a, "stop")
    assert pool.num_held_blocks == 0 and pool.num_cached_blocks == 2
    b = make_seq("b", prompt)
    sched.add(b)
    assert summary(step(sched)) == ([], [("b", 2)], [])
    assert b.num_cached_tokens == 8
    assert [blk.block_id for blk in b.blocks] == [0, 1, 2]  # hits 0,1; uncached 2 reused first
    assert (sched.prefix_cache_queries_tokens, sched.prefix_cache_hits_tokens) == (20, 8)


def test_requests_wait_when_blocks_run_out_and_run_later():
    sched = Scheduler(KVCacheManager(4, BS), max_batch_size=8, prefill_chunk_tokens=64)
    sched.add(make_seq("a", range(12)))      # 3 blocks
    sched.add(make_seq("b", range(50, 58)))  # 2 blocks: does not fit next to a
    assert summary(step(sched)) == ([], [("a", 12)], [])
    assert [s.seq_id for s in sched.waiting] == ["b"]
    sched.finish(sched.running[0], "stop")
    assert summary(step(sched)) == ([], [("b", 8)], [])


def test_decode_preempts_newest_and_recompute_hits_its_cached_blocks():
    sched = Scheduler(KVCacheManager(4, BS), max_batch_size=8, prefill_chunk_tokens=64)
    sched.add(make_seq("a", range(7)))
    sched.add(make_seq("b", range(20, 27)))
    assert summary(step(sched)) == ([], [("a", 7), ("b", 7)], [])
    # Both now hold 8 tokens (7 computed): the next decode fits in their 2 blocks each.
    assert summary(step(sched)) == (["a", "b"], [], [])
    # a needs a 3rd block: the newest (b) is preempted, its blocks freed.
    out = step(sched)
    assert summary(out) == (["a"], [], ["b"])
    b = out.preempted[0]
    assert b.status is SequenceStatus.WAITING and b.blocks == [] and b.num_computed_tokens == 0
    assert b.num_tokens == 9 and sched.num_preemptions == 1
    sched.finish(sched.running[0], "stop")
    # b comes back first in line; its first full block was cached, so only 5 tokens recompute.
    assert summary(step(sched)) == ([], [("b", 5)], [])
    assert b.num_cached_tokens == 0  # the reported hit is the first admission's
    assert b.token_ids[:7] == list(range(20, 27))


def test_single_sequence_larger_than_pool_ends_with_length():
    sched = Scheduler(KVCacheManager(2, BS), max_batch_size=8, prefill_chunk_tokens=64)
    pool = sched.kv.pool
    seq = make_seq("a", range(7))
    sched.add(seq)
    step(sched)
    step(sched)  # 9 tokens: fits the 8-token pool no longer
    out = step(sched)
    assert out.finished == [seq] and seq.finish_reason == "length"
    assert pool.num_held_blocks == 0 and not sched.has_unfinished()


def test_abort_frees_blocks_at_once():
    sched = Scheduler(KVCacheManager(8, BS), max_batch_size=8, prefill_chunk_tokens=64)
    pool = sched.kv.pool
    sched.add(make_seq("a", range(9)))
    sched.add(make_seq("w", range(9)))
    sched.max_batch_size = 1
    step(sched)
    assert pool.num_held_blocks == 3
    assert sched.abort("a").finish_reason == "cancelled"
    assert sched.abort("w").finish_reason == "cancelled"
    assert sched.abort("nope") is None
    assert pool.num_held_blocks == 0 and not sched.has_unfinished()
    assert all(b.ref_cnt == 0 for b in pool.blocks)


def test_max_batch_size_caps_running():
    sched = Scheduler(KVCacheManager(32, BS), max_batch_size=2, prefill_chunk_tokens=64)
    for i in range(3):
        sched.add(make_seq(str(i), range(i * 10, i * 10 + 3)))
    assert summary(step(sched)) == ([], [("0", 3), ("1", 3)], [])
    assert summary(step(sched)) == (["0", "1"], [], [])
