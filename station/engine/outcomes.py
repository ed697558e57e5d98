"""What becomes of a sequence after its step: a generate's events (its prefill, each token,
its end) with the KV sessions saved beside them, and a held sequence's failed call.

``Outcomes`` works on the parts it is handed (the KV cache manager, the scheduler, the engine
calls and a callback that forgets a request id), never the engine; everything here runs on
the engine thread. A sequence ends once: ``finished`` (a finish reason, a ``finished``
event) or ``fail`` (an error, a ``failed`` event or a failed call); the choices of an
``n > 1`` generate not forked yet end with their parent.
"""

from __future__ import annotations

import time
from typing import Callable

from gnosis_daemon.logs import get_logger
from gnosis_daemon.protocol import ErrorCode, OpError
from station.core.kv_manager import KVCacheManager
from station.core.requests import EngineEvent, Failed, Finished, Prefill, Token
from station.core.scheduler import Scheduler
from station.core.sequence import Sequence, SequenceKind
from station.engine import forks, pinning
from station.engine.calls import EngineCalls, request_state, session_fields
from station.sampling.logprobs import TokenLogprobs, prompt_logprobs_of

log = get_logger(__name__)


class Outcomes:
    def __init__(self, kv: KVCacheManager, scheduler: Scheduler, calls: EngineCalls,
                 forget: Callable[[str], None], max_model_len: int) -> None:
        """``forget(request_id)``: the engine drops an ended request's id (its duplicate
        check and pending abort)."""
        self.kv = kv
        self.scheduler = scheduler
        self.calls = calls
        self._forget = forget
        self.max_model_len = max_model_len

    def _save_named(self, session_id: str | None, seq: Sequence, num_tokens: int) -> tuple[bool, str | None]:
        if not session_id:
            return False, None
        try:
            self.kv.pin_sequence(session_id, seq, num_tokens)
        except Exception as exc:  # a failed save is reported, the request carries on
            log.exception("kv_session_save_failed", session_id=session_id)
            return False, f"{type(exc).__name__}: {exc}"
        return True, None

    def final_save(self, seq: Sequence) -> None:
        """Pin a generate's prompt + completion as its ``save_final_session`` (before its
        blocks are released); the ``finished`` event reports how that went."""
        client = request_state(seq)
        if client.save_final_session and seq.kind is SequenceKind.GENERATE and not seq.finished:
            saved, error = self._save_named(client.save_final_session, seq, seq.num_tokens)
            client.final_saved, client.final_save_error = saved, error

    def token(self, seq: Sequence, token: int, logprobs: TokenLogprobs | None = None) -> None:
        """A generate's sampled token: its prefill event the first time (and its
        ``save_session`` and ``pins``), the token, then its end at a stop token, the grammar's end or its
        length."""
        client, sampling = request_state(seq), forks.sampling_of(seq)
        if not seq.prefill_reported:
            seq.prefill_reported = True
            saved, save_error = self._save_named(client.save_session, seq, seq.num_prompt_tokens)
            pins = pinning.save_pins(self.kv, seq, client.pins)
            self._emit(seq, Prefill(
                seq.seq_id, (time.perf_counter() - client.arrival) * 1000,
                prompt_logprobs_of(seq), prompt_tokens=seq.num_prompt_tokens,
                cached_tokens=seq.num_cached_tokens, **session_fields(seq),
                saved=saved, save_error=save_error, pins=pins))
        if (failure := sampling.failure) is not None:  # a grammar no token continues
            return self.fail(seq, ErrorCode.BAD_REQUEST, f"argument 'grammar' {failure}", "error")
        seq.token_ids.append(token)
        self._emit(seq, Token(seq.seq_id, token, logprobs))
        if token in client.stop_ids or sampling.finished:  # eos, or the grammar's end
            reason = "stop"
        elif (seq.num_completion_tokens >= seq.params.max_tokens
              or seq.num_tokens >= self.max_model_len):
            reason = "length"
        else:
            return
        self.final_save(seq)  # before finish() releases the blocks
        self.scheduler.finish(seq, reason)
        self.finished(seq)

    def finished(self, seq: Sequence) -> None:
        """A sequence finished with its reason (its blocks released): a generate's
        ``finished`` event; a held one only ends this way when it outgrew the pool."""
        client = request_state(seq)
        if seq.kind is SequenceKind.HELD:
            # Only the scheduler ends a held sequence this way: it outgrew the pool.
            self.fail(seq, ErrorCode.CAPACITY, "the sequence no longer fits the KV pool")
            return
        for child in forks.detach_forks(seq):  # choices not forked yet end with their parent
            self.finished(child)
        self._forget(seq.seq_id)
        final_saved, final_error = client.final_saved, client.final_save_error
        if client.save_final_session and not final_saved and final_error is None:
            final_error = "not saved: the request ended before its KV was complete"
        assert seq.finish_reason is not None, "finished without a reason"
        self._emit(seq, Finished(seq.seq_id, seq.finish_reason, seq.num_prompt_tokens,
                                 seq.num_completion_tokens, seq.num_cached_tokens,
                                 final_saved, final_error))

    def fail(self, seq: Sequence, code: ErrorCode, message: str, finish: str = "") -> None:
        """End a sequence with an error; ``finish``: release its blocks first, with that reason."""
        if finish:
            self.scheduler.finish(seq, finish)
        if seq.kind is SequenceKind.HELD:
            self.calls.fail(seq, OpError(code, message))
            return
        for child in forks.detach_forks(seq):
            self.fail(child, code, message)
        self._forget(seq.seq_id)
        self._emit(seq, Failed(seq.seq_id, OpError(code, message)))

    def _emit(self, seq: Sequence, event: EngineEvent) -> None:
        on_event = request_state(seq).on_event
        assert on_event is not None, "a held sequence has no events"
        try:
            on_event(event)
        except Exception:  # a broken callback must not kill the engine thread
            log.exception("engine_event_callback_failed", request_id=seq.seq_id)

