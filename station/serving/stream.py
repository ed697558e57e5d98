"""One ``generate`` request on the trio side: engine events in, protocol frames out.

The engine calls ``on_event`` on its own thread; ``GenerateStream`` forwards each event to
trio with ``TrioToken.run_sync_soon`` into an unbounded memory channel (the engine must
never block on a slow client), and ``pump`` turns events into frames: one ``prefill``
event, ``tokens`` events carrying newly completed text, then exactly one result or error.

Stop strings are found here, by the detokenizer: the request is aborted in the engine and
ends with finish_reason ``stop`` at once; with ``save_final_session`` the engine is asked to
finish it as ``stop`` instead, and the result waits for its ``finished`` event, which says
whether the final KV session was saved.
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Any, Awaitable, Callable

import trio

from gnosis_daemon.logs import get_logger
from gnosis_daemon.protocol import ErrorCode, error_frame, event_frame, result_frame
from station.serving.detok import IncrementalDetokenizer
from gnosis_daemon.wire import ChoiceResult, GenerateResult, LogprobEntry, PrefillEvent, TokensEvent
from station.core.requests import EngineEvent, Failed, Finished, GenerationRequest, Prefill, Token
from station.serving.ops import CheckedGenerate
from station.serving.token_text import token_texts
from station.engine.forks import choice_id

if TYPE_CHECKING:
    from station.engine.loop import PagedEngine

log = get_logger(__name__)

Send = Callable[[bytes], Awaitable[None]]


def _deliver(channel: trio.MemorySendChannel, event: EngineEvent) -> None:
    try:
        channel.send_nowait(event)
    except (trio.ClosedResourceError, trio.BrokenResourceError):
        pass  # the request already ended (client gone or cancelled): drop late events


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
    """State of one in-flight generate: its channel, its choices' detokenizers, timings."""

    def __init__(self, frame_id: Any, engine_id: str, gen: CheckedGenerate, tokenizer: Any,
                 eos_ids: tuple[int, ...], token: trio.lowlevel.TrioToken) -> None:
        self.frame_id = frame_id
        self.engine_id = engine_id
        self.gen = gen
        self._token = token
        self._send, self._receive = trio.open_memory_channel[EngineEvent](math.inf)
        self.asked = gen.args.choices
        self.n = self.asked.n
        self.texts = token_texts(tokenizer) if self.asked.asked else None
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

    def engine_request(self) -> GenerationRequest:
        """What the engine schedules for this stream (``add_request`` with ``on_event``)."""
        return self.gen.request(self.engine_id)

    def on_event(self, event: EngineEvent) -> None:
        """Engine thread: hand the event to trio (never blocks)."""
        try:
            self._token.run_sync_soon(_deliver, self._send, event)
        except trio.RunFinishedError:
            pass  # trio is gone (shutdown): nobody is left to tell

    def inject(self, event: EngineEvent) -> None:
        """Trio thread: put a server-made event (shutdown) in the stream."""
        _deliver(self._send, event)

    def close(self) -> None:
        self._send.close()

    async def pump(self, send: Send, engine: PagedEngine) -> None:
        """Send this request's frames until its final frame; log one canonical line."""
        # Until the engine says otherwise, an end without a final frame is the connection's
        # doing: it closed (the host went away) and the request was aborted with it.
        outcome = "connection_closed"
        try:
            async with self._receive:
                async for event in self._receive:
                    outcome = await self._handle(event, send, engine) or outcome
                    if self.done:
                        return
        except trio.Cancelled:
            outcome = "connection_closed"
            raise
        except Exception:
            outcome = "internal"
            raise
        finally:
            self.done = True
            self.close()
            for choice in self.choices[1:]:  # the server aborts the first one
                if not choice.done:
                    engine.abort(choice.engine_id)
            self._log(outcome)

    def _tokens(self, choice: _Choice, token_ids: list[int], text: str,
                logprobs: tuple[LogprobEntry, ...] | None) -> bytes:
        event = TokensEvent(token_ids=tuple(token_ids), text=text, logprobs=logprobs,
                            index=choice.index if self.n > 1 else None)
        return event_frame(self.frame_id, event.to_wire())

    async def _handle(self, event: EngineEvent, send: Send, engine: PagedEngine) -> str | None:
        choice = self._by_id.get(event.request_id, self.choices[0])
        match event:
            case Prefill():
                self.cached_tokens = event.cached_tokens
                entries = None
                if event.prompt_logprobs is not None and self.texts is not None:
                    entries = tuple(self.texts.entry(lp) for lp in event.prompt_logprobs)
                await send(event_frame(self.frame_id, PrefillEvent.of(event, entries).to_wire()))
                return None
            case Token():
                if choice.stopped or choice.done:
                    return None  # decoded before the engine saw the stop: not part of the answer
                return await self._on_tokens(choice, event, send, engine)
            case Finished():
                if choice.done:
                    return None
                reason = "stop" if choice.stopped else event.finish_reason
                choice.final_saved = event.final_saved
                choice.final_save_error = event.final_save_error
                if reason == "cancelled":
                    self.done = True
                    await send(error_frame(self.frame_id, ErrorCode.CANCELLED, "request cancelled"))
                    return "cancelled"
                tail = choice.detok.finish()
                if tail:
                    await send(self._tokens(choice, [], tail,
                                            () if self.asked.logprobs is not None else None))
                return await self._finish(choice, reason, send)
            case Failed():
                self.done = True
                await send(error_frame(self.frame_id, event.error.code, event.error.message))
                return event.error.code.value
        raise AssertionError(f"unknown engine event {event!r}")

    async def _on_tokens(self, choice: _Choice, event: Token, send: Send,
                         engine: PagedEngine) -> str | None:
        if self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        ids = [event.token_id]
        choice.token_ids.extend(ids)
        text_ids = [t for t in ids if t not in self._final_ids]
        out = choice.detok.feed(text_ids)
        entries = None
        if event.logprobs is not None and self.texts is not None:
            entries = (self.texts.entry(event.logprobs),)
        await send(self._tokens(choice, ids, out.text, entries))
        if out.stopped:
            if self.gen.args.sessions.save_final_session and choice.index == 0:
                choice.stopped = True  # the result follows the engine's finished event
                engine.finish_early(choice.engine_id)
                return None
            engine.abort(choice.engine_id)  # its late "cancelled" event is dropped
            return await self._finish(choice, "stop", send)
        return None

    async def _finish(self, choice: _Choice, reason: str, send: Send) -> str | None:
        choice.done, choice.reason = True, reason
        if not all(c.done for c in self.choices):
            return None
        self.done = True
        await send(result_frame(self.frame_id, self.result().to_wire()))
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
