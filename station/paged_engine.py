"""The station's engine: paged KV, automatic prefix cache, continuous batching.

One engine thread loops like nano-vllm's ``LLMEngine.step``: schedule -> run -> postprocess.
Every running sequence decodes in the same forward; prompts are prefilled in chunks beside
them; a prompt whose leading full blocks are in the prefix cache skips those tokens. A
finished sequence's full blocks stay cached (evictable, LRU) after its blocks are released.

Resource handling: requests and aborts arrive under a lock and are applied at the next step
boundary (never mid-forward); an aborted or finished sequence frees its blocks at once.
``shutdown`` ends every unfinished request with a ``shutting_down`` error.

Error handling: a forward that raises ends the sequences of that step with an ``internal``
error and frees their blocks; the engine keeps serving everyone else.
"""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from gnosis_daemon.logs import get_logger
from gnosis_daemon.protocol import ErrorCode
from station.block_pool import BlockPool, prefix_extra_keys
from station.engine_api import EngineEvent, EventCallback, EventKind, GenerationRequest
from station.kv_cache import KVCache, KVCacheShape, num_blocks_for
from station.model_runner import ModelRunner
from station.sampling import make_generator, sample
from station.scheduler import Scheduler
from station.sequence import Sequence

log = get_logger(__name__)


@dataclass(slots=True)
class _Client:
    """Per-request bookkeeping the scheduler never looks at."""

    on_event: EventCallback
    stop_ids: frozenset[int]
    arrival: float = field(default_factory=time.perf_counter)


class PagedEngine:
    """``engine_api.Engine`` over a paged KV pool (see the module docstring)."""

    def __init__(self, loaded: Any, settings: Any, num_blocks: int | None = None) -> None:
        """``loaded``: a ``model_loader.LoadedModel`` (model, device, dtype, fingerprint,
        eos_token_ids, max_model_len, vocab_size); ``num_blocks`` overrides the budget."""
        self.loaded = loaded
        self.settings = settings
        self.block_size = settings.kv_block_size
        self.max_model_len = loaded.max_model_len
        device = torch.device(loaded.device)
        shape = KVCacheShape.from_config(loaded.model.config, self.block_size, loaded.dtype)
        if num_blocks is None:
            num_blocks = num_blocks_for(shape, settings, device)
        self.kv_cache = KVCache(shape, num_blocks, device)
        self.pool = BlockPool(num_blocks, self.block_size)
        self.scheduler = Scheduler(self.pool, settings.max_batch_size, settings.prefill_chunk_tokens)
        self.runner = ModelRunner(loaded.model, self.kv_cache, device)
        self.device = device
        self._cond = threading.Condition()
        self._inbox: collections.deque[Sequence] = collections.deque()
        self._aborts: set[str] = set()
        self._known: set[str] = set()  # queued or running ids (duplicate check)
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.num_steps = 0
        log.info("kv_pool_ready", num_blocks=num_blocks, block_size=self.block_size,
                 bytes_per_block=shape.bytes_per_block, bytes_total=self.kv_cache.bytes_total)

    # -- Engine protocol (any thread)
    def start(self) -> None:
        assert self._thread is None, "engine started twice"
        self._thread = threading.Thread(target=self._run, name="station-engine", daemon=True)
        self._thread.start()

    def shutdown(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()
        with self._cond:
            leftovers = [*self._inbox, *self.scheduler.running, *self.scheduler.waiting]
            self._inbox.clear()
            self._known.clear()
        for seq in leftovers:
            if seq in self.scheduler.running or seq in self.scheduler.waiting:
                self.scheduler.finish(seq, "shutting_down")
            self._emit(seq, EventKind.ERROR, code=ErrorCode.SHUTTING_DOWN.value,
                       message="the station is shutting down")

    def add_request(self, request: GenerationRequest, on_event: EventCallback) -> None:
        prompt = list(request.prompt_ids)
        if not prompt:
            raise ValueError("the prompt has no tokens")
        if len(prompt) >= self.max_model_len:
            raise ValueError(f"prompt of {len(prompt)} tokens does not fit max_model_len "
                             f"{self.max_model_len}")
        vocab = self.loaded.vocab_size
        if any(not 0 <= t < vocab for t in prompt):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if -(-(len(prompt) + 1) // self.block_size) > self.pool.num_blocks:
            raise ValueError(f"prompt of {len(prompt)} tokens does not fit the KV pool of "
                             f"{self.pool.num_blocks * self.block_size} tokens")
        if request.load_session or request.save_session:
            raise ValueError("this engine has no KV sessions (capability kv_session)")
        params = request.params
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids.update(self.loaded.eos_token_ids)
        seq = Sequence(
            request.request_id, prompt, params,
            extra_keys=prefix_extra_keys(self.loaded.fingerprint, self.settings.tenant_salt,
                                         request.tenant),
            generator=make_generator(params.seed, self.device),
            user=_Client(on_event, frozenset(stop_ids)),
        )
        with self._cond:
            if self._stopping:
                raise RuntimeError("the engine is shutting down")
            if request.request_id in self._known:
                raise ValueError(f"request id {request.request_id!r} is already running")
            self._known.add(request.request_id)
            self._inbox.append(seq)
            self._cond.notify_all()

    def abort(self, request_id: str) -> None:
        with self._cond:
            if request_id in self._known:
                self._aborts.add(request_id)
                self._cond.notify_all()

    def stats(self) -> dict[str, Any]:
        pool, sched = self.pool, self.scheduler
        with self._cond:
            num_inbox = len(self._inbox)
        return {
            "block_size": self.block_size,
            "blocks_total": pool.num_blocks,
            "blocks_free": pool.num_free_blocks,  # allocatable, cached-but-unreferenced included
            "blocks_cached": pool.num_cached_blocks,
            "blocks_held": pool.num_held_blocks,
            "prefix_cache_queries_tokens": sched.prefix_cache_queries_tokens,
            "prefix_cache_hits_tokens": sched.prefix_cache_hits_tokens,
            "running": len(sched.running),
            "waiting": len(sched.waiting) + num_inbox,
            "preemptions": sched.num_preemptions,
            "steps": self.num_steps,
        }

    def capabilities(self) -> dict[str, bool]:
        return {"paged_kv": True, "prefix_cache": True, "continuous_batching": True}

    # -- engine thread
    def _run(self) -> None:
        while True:
            with self._cond:
                while not (self._stopping or self._inbox or self._aborts
                           or self.scheduler.has_unfinished()):
                    self._cond.wait()
                if self._stopping:
                    return
                new, aborts = list(self._inbox), self._aborts
                self._inbox.clear()
                self._aborts = set()
            for seq in new:
                self.scheduler.add(seq)
            for request_id in aborts:
                seq = self.scheduler.abort(request_id)
                if seq is not None:
                    self._finished(seq)
            if self.scheduler.has_unfinished():
                self.step()

    def step(self) -> None:
        """schedule -> run -> postprocess (engine thread only)."""
        sched = self.scheduler
        out = sched.schedule()
        for seq in out.finished:
            self._finished(seq)
        if out.is_empty:
            if sched.waiting and not sched.running:
                # Nothing runs and the head still does not fit: pinned blocks hold the pool.
                seq = sched.waiting[0]
                sched.finish(seq, "capacity")
                self._fail(seq, ErrorCode.CAPACITY, "no free KV blocks for this prompt")
            return
        self.num_steps += 1
        try:
            logits, sampled = self.runner.run(out)
            sched.on_step_done(out)
            tokens = (sample(logits, [s.params for s in sampled], [s.generator for s in sampled]).tolist()
                      if sampled else [])
        except Exception as exc:  # one bad step must not take the engine down
            log.exception("engine_step_failed")
            for seq in [*out.decodes, *(s for s, _ in out.prefills)]:
                sched.finish(seq, "error")
                self._fail(seq, ErrorCode.INTERNAL, f"model step failed: {type(exc).__name__}: {exc}")
            return
        for seq, token in zip(sampled, tokens):
            self._postprocess(seq, token)

    def _postprocess(self, seq: Sequence, token: int) -> None:
        client: _Client = seq.user
        if not seq.prefill_reported:
            seq.prefill_reported = True
            self._emit(seq, EventKind.PREFILL, prompt_tokens=seq.num_prompt_tokens,
                       cached_tokens=seq.num_cached_tokens,
                       prefill_ms=(time.perf_counter() - client.arrival) * 1000)
        seq.token_ids.append(token)
        self._emit(seq, EventKind.TOKEN, token_id=token)
        if token in client.stop_ids:
            self.scheduler.finish(seq, "stop")
        elif (seq.num_completion_tokens >= seq.params.max_tokens
              or seq.num_tokens >= self.max_model_len):
            self.scheduler.finish(seq, "length")
        else:
            return
        self._finished(seq)

    def _finished(self, seq: Sequence) -> None:
        self._forget(seq)
        self._emit(seq, EventKind.FINISHED, finish_reason=seq.finish_reason,
                   prompt_tokens=seq.num_prompt_tokens, completion_tokens=seq.num_completion_tokens,
                   cached_tokens=seq.num_cached_tokens)

    def _fail(self, seq: Sequence, code: ErrorCode, message: str) -> None:
        self._forget(seq)
        self._emit(seq, EventKind.ERROR, code=code.value, message=message)

    def _forget(self, seq: Sequence) -> None:
        with self._cond:
            self._known.discard(seq.seq_id)
            self._aborts.discard(seq.seq_id)

    def _emit(self, seq: Sequence, kind: EventKind, **data: Any) -> None:
        try:
            seq.user.on_event(EngineEvent(seq.seq_id, kind, data))
        except Exception:  # a broken callback must not kill the engine thread
            log.exception("engine_event_callback_failed", request_id=seq.seq_id)
