"""Liquid-memory policy and what each completion reports about it.

Liquid memory is effective only when ``THOTH_LIQUID_MEMORY`` is on AND the station has
``kv_session`` AND a decode path (DESIGN.md, "never degrade silently"). This host does not
implement the liquid path yet, so ``LiquidPolicy`` always answers "disabled" with the first
reason that applies; issue 4 replaces the policy, and ``gnosis_block`` / ``headers`` stay.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gnosis_daemon.protocol import Capability

OUTCOMES = ("hit", "miss", "capture_failed", "disabled")
PATHS = ("liquid", "native")


@dataclass(frozen=True, slots=True)
class LiquidOutcome:
    """What liquid memory did for one completion (known when its prefill ends)."""

    liquid_memory: str  # one of OUTCOMES
    liquid_kv_saved: bool
    miss_reason: str | None
    path: str  # one of PATHS

    def __post_init__(self) -> None:
        assert self.liquid_memory in OUTCOMES, self.liquid_memory
        assert self.path in PATHS, self.path
        assert self.path == "native" or self.liquid_memory != "disabled"


@dataclass(frozen=True, slots=True)
class LiquidState:
    """The host-wide effective state that /health reports."""

    enabled: bool
    env: bool
    station_kv_session: bool
    reason: str | None  # why it is off; None when on

    def health_fields(self) -> dict[str, Any]:
        return {"liquid_memory": self.enabled, "liquid_memory_env": self.env,
                "station_kv_session": self.station_kv_session,
                "liquid_memory_reason": self.reason}


class LiquidPolicy:
    def __init__(self, env_enabled: bool) -> None:
        self.env_enabled = env_enabled

    def state(self, capabilities: dict[str, Any] | None) -> LiquidState:
        caps = capabilities or {}
        kv_session = bool(caps.get(Capability.KV_SESSION))
        decode_path = bool(caps.get(Capability.GENERATE) or caps.get(Capability.DECODE_NEXT))
        if not self.env_enabled:
            reason = "disabled by THOTH_LIQUID_MEMORY=0"
        elif capabilities is None:
            reason = "station not connected"
        elif not kv_session:
            reason = "station lacks the kv_session capability"
        elif not decode_path:
            reason = "station lacks a decode path (generate or decode_next)"
        else:
            reason = "liquid memory is not implemented in this host yet"
        return LiquidState(False, self.env_enabled, kv_session, reason)

    def outcome(self, capabilities: dict[str, Any] | None) -> LiquidOutcome:
        state = self.state(capabilities)
        return LiquidOutcome("disabled", False, state.reason, "native")


def gnosis_block(outcome: LiquidOutcome, *, prompt_tokens: int, completion_tokens: int,
                 cached_tokens: int, ttft_ms: float | None,
                 tokens_per_second: float | None) -> dict[str, Any]:
    """The ``_gnosis`` object of a completion (the last chunk when streaming)."""
    return {
        "liquid_memory": outcome.liquid_memory,
        "liquid_kv_saved": outcome.liquid_kv_saved,
        "liquid_miss_reason": outcome.miss_reason,
        "path": outcome.path,
        "cached_tokens": cached_tokens,
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "ttft_ms": None if ttft_ms is None else round(float(ttft_ms), 3),
        "tokens_per_second": None if tokens_per_second is None else round(float(tokens_per_second), 3),
    }


def headers(outcome: LiquidOutcome) -> dict[str, str]:
    return {"X-Thoth-Liquid-Memory": outcome.liquid_memory,
            "X-Thoth-Liquid-KV-Saved": "true" if outcome.liquid_kv_saved else "false"}
