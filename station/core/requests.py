"""The contract between the station's socket server and its engine (no torch here).

The server (trio thread) hands ``GenerationRequest``s to an engine, which runs every
model forward on its own engine thread and reports back through ``on_event``. The
callback is invoked on the engine thread: it must be cheap and thread-safe (the server
queues it for trio, a step's events in one ``TrioToken.run_sync_soon``).

Resource handling: ``abort`` frees the request's KV at the engine's next step boundary
(never mid-forward) and ends it with a ``Finished`` event whose reason is ``"cancelled"``.
Every request ends with exactly one ``Finished`` or ``Failed`` event. Every error in the
station is a ``gnosis_daemon.protocol.OpError`` carrying the wire's error code.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Callable

from gnosis_daemon.protocol import ErrorCode, OpError
from gnosis_daemon.wire import Choices, PrefillReport, Sampling, Sessions
from gnosis_daemon.wire.read import bad
from station.core.pins import PinPlan

__all__ = ["CallDone", "Choices", "EngineCallHandler", "EngineEvent", "EventCallback", "Failed",
           "Finished", "GenerationRequest", "Prefill", "SamplingParams", "SequenceLimits",
           "Sessions", "Token"]


@dataclass(frozen=True, slots=True, kw_only=True)
class SamplingParams(Sampling):
    """One sequence's sampling controls (``gnosis_daemon.wire.Sampling``, whose checks
    apply) and its token budget: ``max_tokens``, capped by the room the context leaves."""

    max_tokens: int

    def __post_init__(self) -> None:
        Sampling.__post_init__(self)
        if self.max_tokens < 1:
            raise bad("argument 'max_tokens' must be at least 1")

    @classmethod
    def of(cls, sampling: Sampling, max_tokens: int) -> SamplingParams:
        return cls(max_tokens=max_tokens,
                   **{f.name: getattr(sampling, f.name) for f in fields(Sampling)})


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """A generate as the engine takes it: the prompt's ids, the sampling controls with the
    capped budget, and the wire's choice and session arguments as they came."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    # Liquid memory: the KV session to start from or match, the ones to save, the tenant.
    sessions: Sessions = field(default_factory=Sessions)
    # ``n`` choices share the prompt's prefill (``station.engine.forks``); ``logprobs``: top
    # alternatives per sampled token; ``prompt_logprobs``: per prompt token (no prefix hit).
    choices: Choices = field(default_factory=Choices)
    # Structured output: an xgrammar CompiledGrammar (opaque here, see
    # station.sampling.grammar); None: unconstrained.
    grammar: Any = None
    # ``sessions.pins`` worked out against the prompt (station.serving.pin_prefix), in order.
    pins: tuple[PinPlan, ...] = ()


@dataclass(frozen=True, slots=True)
class SequenceLimits:
    """What one sequence may hold in this station: the one place a prompt's size and ids
    are judged, with one error code each (every op and the engine call ``check``)."""

    max_model_len: int
    vocab_size: int
    block_size: int
    num_blocks: int  # the KV pool's blocks

    def check(self, token_ids: list[int] | tuple[int, ...], *, room: int, held: int = 0,
              what: str = "the prompt") -> None:
        """``held`` tokens already in the sequence, ``token_ids`` added, then ``room`` more
        must fit; raises ``OpError``: ``bad_request`` for no tokens or an id outside the
        vocabulary, ``context_overflow`` when the model's context or the whole KV pool
        cannot hold them."""
        n = held + len(token_ids)
        if n == 0:
            raise OpError(ErrorCode.BAD_REQUEST, f"{what} has no tokens")
        if n + room > self.max_model_len:
            raise OpError(ErrorCode.CONTEXT_OVERFLOW,
                          f"{what} has {n} tokens: with {room} more it does not fit the "
                          f"model's {self.max_model_len}-token context")
        if -(-(n + room) // self.block_size) > self.num_blocks:
            raise OpError(ErrorCode.CONTEXT_OVERFLOW,
                          f"{what} has {n} tokens: with {room} more it does not fit the KV "
                          f"pool of {self.num_blocks * self.block_size} tokens")
        vocab = self.vocab_size
        # min/max run in C: a generator over every id cost ~50 us per 1,000 tokens
        if token_ids and (min(token_ids) < 0 or max(token_ids) >= vocab):
            raise OpError(ErrorCode.BAD_REQUEST, f"{what} has token ids outside [0, {vocab})")


# done(result, error): exactly one is None; invoked on the engine thread, must be cheap.
CallDone = Callable[[dict[str, Any] | None, OpError | None], None]
# handler(calls, owner, done, **kwargs): the engine-thread handler of an op, as the op
# registry (station.serving.op_registry) names it; the engine runs it between steps.
EngineCallHandler = Callable[..., Any]


# -- events: what the engine reports of a generate request, on the engine thread.
# Every request gets at most one Prefill, then Tokens, and ends with exactly one
# Finished or Failed.

@dataclass(frozen=True, slots=True)
class Prefill(PrefillReport):
    """The prompt is fully prefilled (reported with its first token): the wire's
    ``PrefillReport`` of it, and the engine's timing and prompt logprobs."""

    request_id: str
    prefill_ms: float
    # [None, TokenLogprobs...] per prompt token when prompt_logprobs was asked
    prompt_logprobs: Any = None


@dataclass(frozen=True, slots=True)
class Token:
    request_id: str
    token_id: int
    logprobs: Any = None  # a station.sampling.logprobs.TokenLogprobs when asked for


@dataclass(frozen=True, slots=True)
class Finished:
    request_id: str
    finish_reason: str  # "stop" | "length" (the wire's ChoiceResult), or "cancelled"
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    final_saved: bool = False
    final_save_error: str | None = None


@dataclass(frozen=True, slots=True)
class Failed:
    request_id: str
    error: OpError


EngineEvent = Prefill | Token | Finished | Failed
EventCallback = Callable[[EngineEvent], None]
