"""Liquid memory's effective state, each completion's outcome, and how both are reported.

Liquid memory is effective only when ``THOTH_LIQUID_MEMORY`` is on AND the station has
``kv_session`` AND a decode path, ``generate`` or ``decode_next`` (DESIGN.md, "never
degrade silently"); when it is off, ``LiquidState.reason`` says why, /health shows it, and
every completion carries it as ``liquid_miss_reason`` with ``liquid_memory: "disabled"``.

A liquid completion's outcome is known when its prefill ends (the station's ``prefill``
event), so the ``X-Thoth-Liquid-*`` headers go out before the first streamed byte:
``hit`` (a saved session served part of the prompt), ``capture_failed`` (a save was asked
and not confirmed: the request still completes, and says so), else ``miss``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gnosis_daemon.wire import PrefillEvent
from host.capabilities import FLAG, Negotiated

OUTCOMES = ("hit", "miss", "capture_failed", "disabled")
PATHS = ("liquid", "native")
ENV_OFF_REASON = "disabled by THOTH_LIQUID_MEMORY=0"
NOT_CONNECTED_REASON = "station not connected"
NO_DECODE_PATH_REASON = "station lacks a decode path (generate or decode_next)"
NO_SAVED_PREFIX = "no saved prefix"
NO_MATCHING = "station lacks kv_session_match: saved sessions are not loaded"
SAVE_UNCONFIRMED = "the station did not confirm the save"


@dataclass(frozen=True, slots=True)
class LiquidState:
    """The host-wide effective state that /health reports."""

    effective: bool
    env: bool
    station_kv_session: bool
    reason: str | None  # why it is off; None when on

    def __post_init__(self) -> None:
        assert self.effective == (self.reason is None), (self.effective, self.reason)

    def health_fields(self) -> dict[str, Any]:
        return {"liquid_memory": self.effective, "liquid_memory_env": self.env,
                "station_kv_session": self.station_kv_session,
                "liquid_memory_reason": self.reason}


def kv_session_reason(negotiated: Negotiated) -> str:
    how = negotiated.learned.get("kv_session", FLAG)
    detail = "flag false in hello" if how == FLAG else "unknown_op on probe"
    return f"station lacks the kv_session capability ({detail})"


def liquid_state(env: bool, negotiated: Negotiated | None) -> LiquidState:
    """Effective = env AND kv_session AND a decode path; otherwise every reason that applies."""
    if negotiated is None:
        reasons = [ENV_OFF_REASON] if not env else []
        reasons.append(NOT_CONNECTED_REASON)
        return LiquidState(False, env, False, "; ".join(reasons))
    reasons = []
    if not env:
        reasons.append(ENV_OFF_REASON)
    if not negotiated.kv_session:
        reasons.append(kv_session_reason(negotiated))
    if not negotiated.decode_path:
        reasons.append(NO_DECODE_PATH_REASON)
    reason = "; ".join(reasons) or None
    return LiquidState(reason is None, env, negotiated.kv_session, reason)


@dataclass(frozen=True, slots=True)
class LiquidOutcome:
    """What liquid memory did for one completion (known when its prefill ends)."""

    liquid_memory: str  # one of OUTCOMES
    liquid_kv_saved: bool
    miss_reason: str | None
    path: str  # one of PATHS
    tier: str | None = None  # a hit: where the session's KV was ("pool" | "host" | "disk")

    def __post_init__(self) -> None:
        assert self.liquid_memory in OUTCOMES, self.liquid_memory
        assert self.path in PATHS, self.path
        assert (self.path == "native") == (self.liquid_memory == "disabled"), self
        assert self.liquid_memory != "hit" or self.miss_reason is None, self


def disabled(reason: str | None) -> LiquidOutcome:
    return LiquidOutcome("disabled", False, reason, "native")


def from_prefill(event: PrefillEvent | None, *, save_asked: bool,
                 match_asked: bool) -> LiquidOutcome:
    """The outcome of a liquid completion from the station's ``prefill`` event (None: the
    stream had none); the station was asked to match the tenant's sessions
    (``match_asked``) when it can."""
    event = event or PrefillEvent(prompt_tokens=0, cached_tokens=0)
    saved = event.saved and save_asked
    if event.session_loaded and event.session_tokens > 0:
        return LiquidOutcome("hit", saved, None, "liquid", event.session_tier or "pool")
    if save_asked and not saved:
        # A station that ignored the save arguments (no ``saved`` field) is a failed
        # capture too: the failure this project exists to prevent is a silent one.
        return LiquidOutcome("capture_failed", False, event.save_error or SAVE_UNCONFIRMED,
                             "liquid")
    if event.session_error:
        reason = event.session_error
    elif match_asked:
        reason = NO_SAVED_PREFIX  # no session of the tenant shares a full block with it
    else:
        reason = NO_MATCHING  # saved, but this station cannot say which session to load
    return LiquidOutcome("miss", saved, reason, "liquid")


def gnosis_block(outcome: LiquidOutcome, *, prompt_tokens: int, completion_tokens: int,
                 cached_tokens: int, ttft_ms: float | None,
                 tokens_per_second: float | None) -> dict[str, Any]:
    """The ``_gnosis`` object of a completion (the last chunk when streaming)."""
    return {
        "liquid_memory": outcome.liquid_memory,
        "liquid_kv_saved": outcome.liquid_kv_saved,
        "liquid_miss_reason": outcome.miss_reason,
        "path": outcome.path,
        "tier": outcome.tier,
        "cached_tokens": cached_tokens,
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "ttft_ms": None if ttft_ms is None else round(float(ttft_ms), 3),
        "tokens_per_second": None if tokens_per_second is None else round(float(tokens_per_second), 3),
    }


def headers(outcome: LiquidOutcome) -> dict[str, str]:
    return {"X-Thoth-Liquid-Memory": outcome.liquid_memory,
            "X-Thoth-Liquid-KV-Saved": "true" if outcome.liquid_kv_saved else "false"}
