"""Continuous-batching scheduler: which sequences run in the next forward (pure Python).

A step = one decode token for every running sequence whose prompt is done, plus prefill
chunks of at most ``prefill_chunk_tokens`` tokens in total (the sequence already
mid-prefill first, then new admissions in arrival order). So a long prompt is prefilled in
chunks interleaved with everyone else's decode steps, and decoding never stalls behind it.

Admission asks the KV cache manager (``station.core.kv_manager``) for the blocks the
prompt can start from (a loaded session's, then prefix-cache hits, then a cached tail's
first tokens: those tokens skip prefill, up to the last prompt token) and then for blocks
for the whole prompt at once (two-phase: ``find_computed_blocks`` then ``allocate_slots``,
which expires KV sessions before it fails); a request that does not fit waits, in order. A
decoding sequence that needs a new block and finds none preempts the newest running
sequence: its blocks are freed (they stay in the prefix cache, its partial last block too,
so the recompute usually hits them) and it goes back to the head of the waiting queue.
Nothing here raises on exhaustion.

Held sequences (``forward``/``decode_next``) are ``park``ed between calls (they keep their
blocks and are not scheduled) and ``resume``d with new tokens; a resumed sequence gets
blocks for its new tokens like a decode does. ``park_loaded`` parks a new held sequence on
a KV session's blocks (``kv_session.load``). ``add_fork`` runs a choice of an ``n > 1``
generate on its parent's prompt KV once the parent's prompt is prefilled.

The scheduler owns the queues and the order of work; the manager owns every block. Neither
touches tensors.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field, replace

from station.core.kv_manager import KVCacheManager
from station.core.kv_results import ComputedBlocks, LoadPlan, SessionOutcome
from station.core.sequence import Sequence, SequenceStatus
from station.core.sessions import KVSession


@dataclass(slots=True)
class SchedulerOutput:
    decodes: list[Sequence] = field(default_factory=list)  # one new token each, then sample
    prefills: list[tuple[Sequence, int]] = field(default_factory=list)  # (seq, tokens this step)
    preempted: list[Sequence] = field(default_factory=list)
    finished: list[Sequence] = field(default_factory=list)  # ended by the scheduler (no room)
    loads: list[LoadPlan] = field(default_factory=list)  # disk sessions to read back
    forked: list[Sequence] = field(default_factory=list)  # choices forked after this step

    @property
    def is_empty(self) -> bool:
        return not self.decodes and not self.prefills

    @property
    def num_tokens(self) -> int:
        return len(self.decodes) + sum(n for _, n in self.prefills)


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_batch_size: int, prefill_chunk_tokens: int) -> None:
        self.kv = kv
        self.block_size = kv.block_size
        self.max_batch_size = max_batch_size
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order: the last one is preempted first
        self.prefix_cache_queries_tokens = 0
        self.prefix_cache_hits_tokens = 0
        self.num_preemptions = 0
        self.prefill_tokens = 0  # tokens computed in prefill chunks since start (stats)

    # -- queue management
    def add(self, seq: Sequence) -> None:
        assert seq.status is SequenceStatus.WAITING and not seq.blocks
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def has_runnable(self) -> bool:
        """Work a step can do now: not only sequences waiting for a disk read."""
        return bool(self.running) or any(s.awaiting_load is None for s in self.waiting)

    def on_load_done(self, plan: LoadPlan, error: SessionOutcome | None) -> None:
        """A disk session was read back (or could not be, ``error``): its waiters may be admitted."""
        for seq in self.waiting:
            if seq.awaiting_load is plan.session:
                seq.awaiting_load = None
                seq.loaded_tier = plan.session.read_from if error is None else None
                seq.load_error = error

    def get(self, seq_id: str) -> Sequence | None:
        for seq in (*self.running, *self.waiting):
            if seq.seq_id == seq_id:
                return seq
        return None

    def abort(self, seq_id: str) -> Sequence | None:
        """End a sequence now and free its blocks; None if it is not here."""
        for seq in (*self.running, *self.waiting):
            if seq.seq_id == seq_id:
                self.finish(seq, "cancelled")
                return seq
        return None

    def finish(self, seq: Sequence, reason: str) -> None:
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        elif seq.status is not SequenceStatus.PARKED:
            return
        self._release(seq)
        seq.finish(reason)

    def park(self, seq: Sequence) -> None:
        """A held sequence whose call is done: keep its blocks, stop scheduling it."""
        assert seq.status is SequenceStatus.RUNNING and seq.num_uncomputed_tokens == 0
        self.running.remove(seq)
        seq.change_status(SequenceStatus.PARKED)

    def park_loaded(self, seq: Sequence, session: KVSession) -> None:
        """A new held sequence of a session's tokens: park it on the session's blocks, its
        KV all computed, so its next ``forward`` only computes what it appends."""
        assert seq.status is SequenceStatus.WAITING and not seq.blocks
        seq.num_computed_tokens = self.kv.load_into(seq, session)
        seq.change_status(SequenceStatus.PARKED)

    def resume(self, seq: Sequence) -> None:
        """A parked sequence got new tokens (appended by the caller): schedule it again."""
        assert seq.status is SequenceStatus.PARKED and seq.num_uncomputed_tokens > 0
        seq.change_status(SequenceStatus.RUNNING)
        self.running.append(seq)

    def add_fork(self, parent: Sequence, child: Sequence) -> bool:
        """Run ``child``, a choice of ``parent``'s prompt, on the parent's prompt KV
        (``KVCacheManager.fork``): computed up to the prompt's end, it joins the running
        batch. False: the pool has no block for its copy of the partial block, so it waits at
        the head of the queue to run as a sequence of its own (its full blocks are cache hits)."""
        assert child.status is SequenceStatus.WAITING and not child.blocks
        if not self.kv.fork(parent, child):
            self.waiting.appendleft(child)
            return False
        child.num_computed_tokens = parent.num_prompt_tokens
        child.num_cached_tokens = child.num_admitted_cached_tokens = parent.num_cached_tokens
        child.change_status(SequenceStatus.RUNNING)
        self.running.append(child)
        return True

    # -- the step
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        remaining = deque(self.running)
        kept: list[Sequence] = []
        deferred_prefills: list[Sequence] = []
        while remaining:
            seq = remaining.popleft()
            if seq.is_prefilling:
                # Admission gave it blocks for its whole prompt; a resumed held
                # sequence may need more for the tokens it was extended with.
                if self._ensure_blocks(seq, seq.num_tokens, remaining, kept,
                                       deferred_prefills, out):
                    kept.append(seq)
                    deferred_prefills.append(seq)
                continue
            if self._ensure_blocks(seq, seq.num_computed_tokens + 1, remaining, kept,
                                   deferred_prefills, out):
                out.decodes.append(seq)
                kept.append(seq)
        self.running = kept

        budget = self.prefill_chunk_tokens
        for seq in deferred_prefills:
            if budget == 0:
                break
            n = min(seq.num_uncomputed_tokens, budget)
            out.prefills.append((seq, n))
            budget -= n
        # Admit new work only when nothing had to be preempted this step.
        i = 0
        while (not out.preempted and budget > 0 and i < len(self.waiting)
               and len(self.running) < self.max_batch_size):
            seq = self.waiting[i]
            if seq.awaiting_load is None and self._admit(seq, out):
                del self.waiting[i]
            elif seq.awaiting_load is not None:
                i += 1  # its session is being read from disk: the others go past it
                continue
            else:
                break
            self.running.append(seq)
            n = min(seq.num_uncomputed_tokens, budget)
            out.prefills.append((seq, n))
            budget -= n
        return out

    def on_step_done(self, out: SchedulerOutput) -> None:
        """The forward ran: advance computed counts and offer newly full blocks to the cache."""
        for seq in out.decodes:
            seq.num_computed_tokens += 1
            self.kv.cache_full_blocks(seq)
        for seq, n in out.prefills:
            seq.num_computed_tokens += n
            self.prefill_tokens += n
            self.kv.cache_full_blocks(seq)

    # -- internals
    def _admit(self, seq: Sequence, out: SchedulerOutput) -> bool:
        first_admission = seq.num_preemptions == 0
        computed = self.kv.find_computed_blocks(seq, seq.load_session)
        if seq.prompt_logprobs is not None:  # every prompt row's logits are needed: no reuse
            computed = ComputedBlocks((), 0)
        if computed.session_outcome is SessionOutcome.ON_DISK:
            on_disk = computed.disk_session
            assert on_disk is not None  # ComputedBlocks holds one exactly when ON_DISK
            plan = None if on_disk.loading else self.kv.begin_load(on_disk)
            if on_disk.loading:  # being read back, for this sequence or another
                if plan is not None:
                    out.loads.append(plan)
                seq.awaiting_load = on_disk
                return False
            # The pool cannot hold it now: start without it (a miss) rather than wait.
            computed = replace(computed, session_outcome=None, disk_session=None)
        if first_admission:  # the prefill event reports the first admission
            outcome = computed.session_outcome
            if seq.load_error is not None and outcome in (None, SessionOutcome.NOT_FOUND):
                outcome = SessionOutcome(seq.load_error)
            seq.session_outcome = outcome
            seq.num_session_tokens = computed.num_session_tokens
            loaded = computed.session if computed.session is not None else computed.cached_disk_session
            seq.loaded_session = loaded.session_id if loaded is not None else None
            if loaded is not None:
                seq.session_tier = seq.loaded_tier or "pool"
        # It starts computing where the blocks it took end (allocate_slots sets the count).
        if not self.kv.allocate_slots(seq, seq.num_tokens - computed.num_cached_tokens, computed):
            return False
        seq.change_status(SequenceStatus.RUNNING)
        seq.num_admitted_cached_tokens = seq.num_computed_tokens
        if computed.end_logits is not None and seq.num_computed_tokens == seq.num_tokens:
            seq.start_logits = computed.end_logits  # its first step samples these, computing nothing
            self.kv.ends.num_served += 1
        if first_admission:
            seq.num_cached_tokens = seq.num_computed_tokens
            self.prefix_cache_queries_tokens += seq.num_tokens
            self.prefix_cache_hits_tokens += seq.num_computed_tokens
        return True

    def _ensure_blocks(self, seq: Sequence, num_tokens: int, remaining: deque[Sequence],
                       kept: list[Sequence], deferred: list[Sequence], out: SchedulerOutput) -> bool:
        """Give ``seq`` room for ``num_tokens``, preempting the newest others; False if ``seq`` lost."""
        num_new_tokens = num_tokens - seq.num_computed_tokens
        if self.kv.num_blocks_for(num_tokens) - len(seq.blocks) > self.kv.num_blocks:
            self._end_without_room(seq, out)
            return False
        # Parked sessions go before running work: only the first try expires them.
        reclaim = True
        while not self.kv.allocate_slots(seq, num_new_tokens, reclaim=reclaim):
            reclaim = False
            if remaining:
                victim = remaining.pop()
            elif deferred:
                victim = deferred.pop()
                kept.remove(victim)
            else:
                # Nobody newer to take from: step back ourselves. If no one else holds
                # blocks either, waiting cannot help (pinned blocks fill the pool).
                if not kept and self.kv.num_held_blocks == len(seq.blocks):
                    self._end_without_room(seq, out)
                else:
                    self._preempt(seq, out)
                return False
            self._preempt(victim, out)
        return True

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self._release(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.change_status(SequenceStatus.WAITING)
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
        out.preempted.append(seq)

    def _end_without_room(self, seq: Sequence, out: SchedulerOutput) -> None:
        self._release(seq)
        seq.finish("length")
        out.finished.append(seq)

    def _release(self, seq: Sequence) -> None:
        self.kv.free(seq)
