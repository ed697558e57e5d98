"""One ``generate`` request: engine events in, protocol frames out, on the engine's thread.

The engine calls ``on_event`` on its own thread, and the event is handled there and then
(``GenerateStream.arrive``): one ``prefill`` event, ``tokens`` events carrying newly
completed text, then exactly one result or error, each frame put on its connection's write
queue. At the end of each turn of its loop the engine calls the ``EventRelay``, which writes
each connection that got frames in one non-blocking write (the connection's writer task on
trio takes what a full socket buffer leaves). Trio hears of a stream only at its end, to
wake the task that logs it. The engine never blocks on a slow client (the queue is
unbounded), and a step's events cost no wake-up of trio's thread.

Those events were handled on trio's thread until this layout, handed over in one batch a
step. The two threads then took the GIL in turn every step, from two cores: at 32 streams
through the socket a step took 0.82-1.40 ms beyond the model's forward (median of four runs
1.29), against 0.71-1.28 (0.77) this way (docs/benchmarks.md, "Per-step host overhead").
Trio still injects events of its own (the shutdown's error) and ends streams whose
connection went, so each stream's state is changed under its own lock.

Stop strings are found here, by the detokenizer: the request is aborted in the engine and
ends with finish_reason ``stop`` at once; with ``save_final_session`` the engine is asked to
finish it as ``stop`` instead, and the result waits for its ``finished`` event, which says
whether the final KV session was saved.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Protocol

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


class TrioCalls:
    """Calls a function on trio's thread from either thread: at once on trio's, else through
    the run's ``run_sync_soon`` (nothing once the run is over). Made on trio's thread."""

    def __init__(self, token: trio.lowlevel.TrioToken | None = None) -> None:
        self.token = token or trio.lowlevel.current_trio_token()
        self._thread = threading.get_ident()

    def __call__(self, fn: Callable[[], object]) -> None:
        if threading.get_ident() == self._thread:
            fn()
            return
        try:
            self.token.run_sync_soon(fn)
        except trio.RunFinishedError:
            pass  # trio is gone (shutdown): nobody is left to tell


class EventRelay:
    """The engine's events to their streams, on the engine's thread, and what needs trio.

    ``put`` (every stream's ``on_event``) hands the event to its stream now; ``turn_done``
    (the engine calls it after each turn of its loop) writes each connection that got
    frames since, once. ``on_trio`` runs a function on trio's thread (a stream's end wakes
    its task).
    """

    def __init__(self, token: trio.lowlevel.TrioToken) -> None:
        self.on_trio = TrioCalls(token)  # made on trio's thread (the server's)
        self._written: dict[int, FrameSink] = {}  # connections with frames this turn

    @property
    def token(self) -> trio.lowlevel.TrioToken:
        return self.on_trio.token

    def put(self, stream: GenerateStream, event: EngineEvent) -> None:
        """Engine thread: the event's frames onto its connection's queue."""
        stream.arrive(event)
        self._written.setdefault(id(stream.sink), stream.sink)

    def turn_done(self) -> None:
        """Engine thread, after a turn of its loop: each connection's frames in one write."""
        if self._written:
            sinks, self._written = self._written, {}
            for sink in sinks.values():
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
    given its request; from then on ``arrive`` turns each event into frames (on the engine's
    thread, or trio's for its own events), and ``pump`` (its task) waits for the end and
    logs it.
    """

    def __init__(self, frame_id: Any, engine_id: str, gen: CheckedGenerate, tokenizer: Any,
                 eos_ids: tuple[int, ...], relay: EventRelay) -> None:
        self.frame_id = frame_id
        self.engine_id = engine_id
        self.gen = gen
        self._relay = relay
        self._lock = threading.Lock()  # its state: the engine's thread and trio's change it
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
        """Engine thread: the event's frames onto the write queue (never blocks)."""
        self._relay.put(self, event)

    def inject(self, event: EngineEvent) -> None:
        """Trio thread: put a server-made event (shutdown) in the stream, and write it."""
        self.arrive(event)
        self.sink.flush()

    def close(self) -> None:
        """Trio thread: the request is over on this side (its connection went): later
        events drop."""
        with self._lock:
            self._end()

    def arrive(self, event: EngineEvent) -> None:
        """Either thread: the event's frames onto the write queue, now. An event after the
        end is dropped; a bug here ends this request with an ``internal`` error frame and
        the station serves on."""
        with self._lock:
            if self.done:
                return
            try:
                outcome = self._handle(event)
            except Exception as exc:  # noqa: BLE001 - one request's bug is that request's error
                log.exception("generate_event_failed", engine_event=type(event).__name__)
                self._send(error_frame(self.frame_id, ErrorCode.INTERNAL,
                                       f"{type(exc).__name__}: {exc}"))
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
            with self._lock:
                self._end()
            for choice in self.choices[1:]:  # the server aborts the first one
                if not choice.done and self._engine is not None:
                    self._engine.abort(choice.engine_id)
            self._log(self.outcome)

    def _end(self) -> None:
        self.done = True
        self._relay.on_trio(self._ended.set)

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
