"""The KV cache manager's fork (a choice of an ``n > 1`` generate takes its parent's prompt
KV) and the block references it hands the disk tier: exact block ids, exact ref counts,
exact copies asked of the KV tensors' hook."""

from __future__ import annotations

from station.core.disk_sessions import DiskSession
from station.core.kv_manager import KVCacheManager
from station.core.scheduler import Scheduler
from station.core.sequence import Sequence, SequenceStatus
from tests.station.core.test_kv_manager import admit, ids, make_seq

BS = 4


class Copies:
    """The copy hook: records each (src, dst) block copy the manager asks for."""

    def __init__(self) -> None:
        self.made: list[tuple[int, int]] = []

    def __call__(self, src: int, dst: int) -> None:
        self.made.append((src, dst))


def prefilled(kv: KVCacheManager, tokens) -> Sequence:
    """A parent whose whole prompt is computed, as after its prefill step."""
    parent = make_seq(kv, "p", tokens)
    admit(kv, parent)
    return parent


def test_fork_shares_the_full_blocks_and_copies_the_partial_one():
    copies = Copies()
    kv = KVCacheManager(8, BS, copy_block=copies)
    parent = prefilled(kv, range(10))  # 2 full blocks + 2 tokens
    child = make_seq(kv, "p#1", range(10))
    assert kv.fork(parent, child)
    assert ids(parent.blocks) == [0, 1, 2] and ids(child.blocks) == [0, 1, 3]
    assert copies.made == [(2, 3)]  # the partial block, into the child's own
    assert [b.ref_cnt for b in kv.pool.blocks[:4]] == [2, 2, 1, 1]
    assert child.block_hashes == parent.block_hashes[:2] and child.num_registered_blocks == 2
    assert kv.pool.num_allocated == 4  # the prompt's blocks once, and the copy
    kv.free(child)
    kv.free(parent)
    assert kv.pool.num_held_blocks == 0


def test_a_prompt_of_full_blocks_forks_without_a_copy():
    kv = KVCacheManager(4, BS)  # no copy hook: nothing needs one
    parent = prefilled(kv, range(8))
    child = make_seq(kv, "p#1", range(8))
    assert kv.fork(parent, child)
    assert ids(child.blocks) == [0, 1] and [b.ref_cnt for b in parent.blocks] == [2, 2]
    assert kv.pool.num_allocated == 2


def test_fork_takes_nothing_when_no_block_is_free_for_the_copy():
    copies = Copies()
    kv = KVCacheManager(3, BS, copy_block=copies)
    parent = prefilled(kv, range(10))  # all 3 blocks
    child = make_seq(kv, "p#1", range(10))
    assert not kv.fork(parent, child)
    assert child.blocks == [] and copies.made == []
    assert [b.ref_cnt for b in kv.pool.blocks] == [1, 1, 1]


def test_the_scheduler_runs_a_fork_from_the_prompts_end_or_queues_it_first():
    kv = KVCacheManager(4, BS, copy_block=Copies())
    sched = Scheduler(kv, max_batch_size=8, prefill_chunk_tokens=64)
    parent = make_seq(kv, "p", range(10))
    sched.add(parent)
    out = sched.schedule()
    sched.on_step_done(out)
    child, other = make_seq(kv, "p#1", range(10)), make_seq(kv, "p#2", range(10))
    assert sched.add_fork(parent, child)
    assert child.status is SequenceStatus.RUNNING and sched.running == [parent, child]
    assert (child.num_computed_tokens, child.num_cached_tokens) == (10, parent.num_cached_tokens)
    assert ids(child.blocks) == [0, 1, 3]
    # The pool is full now: the next choice waits at the head of the queue, holding nothing.
    waiting = make_seq(kv, "w", range(50, 53))
    sched.add(waiting)
    assert not sched.add_fork(parent, other)
    assert other.status is SequenceStatus.WAITING and other.blocks == []
    assert list(sched.waiting) == [other, waiting]


def test_held_blocks_outlive_their_session_until_released():
    kv = KVCacheManager(4, BS, 2)
    seq = prefilled(kv, range(9))
    session = kv.pin("s", "", list(range(8)), seq.blocks[:2])
    kv.free(seq)
    held = kv.hold_blocks(session.blocks)  # a disk write reads them
    assert held == [0, 1] and [b.ref_cnt for b in kv.pool.blocks[:2]] == [1, 1]
    assert kv.unpin("s")
    assert kv.pool.free_queue_ids() == [2, 3]  # neither evictable nor reused meanwhile
    kv.release_blocks(held)
    assert [b.ref_cnt for b in kv.pool.blocks[:2]] == [0, 0]
    assert sorted(kv.pool.free_queue_ids()) == [0, 1, 2, 3]


def test_adopting_a_disk_session_replaces_the_pools_copy_of_its_id():
    kv = KVCacheManager(4, BS, 2)
    seq = prefilled(kv, range(9))
    kv.pin("s", "", list(range(8)), seq.blocks[:2])
    kv.free(seq)
    assert [b.pin_cnt for b in kv.pool.blocks[:2]] == [1, 1]
    later = DiskSession("s", "", tuple(range(12)), (b"h1", b"h2", b"h3"), (b"f1", b"f2", b"f3"), 5.0)
    kv.adopt_disk_session(later)
    assert kv.get_session("s") is None and [b.pin_cnt for b in kv.pool.blocks[:2]] == [0, 0]
    assert kv.disk.get("s") is later
    fresh = DiskSession("t", "", tuple(range(4)), (b"h4",), (b"f4",), 6.0)
    kv.adopt_disk_session(fresh)  # no resident copy: only indexed
    assert kv.disk.get("t") is fresh and len(kv.disk) == 2
