"""The station's engine: paged KV, automatic prefix cache, continuous batching.

One engine thread loops like nano-vllm's ``LLMEngine.step``: schedule -> run -> postprocess.
Every running sequence decodes in the same forward; prompts are prefilled in chunks beside
them; a prompt whose leading tokens are in the prefix cache skips them (whole blocks, then a
cached block's leading tokens, copied: ``station.core.tails``). A finished sequence's full
blocks and partial last block stay cached (evictable, LRU). What becomes of a sequence after its
step (its events, its end) is ``station.engine.outcomes``; the choices of an ``n > 1``
generate fork from their parent in ``station.engine.forks``. Each helper is handed the parts
it works on (the KV cache manager, the scheduler, the runner's rows), never the engine.

Resource handling: requests and aborts arrive under a lock and are applied at the next step
boundary (never mid-forward); an aborted or finished sequence frees its blocks at once.
``shutdown`` ends every unfinished request with a ``shutting_down`` error. A forward that
raises ends the sequences of that step with an ``internal`` error and frees their blocks;
the engine keeps serving everyone else.

Liquid memory: the KV cache manager (``station.core.kv_manager``) pins blocks under
session ids. A request with ``load_session`` starts from the session's blocks for the
prefix it shares with the prompt (found at admission); ``save_session`` pins the prompt's
full blocks when its prefill ends, ``save_final_session`` pins prompt+completion when it
finishes; generate's TTL ``pins`` are saved with the prefill too, and the loop wakes at a
pin's expiry to delete it from every tier (``station.engine.pinning``). Socket ops other
than ``generate`` arrive through ``call`` and run on this thread at a step boundary
(``station.engine.calls``); held sequences decode in the same batched forward as every
generate. ``embed`` is stepped: each loop iteration embeds a
bounded share of one call's inputs after the batched step. ``cancel_call`` drops a call
(queued, in progress, or waiting for its sequence's step).

Backpressure: at most ``max_waiting_requests`` sequences wait for admission; a ``generate``
or a ``forward`` that would make one more is refused at once (the retryable ``capacity``).
"""

from __future__ import annotations

import collections
import threading
import time
from typing import TYPE_CHECKING, Any, Callable

import torch

from gnosis_daemon.logs import get_logger
from gnosis_daemon.protocol import ErrorCode, OpError
from station.core.requests import (CallDone, EngineCallHandler, EventCallback, GenerationRequest,
                                   SequenceLimits)
from station.plan.choose import choose_plan
from station.engine import forks, pinning
from station.engine.calls import EngineCalls, answer
from station.engine.outcomes import Outcomes
from station.forward.kv_cache import KVCache, KVCacheShape, num_blocks_for
from station.tier.disk_tier import DiskTier
from station.forward.runner import ModelRunner
from station.core.kv_manager import KVCacheManager
from station.core.scheduler import Scheduler
from station.core.sequence import Sequence

if TYPE_CHECKING:
    from gnosis_daemon.settings import Settings
    from station.model.loader import LoadedModel

log = get_logger(__name__)


class PagedEngine:
    """the engine over a paged KV pool (see the module docstring)."""

    def __init__(self, loaded: LoadedModel, settings: Settings, num_blocks: int | None = None) -> None:
        """``num_blocks`` overrides the KV budget. The helpers (``EngineCalls``, the forks)
        get the parts they use, never the engine."""
        self.loaded = loaded
        self.settings = settings
        self.block_size = settings.kv_block_size
        self.max_model_len = loaded.max_model_len
        device = torch.device(loaded.device)
        # The decode plan (station.plan.choose): body, head, linear forms, static decode steps.
        plan, parts = choose_plan(loaded, settings)
        # The pool in the model's dtype, or in the dtype the C step keeps K/V in where it computes
        # every row (bfloat16 with its bfloat16 attention: twice the tokens in the same bytes).
        kv_dtype = parts.body.step.kv_dtype if parts.body.step is not None else loaded.dtype
        shape = KVCacheShape.from_config(loaded.model.config, self.block_size, kv_dtype)
        if num_blocks is None:
            num_blocks = num_blocks_for(shape, settings, device)
        # Shared for the disk tier's I/O process (a CPU pool that does not stage); scratch for graphs.
        self.kv_cache = KVCache(shape, num_blocks, device, scratch_blocks=int(parts.graphs is not None),
                                shared=settings.kv_persistence and not settings.kv_host_bytes)
        self.limits = SequenceLimits(loaded.max_model_len, loaded.vocab_size, self.block_size, num_blocks)
        self.kv = KVCacheManager(num_blocks, self.block_size, settings.kv_session_budget,
                                 tenant_share=settings.kv_session_tenant_share,
                                 model_fingerprint=loaded.fingerprint,
                                 tenant_salt=settings.tenant_salt,
                                 bytes_per_block=shape.bytes_per_block,
                                 pin_tenant_bytes=settings.kv_pin_tenant_bytes,
                                 copy_block=self.kv_cache.copy_block)
        self.scheduler = Scheduler(self.kv, settings.max_batch_size, settings.prefill_chunk_tokens)
        self.calls = EngineCalls(self.kv, self.scheduler, self.limits, loaded.model, device)
        self.outcomes = Outcomes(self.kv, self.scheduler, self.calls, self._forget,
                                 loaded.max_model_len)
        assert loaded.attention is not None  # load_model reads every layer's attention kind
        self.runner = ModelRunner(loaded.model, self.kv_cache, device, loaded.attention, plan, parts,
                                  max_positions=loaded.max_model_len)
        self.device = device
        self._cond = threading.Condition()
        self._inbox: collections.deque[Sequence] = collections.deque()
        self._aborts: dict[str, str] = {}  # request id -> finish reason (cancelled | stop)
        self._call_queue: collections.deque[
            tuple[EngineCallHandler, Any, CallDone | None, dict[str, Any]]] = collections.deque()
        self._cancels: set[CallDone] = set()  # calls to drop at the next step boundary
        self._known: set[str] = set()  # queued or running ids (duplicate check)
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.tier: DiskTier | None = None  # attach_disk_tier
        self.kv_events: Any = None  # kv_events.KVEventPublisher.attach
        # Called on this thread after each turn of the loop: the station's relay writes the
        # frames of the turn's events then (station.serving.stream.EventRelay.turn_done).
        self.turn_done: list[Callable[[], None]] = []
        # The health op's heartbeat: idle while the loop waits for work, else when it turned.
        self.num_steps, self.loop_idle, self.loop_turned = 0, True, time.monotonic()
        log.info("kv_pool_ready", num_blocks=num_blocks, block_size=self.block_size,
                 bytes_per_block=shape.bytes_per_block, bytes_total=self.kv_cache.bytes_total)
        self.kv_cache.prefault(lambda fields: log.info("kv_pool_prefaulted", **fields))

    # -- the server's interface (any thread)
    def start(self) -> None:
        """Run the engine loop on a new thread (tests and embedders)."""
        assert self._thread is None, "engine started twice"
        self._thread = threading.Thread(target=self._run, name="station-engine", daemon=True)
        self._thread.start()

    def run_here(self) -> None:
        """Run the engine loop on the calling thread until ``shutdown`` (the station's way:
        the thread that loaded the model keeps every torch op, see ``station.serving.server``)."""
        assert self._thread is None, "engine started twice"
        self._thread = threading.current_thread()
        self._run()

    def attach_disk_tier(self, io: Any, store_stats: dict[str, Any], slots: Any,
                         sessions: list[Any]) -> None:
        """Put the disk tier behind the pool (before ``start``): evicted durable sessions
        stay on disk, ``sessions`` (the tier's index at start) can be read back."""
        self.tier = DiskTier(io, store_stats, self.kv, slots, self._wake,
                             self.calls.on_load_done, self.settings.kv_write_behind_s)
        self.calls.tier = self.tier
        self.kv.enable_disk_tier(sessions)

    def _resync_wanted(self) -> bool:
        return self.kv_events is not None and self.kv_events.resync_wanted

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def shutdown(self, flush_tier: bool = True) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()
        if self.tier is not None:
            self.tier.close(flush=flush_tier)
        with self._cond:
            leftovers = [*self._inbox, *self.scheduler.running, *self.scheduler.waiting]
            calls = list(self._call_queue)
            for pending in (self._inbox, self._call_queue, self._known):
                pending.clear()
        for seq in leftovers:
            if seq in self.scheduler.running or seq in self.scheduler.waiting:
                self.scheduler.finish(seq, "shutting_down")
            self.outcomes.fail(seq, ErrorCode.SHUTTING_DOWN, "the station is shutting down")
        for _handler, _owner, done, _kwargs in calls:
            if done is not None:
                done(None, OpError(ErrorCode.SHUTTING_DOWN, "the station is shutting down"))
        self._end_turn()  # the leftovers' events (the loop's thread is gone: no race)
        self.calls.shutdown()

    def add_request(self, request: GenerationRequest, on_event: EventCallback) -> None:
        self.limits.check(list(request.prompt_ids), room=1)  # at least one token to generate
        seqs = forks.make_sequences(  # n > 1: the choices to fork
            request, on_event, extra_keys=self.kv.extra_keys(request.sessions.tenant),
            eos_token_ids=self.loaded.eos_token_ids, device=self.device)
        seq = seqs[0]
        with self._cond:
            if self._stopping:
                raise OpError(ErrorCode.SHUTTING_DOWN, "the station is shutting down")
            if request.request_id in self._known:
                raise OpError(ErrorCode.BAD_REQUEST,
                              f"request id {request.request_id!r} is already running")
            self._check_queue()
            self._known.update(s.seq_id for s in seqs)
            self._inbox.append(seq)
            self._cond.notify_all()

    def abort(self, request_id: str) -> None:
        with self._cond:
            if request_id in self._known:
                self._aborts.setdefault(request_id, "cancelled")
                self._cond.notify_all()

    def finish_early(self, request_id: str) -> None:
        """End a request as ``stop`` (the server found a stop string): unlike ``abort``, its
        ``save_final_session`` still applies and it ends with a ``finished`` event."""
        with self._cond:
            if request_id in self._known:
                self._aborts[request_id] = "stop"
                self._cond.notify_all()

    def call(self, handler: EngineCallHandler, owner: Any, done: CallDone, **kwargs: Any) -> None:
        """Queue an engine call (``handler``: an ``EngineCalls`` method). Raises
        ``OpError`` (capacity) for a ``forward`` that would make a new sequence wait
        past ``max_waiting_requests``."""
        with self._cond:
            if self._stopping:
                raise OpError(ErrorCode.SHUTTING_DOWN, "the station is shutting down")
            if EngineCalls.makes_sequence(handler, kwargs):
                self._check_queue()
            self._call_queue.append((handler, owner, done, kwargs))
            self._cond.notify_all()

    def cancel_call(self, done: CallDone) -> None:
        """Drop the call queued with ``done`` at the next step boundary (thread-safe,
        idempotent): it is answered ``cancelled`` and frees what it held (an embed's work,
        a held sequence whose ``forward``/``decode_next`` was in flight)."""
        with self._cond:
            if not self._stopping:
                self._cancels.add(done)
                self._cond.notify_all()

    def _check_queue(self) -> None:
        """Refuse a new waiting sequence past ``max_waiting_requests`` (lock held)."""
        waiting = (len(self._inbox) + len(self.scheduler.waiting)
                   + sum(EngineCalls.makes_sequence(handler, kwargs)
                         for handler, _, _, kwargs in self._call_queue))
        limit = self.settings.max_waiting_requests
        if waiting >= limit:
            raise OpError(ErrorCode.CAPACITY, f"{waiting} requests are already waiting in the "
                          f"station (max_waiting_requests {limit}); retry later")

    def release_owner(self, owner: Any) -> None:
        with self._cond:
            if not self._stopping:
                self._call_queue.append((EngineCalls.release_owner, owner, None, {}))
                self._cond.notify_all()

    def stats(self) -> dict[str, Any]:
        sched, num_inbox = self.scheduler, len(self._inbox)
        return {  # read without the engine lock: figures may be one step stale
            **self.kv.stats(),
            "prefix_cache_queries_tokens": sched.prefix_cache_queries_tokens,
            "prefix_cache_hits_tokens": sched.prefix_cache_hits_tokens,
            "running": len(sched.running),
            "waiting": len(sched.waiting) + num_inbox,
            "preemptions": sched.num_preemptions,
            "steps": self.num_steps,
            "prefill_tokens": sched.prefill_tokens,
            "host_sequences": len(self.calls.seqs),
            "embed_calls": len(self.calls.embeds),
            "embed_inputs": self.calls.embed_inputs_done,
            **(self.tier.stats() if self.tier is not None else {}), **self.runner.graph_stats(),
        }

    def capabilities(self) -> dict[str, bool]:
        return {"paged_kv": True, "prefix_cache": True, "continuous_batching": True,
                "kv_persistence": self.tier is not None, "kv_disk_tier": self.tier is not None}

    def drain(self) -> None:
        """Run the loop here until it has nothing to do (the start check, before ``run_here``)."""
        assert self._thread is None, "the engine loop is running"
        self._run(until_idle=True)

    # -- engine thread
    def _run(self, until_idle: bool = False) -> None:
        while True:
            with self._cond:
                while not (self._stopping or self._inbox or self._aborts or self._call_queue
                           or self._cancels or self.scheduler.has_runnable()
                           or self.calls.embeds or self._resync_wanted()
                           or (self.tier and self.tier.has_work())
                           or self.kv.pins.wait_s() == 0):
                    self.loop_idle = True
                    if until_idle:
                        return
                    self._cond.wait(self._idle_wait_s())  # a pin's expiry wakes it too
                self.loop_idle, self.loop_turned = False, time.monotonic()
                if self._stopping:
                    return
                new, aborts, calls = list(self._inbox), self._aborts, list(self._call_queue)
                cancels, self._cancels, self._aborts = self._cancels, set(), {}
                self._inbox.clear()
                self._call_queue.clear()
            for seq in new:
                self.scheduler.add(seq)
            for request_id, reason in aborts.items():
                if (aborted := self.scheduler.get(request_id)) is not None:
                    if reason == "stop":
                        self.outcomes.final_save(aborted)
                    self.scheduler.finish(aborted, reason)
                    self.outcomes.finished(aborted)
            for handler, owner, done, kwargs in calls:
                if done is not None and done in cancels:
                    cancels.discard(done)
                    answer(done, None, OpError(ErrorCode.CANCELLED, "request cancelled"))
                    continue
                self.calls.run(handler, owner, done, kwargs)
            if cancels:
                self.calls.cancel(cancels)
            if self._resync_wanted():  # the router's view was cut short: all of it again
                self.kv_events.resync(self.kv.pool.cached_ext_blocks())
            if self.kv.pins.wait_s() == 0:  # TTL pins past their expiry leave every tier
                pinning.expire(self.kv, self.tier)
            stepping = self.scheduler.has_runnable()
            if self.tier is not None:
                self.tier.before_step(stepping=stepping)
            if stepping:
                try:
                    self.step()
                finally:
                    if self.tier is not None:
                        self.tier.after_step()
            if self.calls.embeds:
                self.calls.embed_step(self.settings.prefill_chunk_tokens)
            self._end_turn()

    def _end_turn(self) -> None:
        for listener in self.turn_done:
            try:
                listener()
            except Exception:  # a broken listener must not kill the engine thread
                log.exception("engine_turn_listener_failed")

    def step(self) -> None:
        """schedule -> run -> postprocess (engine thread only)."""
        sched = self.scheduler
        out = sched.schedule()
        self.kv_cache.need(self.kv.pool.high_water)  # the next blocks' pages written in ahead
        if self.tier is not None:
            self.tier.submit_loads(out.loads)
        for seq in out.finished:
            self.outcomes.finished(seq)
        if out.is_empty:
            head = next((s for s in sched.waiting if s.awaiting_load is None), None)
            if head is None or sched.running or (self.tier and self.tier.busy()):
                return
            if self.tier and self.tier.holds_blocks():  # saves being written hold the blocks
                return self.tier.wait_for_writer()
            return self.outcomes.fail(head, ErrorCode.CAPACITY, "no free KV blocks for this prompt",
                                      "capacity")
        self.num_steps += 1
        try:
            logits, sampled = self.runner.run(out)
            sched.on_step_done(out)
            held, gens, tokens, lps = forks.sample_step(sched, out, logits, sampled,
                                                        self.runner.prompt_rows)
        except Exception as exc:  # one bad step must not take the engine down
            log.exception("engine_step_failed")
            for seq in [*out.decodes, *(s for s, _ in out.prefills), *out.forked]:
                self.outcomes.fail(seq, ErrorCode.INTERNAL,
                                   f"model step failed: {type(exc).__name__}: {exc}", "error")
            return
        for seq, row in held:  # (a sampled row: the step made logits)
            assert logits is not None
            self.calls.on_logits(seq, logits[row])
        for seq, token, lp in zip(gens, tokens, lps):
            self.outcomes.token(seq, token, lp)

    def _idle_wait_s(self) -> float | None:
        """How long the idle loop may sleep: until a TTL pin expires or a session's use is
        due at the disk tier; None: until woken."""
        waits = [self.kv.pins.wait_s(), self.tier.wait_s() if self.tier is not None else None]
        return min((w for w in waits if w is not None), default=None)

    def _forget(self, request_id: str) -> None:
        with self._cond:
            self._known.discard(request_id)
            self._aborts.pop(request_id, None)
