"""The contract between the station's socket server and its engine (no torch here).

The server (trio thread) hands ``GenerationRequest``s to an engine, which runs every
model forward on its own engine thread and reports back through ``on_event``. The
callback is invoked on the engine thread: it must be cheap and thread-safe (the server
forwards it to trio with ``TrioToken.run_sync_soon``).

Resource handling: ``abort`` frees the request's KV at the engine's next step boundary
(never mid-forward) and ends it with a ``Finished`` event whose reason is ``"cancelled"``.
Every request ends with exactly one ``Finished`` or ``Failed`` event. Every error in the
station is a ``gnosis_daemon.protocol.OpError`` carrying the wire's error code.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from gnosis_daemon.protocol import ErrorCode, OpError


# Bounds of the sampling controls (OpenAI's and vLLM's): penalties in [-2, 2], a logit
# bias in [-100, 100] on at most 300 tokens.
PENALTY_MAX = 2.0
BIAS_MAX = 100.0
MAX_LOGIT_BIAS = 300


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """One request's sampling controls. ``presence_penalty`` / ``frequency_penalty`` act on
    the completion's tokens so far (OpenAI); ``repetition_penalty`` on the prompt's and the
    completion's (vLLM: a positive logit is divided by it, a negative one multiplied);
    ``logit_bias``: (token id, bias) pairs added to the logits; ``min_tokens``: the stop ids
    (eos unless ``ignore_eos``, ``stop_token_ids``) are masked until that many tokens."""

    max_tokens: int
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_p: float = 0.0  # 0 = off
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # 1 = off
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError("'max_tokens' must be at least 1")
        if self.temperature < 0:
            raise ValueError("'temperature' must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("'top_p' must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError("'top_k' must be >= 0")
        if not 0 <= self.min_p <= 1:
            raise ValueError("'min_p' must be in [0, 1]")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -PENALTY_MAX <= getattr(self, name) <= PENALTY_MAX:
                raise ValueError(f"'{name}' must be in [-2, 2]")
        if not 0 < self.repetition_penalty < float("inf"):
            raise ValueError("'repetition_penalty' must be a finite number > 0")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"'logit_bias' takes at most {MAX_LOGIT_BIAS} tokens")
        if any(not -BIAS_MAX <= bias <= BIAS_MAX for _, bias in self.logit_bias):
            raise ValueError("'logit_bias' values must be in [-100, 100]")
        if len({token for token, _ in self.logit_bias}) != len(self.logit_bias):
            raise ValueError("'logit_bias' names a token twice")
        if self.min_tokens < 0:
            raise ValueError("'min_tokens' must be >= 0")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @property
    def penalized(self) -> bool:
        """Penalties need the sequence's token counts."""
        return bool(self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0)


@dataclass(slots=True)
class GenerationRequest:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    tenant: str = ""
    # Liquid memory: start from a saved KV session / save the prompt's KV.
    load_session: str | None = None
    match_session: bool = False  # no load_session: load the tenant's longest saved prefix
    save_session: str | None = None
    save_final_session: str | None = None  # pin prompt+completion KV when it ends
    # Structured output: an xgrammar CompiledGrammar (opaque here, see
    # station.sampling.grammar); None: unconstrained.
    grammar: Any = None
    # ``n`` choices share the prompt's prefill (``station.engine.forks``);
    # ``logprobs``: top alternatives per sampled token (None: no logprobs);
    # ``prompt_logprobs``: the same for every prompt token (no prefix-cache reuse then).
    n: int = 1
    logprobs: int | None = None
    prompt_logprobs: int | None = None


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
        if any(not 0 <= t < vocab for t in token_ids):
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
class Prefill:
    """The prompt is fully prefilled (reported with its first token)."""

    request_id: str
    prompt_tokens: int
    cached_tokens: int  # prompt tokens whose KV came from the prefix cache or a session
    prefill_ms: float
    session_loaded: bool = False
    session_id: str | None = None  # the session the prompt started from, when one was
    session_tokens: int = 0  # of cached_tokens: served by that session
    session_tier: str | None = None  # where that session's KV was: "pool" | "host" | "disk"
    session_error: str | None = None  # why no session was loaded (SessionOutcome value)
    saved: bool = False  # save_session pinned the prompt's full blocks
    save_error: str | None = None
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
    finish_reason: str  # "stop" | "length" | "cancelled"
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
