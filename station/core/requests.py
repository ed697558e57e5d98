"""The contract between the station's socket server and its engine (no torch here).

The server (trio thread) hands ``GenerationRequest``s to an engine, which runs every
model forward on its own engine thread and reports back through ``on_event``. The
callback is invoked on the engine thread: it must be cheap and thread-safe (the server
forwards it to trio with ``TrioToken.run_sync_soon``).

Resource handling: ``abort`` frees the request's KV at the engine's next step boundary
(never mid-forward) and ends it with a ``finished`` event whose reason is ``"cancelled"``.
Every request ends with exactly one ``finished`` or ``error`` event.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Callable, Protocol


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


@dataclass(slots=True)
class GenerationRequest:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    tenant: str = ""
    # Liquid memory: start from a saved KV session / save the prompt's KV.
    load_session: str | None = None
    save_session: str | None = None
    save_final_session: str | None = None  # pin prompt+completion KV when it ends


class EngineOpError(Exception):
    """An engine call (the handler of an engine op) cannot be served.

    ``code`` is a protocol ``ErrorCode`` value; the engine never imports the server.
    """

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


# done(result, error): exactly one is None; invoked on the engine thread, must be cheap.
CallDone = Callable[[dict[str, Any] | None, EngineOpError | None], None]
# handler(calls, owner, done, **kwargs): the engine-thread handler of an op, as the op
# registry (station.serving.op_registry) names it; the engine runs it between steps.
EngineCallHandler = Callable[..., Any]


class EventKind(enum.StrEnum):
    PREFILL = "prefill"  # prompt fully prefilled: prompt_tokens, cached_tokens (+ saved)
    TOKEN = "token"  # one sampled token: token_id
    FINISHED = "finished"  # finish_reason: "stop" | "length" | "cancelled"
    ERROR = "error"  # code (protocol ErrorCode value), message


@dataclass(frozen=True, slots=True)
class EngineEvent:
    request_id: str
    kind: EventKind
    data: dict[str, Any]


EventCallback = Callable[[EngineEvent], None]


class Engine(Protocol):
    """What the station server needs from an engine."""

    block_size: int

    def shutdown(self) -> None:
        """Stop the engine thread; every unfinished request ends with a shutting_down error."""

    def add_request(self, request: GenerationRequest, on_event: EventCallback) -> None:
        """Queue a request (thread-safe). Raises ValueError for a request it can never serve,
        and ``EngineOpError`` with code ``capacity`` when the waiting queue is full."""

    def abort(self, request_id: str) -> None:
        """Cancel a request (thread-safe, idempotent, unknown ids ignored)."""

    def finish_early(self, request_id: str) -> None:
        """End a request as ``stop`` (thread-safe, idempotent, unknown ids ignored); unlike
        ``abort``, its ``save_final_session`` still applies."""

    def stats(self) -> dict[str, Any]:
        """Figures for the ``stats`` op and ``hello``'s kv_pool (thread-safe snapshot)."""

    def capabilities(self) -> dict[str, bool]:
        """Engine feature flags (paged_kv, prefix_cache, continuous_batching,
        kv_persistence): properties, not ops. The flags of ops come from the op registry."""

    def call(self, handler: EngineCallHandler, owner: Any, done: CallDone, **kwargs: Any) -> None:
        """Queue an engine call (thread-safe): ``handler`` is the handler of an engine op in
        ``station.serving.op_registry`` (an ``EngineCalls`` method), run on the engine thread with
        ``kwargs``. ``owner`` (the connection) owns the held sequences it creates.
        Raises RuntimeError when shutting down, and ``EngineOpError`` with code ``capacity``
        when a new sequence would overfill the waiting queue."""

    def cancel_call(self, done: CallDone) -> None:
        """Cancel the call answered by ``done`` (thread-safe, idempotent): a queued call is
        answered ``cancelled``, a stepped one (embed) stops between steps, a held sequence's
        pending forward/decode_next frees the sequence."""

    def release_owner(self, owner: Any) -> None:
        """Free every held sequence of ``owner`` (its connection closed)."""
