"""The simplest correct engine: one transformers ``DynamicCache`` per request.

One engine thread runs every forward. Requests queued with ``add_request`` join the active
set at the next step; active requests are stepped round-robin, one token each per sweep
(the first step of a request prefills its whole prompt). It has no paged KV, prefix cache or
batching: the paged engine (station/paged_engine.py) replaces it, behind the same
``Engine`` protocol, so the socket server does not change.

Resource handling: a request's cache is dropped as soon as it finishes, is aborted (at the
next step boundary, never mid-forward) or fails. ``shutdown`` ends every unfinished request
with a ``shutting_down`` error.

Error handling: a forward that raises ends that request with an ``internal`` error; the
engine keeps serving the others.
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
from gnosis_daemon.settings import Settings
from station.engine_api import (
    EngineEvent,
    EventCallback,
    EventKind,
    GenerationRequest,
)
from station.model_loader import LoadedModel
from station.sampling import make_generator, sample

log = get_logger(__name__)


@dataclass(slots=True)
class _Sequence:
    request: GenerationRequest
    on_event: EventCallback
    stop_ids: frozenset[int]
    generator: torch.Generator | None
    cache: Any = None
    generated: list[int] = field(default_factory=list)

    def emit(self, kind: EventKind, **data: Any) -> None:
        self.on_event(EngineEvent(self.request.request_id, kind, data))


class SimpleEngine:
    """Per-request DynamicCache, round-robin decode on one engine thread."""

    def __init__(self, loaded: LoadedModel, settings: Settings) -> None:
        self.loaded = loaded
        self.block_size = settings.kv_block_size
        self.max_model_len = loaded.max_model_len
        self._cond = threading.Condition()
        self._inbox: collections.deque[_Sequence] = collections.deque()
        self._aborts: set[str] = set()
        self._known: set[str] = set()  # queued or running ids (duplicate check)
        self._active: dict[str, _Sequence] = {}
        self._stopping = False
        self._thread: threading.Thread | None = None

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
            leftovers = [*self._inbox, *self._active.values()]
            self._inbox.clear()
            self._active.clear()
            self._known.clear()
        for seq in leftovers:
            seq.emit(EventKind.ERROR, code=ErrorCode.SHUTTING_DOWN.value,
                     message="the station is shutting down")

    def add_request(self, request: GenerationRequest, on_event: EventCallback) -> None:
        prompt = request.prompt_ids
        if not prompt:
            raise ValueError("the prompt has no tokens")
        if len(prompt) >= self.max_model_len:
            raise ValueError(f"prompt of {len(prompt)} tokens does not fit max_model_len "
                             f"{self.max_model_len}")
        vocab = self.loaded.vocab_size
        if any(not 0 <= t < vocab for t in prompt):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if request.load_session or request.save_session:
            raise ValueError("this engine has no KV sessions (capability kv_session)")
        params = request.params
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids.update(self.loaded.eos_token_ids)
        seq = _Sequence(request, on_event, frozenset(stop_ids),
                        make_generator(params.seed, self.loaded.device))
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
        with self._cond:
            return {"running": len(self._active), "waiting": len(self._inbox),
                    "block_size": self.block_size, "blocks_total": 0, "blocks_free": 0,
                    "blocks_cached": 0, "prefix_cache_queries": 0, "prefix_cache_hits": 0}

    def capabilities(self) -> dict[str, bool]:
        return {}

    # -- engine thread
    def _run(self) -> None:
        with torch.inference_mode():
            while True:
                with self._cond:
                    while not (self._stopping or self._inbox or self._active or self._aborts):
                        self._cond.wait()
                    if self._stopping:
                        return
                    while self._inbox:
                        seq = self._inbox.popleft()
                        self._active[seq.request.request_id] = seq
                    aborts, self._aborts = self._aborts, set()
                for request_id in aborts:
                    seq = self._active.get(request_id)
                    if seq is not None:
                        self._finish(seq, "cancelled")
                for seq in list(self._active.values()):
                    with self._cond:
                        if self._stopping or seq.request.request_id in self._aborts:
                            break  # handled at the top of the next sweep
                    self._step(seq)

    def _step(self, seq: _Sequence) -> None:
        model = self.loaded.model
        try:
            if seq.cache is None:
                from transformers import DynamicCache

                seq.cache = DynamicCache(config=model.config)
                started = time.perf_counter()
                ids = torch.tensor([seq.request.prompt_ids], device=self.loaded.device)
                out = model(input_ids=ids, cache=seq.cache, use_cache=True, logits_to_keep=1)
                seq.emit(EventKind.PREFILL, prompt_tokens=len(seq.request.prompt_ids),
                         cached_tokens=0, prefill_ms=(time.perf_counter() - started) * 1000)
            else:
                ids = torch.tensor([[seq.generated[-1]]], device=self.loaded.device)
                out = model(input_ids=ids, cache=seq.cache, use_cache=True, logits_to_keep=1)
            logits = out.logits[:, -1, :].float()  # [1, V]
            token = int(sample(logits, [seq.request.params], [seq.generator])[0])
        except Exception as exc:  # one bad request must not take the engine down
            log.exception("engine_step_failed", request_id=seq.request.request_id)
            self._drop(seq)
            seq.emit(EventKind.ERROR, code=ErrorCode.INTERNAL.value,
                     message=f"model step failed: {type(exc).__name__}: {exc}")
            return
        seq.generated.append(token)
        seq.emit(EventKind.TOKEN, token_id=token)
        total = len(seq.request.prompt_ids) + len(seq.generated)
        if token in seq.stop_ids:
            self._finish(seq, "stop")
        elif len(seq.generated) >= seq.request.params.max_tokens or total >= self.max_model_len:
            self._finish(seq, "length")

    def _drop(self, seq: _Sequence) -> None:
        seq.cache = None
        with self._cond:
            self._active.pop(seq.request.request_id, None)
            self._known.discard(seq.request.request_id)
            self._aborts.discard(seq.request.request_id)

    def _finish(self, seq: _Sequence, reason: str) -> None:
        self._drop(seq)
        seq.emit(EventKind.FINISHED, finish_reason=reason,
                 completion_tokens=len(seq.generated))
