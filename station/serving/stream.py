"""One ``generate`` request on the trio side: engine events in, protocol frames out.

The engine calls ``on_event`` on its own thread. The server's ``EventRelay`` hands trio
every event a step made in one ``TrioToken.run_sync_soon``, and each event is handled there
and then, synchronously (``GenerateStream.arrive``): one ``prefill`` event, ``tokens``
events carrying newly completed text, then exactly one result or error, each frame put on
its connection's write queue, which the relay then flushes in one non-blocking write (the
connection's writer task takes what a full socket buffer leaves). The engine never blocks
on a slow client (the queue is unbounded, as a channel was before), and a step's events
cost no task switch, channel or lock per stream: a task per stream, woken through a channel
and writing under the connection's lock, cost the trio thread about 3 ms more a step at 32
streams (docs/benchmarks.md, "Per-step host overhead").

Stop strings are found here, by the detokenizer: the request is aborted in the engine and
ends with finish_reason ``stop`` at once; with ``save_final_session`` the engine is asked to
finish it as ``stop`` instead, and the result waits for its ``finished`` event, which says
whether the final KV session was saved.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any, Protocol

import trio

from gnosis_daemon.logs import get_logger
from gnosis_daemon.protocol import ErrorCode, error_frame, event_frame, result_frame
from station.serving.detok import IncrementalDetokenizer
from gnosis_daemon.wire import ChoiceResult, GenerateResult, LogprobEntry, PrefillEvent, TokensEvent
from gnosis_daemon.wire.events import OneTokenFrames
from station.core.requests import EngineEvent, Failed, Finished, GenerationRequest, Prefill, Token
from station.serving.ops import CheckedGenerate
from station.serving.token_text import token_texts
from station.engine.forks import choice_id

if TYPE_CHECKING:
    from station.engine.loop import PagedEngine

log = get_logger(__name__)


class FrameSink(Protocol):
    """Where a stream's frames go: its connection (``station.serving.connection``)."""

    def queue(self, payload: bytes) -> None: ...

    def flush(self) -> None: ...


class _Unrouted:
    """A stream's sink before ``route``: the engine's first event never comes that early."""

    def queue(self, payload: bytes) -> None:
        raise AssertionError("route() comes before the engine's first event")

    def flush(self) -> None:
        pass


class EventRelay:
    """Engine thread -> trio: the events put while trio is busy reach it as one batch.

    ``put`` queues (stream, event); the put that finds the queue empty schedules one
    ``drain`` with ``run_sync_soon``, which hands everything queued by then to its streams
    in order. So a step's 32 token events are one wake-up of the trio thread, not 32.
    """

    def __init__(self, token: trio.lowlevel.TrioToken) -> None:
        self.token = token
        self._lock = threading.Lock()
        self._queued: list[tuple[GenerateStream, EngineEvent]] = []

    def put(self, stream: GenerateStream, event: EngineEvent) -> None:
        with self._lock:
            self._queued.append((stream, event))
            if len(self._queued) > 1:
                return  # a drain is already scheduled: it takes this one too
        try:
            self.token.run_sync_soon(self._drain)
        except trio.RunFinishedError:
            pass  # trio is gone (shutdown): nobody is left to tell

    def _drain(self) -> None:
        with self._lock:
            batch, self._queued = self._queued, []
        sinks: dict[int, FrameSink] = {}
        for stream, event in batch:
            stream.arrive(event)
            sinks.setdefault(id(stream.sink), stream.sink)
        for sink in sinks.values():  # each connection's frames of this batch: one write
            sink.flush()


class _Choice:
    """One choice of a generate (``n`` > 1: several): its detokenizer and tokens."""

    def __init__(self, index: int, engine_id: str, gen: CheckedGenerate, tokenizer: Any) -> None:
        self.index = index
        self.engine_id = engine_id
        self.detok = IncrementalDetokenizer(tokenizer, gen.prompt_ids, gen.args.stop)
        self.token_ids: list[int] = []
        self.done = False
        self.reason: str | None = None
        self.stopped = False  # a stop string ended it; waiting for the engine's final save
        self.final_saved = False
        self.final_save_error: str | None = None


class GenerateStream:
    """State of one in-flight generate: its choices' detokenizers, timings, its outcome.

    ``route`` gives it its connection's write queue and the engine before the engine is
    given its request; from then on ``arrive`` (trio thread) turns each event into frames,
    and ``pump`` (its task) waits for the end and logs it.
    """

    def __init__(self, frame_id: Any, engine_id: str, gen: CheckedGenerate, tokenizer: Any,
                 eos_ids: tuple[int, ...], relay: EventRelay) -> None:
        self.frame_id = frame_id
        self.engine_id = engine_id
        self.gen = gen
        self._relay = relay
        self.sink: FrameSink = _Unrouted()
        self._engine: PagedEngine | None = None
        self._ended = trio.Event()
        # Until the engine says otherwise, an end without a final frame is the connection's
        # doing: it closed (the host went away) and the request was aborted with it.
        self.outcome = "connection_closed"
        self.asked = gen.args.choices
        self.n = self.asked.n
        self.texts = token_texts(tokenizer) if self.asked.asked else None
        self._one_token = OneTokenFrames(frame_id)  # the common frame: no logprobs, one choice
        self.choices = [_Choice(i, choice_id(engine_id, i), gen, tokenizer) for i in range(self.n)]
        self._by_id = {c.engine_id: c for c in self.choices}
        sampling = gen.args.sampling
        # The token that ends generation is not text (vLLM's default): eos / stop_token_ids.
        self._final_ids = set(sampling.stop_token_ids) | (set() if sampling.ignore_eos else set(eos_ids))
        self.done = False
        self.started = time.perf_counter()
        self.first_token_at: float | None = None
        self.cached_tokens = 0

    @property
    def token_ids(self) -> list[int]:
        return [t for c in self.choices for t in c.token_ids]

    def route(self, sink: FrameSink, engine: PagedEngine) -> None:
        """Where its frames go, and the engine its stop strings abort in."""
        self.sink, self._engine = sink, engine

    def engine_request(self) -> GenerationRequest:
        """What the engine schedules for this stream (``add_request`` with ``on_event``)."""
        return self.gen.request(self.engine_id)

    def on_event(self, event: EngineEvent) -> None:
        """Engine thread: hand the event to trio (never blocks)."""
        self._relay.put(self, event)

    def inject(self, event: EngineEvent) -> None:
        """Trio thread: put a server-made event (shutdown) in the stream."""
        self.arrive(event)
        self.sink.flush()

    def close(self) -> None:
        """The request is over on this side (its connection went): later events drop."""
        self._end()

    def arrive(self, event: EngineEvent) -> None:
        """Trio thread: the event's frames onto the write queue, now. An event after the
        end is dropped; a bug here ends this request with an ``internal`` error frame and
        the station serves on."""
        if self.done:
            return
        try:
            outcome = self._handle(event)
        except Exception as exc:  # noqa: BLE001 - one request's bug is that request's error
            log.exception("generate_event_failed", engine_event=type(event).__name__)
            self._send(error_frame(self.frame_id, ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}"))
            self._abort_all()
            self.done, outcome = True, "internal"
        if outcome is not None:
            self.outcome = outcome
        if self.done:
            self._end()

    async def pump(self) -> None:
        """Wait for this request's final frame (or its connection's end); log one
        canonical line."""
        try:
            await self._ended.wait()
        finally:
            self._end()
            for choice in self.choices[1:]:  # the server aborts the first one
                if not choice.done and self._engine is not None:
                    self._engine.abort(choice.engine_id)
            self._log(self.outcome)

    def _end(self) -> None:
        self.done = True
        self._ended.set()

    def _send(self, frame: bytes) -> None:
        self.sink.queue(frame)

    def _abort_all(self) -> None:
        if self._engine is not None:
            for choice in self.choices:
                if not choice.done:
                    self._engine.abort(choice.engine_id)

    def _tokens(self, choice: _Choice, token_ids: list[int], text: str,
                logprobs: tuple[LogprobEntry, ...] | None) -> bytes:
        return event_frame(self.frame_id, TokensEvent.wire(
            token_ids, text, logprobs, choice.index if self.n > 1 else None))

    def _handle(self, event: EngineEvent) -> str | None:
        choice = self._by_id.get(event.request_id, self.choices[0])
        match event:
            case Prefill():
                self.cached_tokens = event.cached_tokens
                entries = None
                if event.prompt_logprobs is not None and self.texts is not None:
                    entries = tuple(self.texts.entry(lp) for lp in event.prompt_logprobs)
                self._send(event_frame(self.frame_id, PrefillEvent.of(event, entries).to_wire()))
                return None
            case Token():
                if choice.stopped or choice.done:
                    return None  # decoded before the engine saw the stop: not part of the answer
                return self._on_tokens(choice, event)
            case Finished():
                if choice.done:
                    return None
                reason = "stop" if choice.stopped else event.finish_reason
                choice.final_saved = event.final_saved
                choice.final_save_error = event.final_save_error
                if reason == "cancelled":
                    self.done = True
                    self._send(error_frame(self.frame_id, ErrorCode.CANCELLED, "request cancelled"))
                    return "cancelled"
                tail = choice.detok.finish()
                if tail:
                    self._send(self._tokens(choice, [], tail,
                                            () if self.asked.logprobs is not None else None))
                return self._finish(choice, reason)
            case Failed():
                self.done = True
                self._send(error_frame(self.frame_id, event.error.code, event.error.message))
                return event.error.code.value
        raise AssertionError(f"unknown engine event {event!r}")

    def _on_tokens(self, choice: _Choice, event: Token) -> str | None:
        if self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        token_id = event.token_id
        choice.token_ids.append(token_id)
        out = choice.detok.feed(() if token_id in self._final_ids else (token_id,))
        entries = None
        if event.logprobs is not None and self.texts is not None:
            entries = (self.texts.entry(event.logprobs),)
        if entries is None and self.n == 1:
            self._send(self._one_token.frame(token_id, out.text))
        else:
            self._send(self._tokens(choice, [token_id], out.text, entries))
        if out.stopped:
            assert self._engine is not None
            if self.gen.args.sessions.save_final_session and choice.index == 0:
                choice.stopped = True  # the result follows the engine's finished event
                self._engine.finish_early(choice.engine_id)
                return None
            self._engine.abort(choice.engine_id)  # its late "cancelled" event is dropped
            return self._finish(choice, "stop")
        return None

    def _finish(self, choice: _Choice, reason: str) -> str | None:
        choice.done, choice.reason = True, reason
        if not all(c.done for c in self.choices):
            return None
        self.done = True
        self._send(result_frame(self.frame_id, self.result().to_wire()))
        return self.choices[0].reason

    def _choice_result(self, choice: _Choice) -> ChoiceResult:
        return ChoiceResult(index=choice.index, finish_reason=choice.reason or "",
                            completion_tokens=len(choice.token_ids),
                            token_ids=tuple(choice.token_ids), text=choice.detok.text,
                            final_saved=choice.final_saved,
                            final_save_error=choice.final_save_error)

    def result(self) -> GenerateResult:
        now = time.perf_counter()
        first = self.first_token_at or now
        decode_s = now - first
        n = len(self.token_ids)
        each = tuple(self._choice_result(c) for c in self.choices)
        return GenerateResult(
            first=each[0], prompt_tokens=len(self.gen.prompt_ids), completion_tokens=n,
            cached_tokens=self.cached_tokens, ttft_ms=round((first - self.started) * 1000, 3),
            decode_tokens_per_s=round((n - 1) / decode_s, 3) if n > 1 and decode_s > 0 else 0.0,
            choices=each if self.n > 1 else None)

    def _log(self, outcome: str) -> None:
        now = time.perf_counter()
        n = len(self.token_ids)
        ttft = ((self.first_token_at - self.started) * 1000) if self.first_token_at else None
        decode_s = now - self.first_token_at if self.first_token_at else 0.0
        log.info("generate", finish_reason=outcome, prompt_tokens=len(self.gen.prompt_ids),
                 cached_tokens=self.cached_tokens, completion_tokens=n,
                 ttft_ms=round(ttft, 3) if ttft is not None else None,
                 tok_per_s=round((n - 1) / decode_s, 3) if n > 1 and decode_s > 0 else 0.0,
                 duration_ms=round((now - self.started) * 1000, 3))
