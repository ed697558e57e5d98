"""Liquid memory in the host: negotiation on connect, and each completion's liquid plan.

``LiquidMemory.on_connect`` is the ``StationLink`` hook: on every (re)connect it negotiates
the station's capabilities (``host.capabilities``). The station is the one index of the KV
sessions: the host keeps no copy, so a restarted host hits the sessions its station holds
at once, and a connect costs no listing however many sessions there are.

Per completion, ``prepare`` picks the path. When liquid memory is effective: the station's
native ``generate`` with the same prompt arguments plus ``tenant``, ``match_session`` (the
station loads the tenant's saved session sharing the longest prefix with the prompt, at
admission, from the block hashes it computes anyway), ``save_session`` and
``save_final_session``. That is the same decode loop as the native path, so liquid memory
never decodes slower; it only skips the prefill a saved session holds. When it is not
effective: the native path exactly as before (no session arguments), outcome ``disabled``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import trio

from gnosis_daemon.client import StationConnection, StationError
from gnosis_daemon.logs import get_logger
from gnosis_daemon.protocol import Capability, OpError
from gnosis_daemon.wire import GenerateArgs, GenerateResult, PrefillEvent
from host import liquid
from host.capabilities import Negotiated, negotiate
from host.liquid import LiquidOutcome, LiquidState
from host.session_names import SaveIds, save_ids

log = get_logger("host.liquid")

PINS = "kv_session_pins"  # generate's pins (the capability flag in hello)
# What makes the prompt: the generate arguments a save id digests.
_PROMPT_ARGS = ("messages", "tools", "prompt", "tokens", "add_special_tokens")


@dataclass(slots=True)
class Prepared:
    """One completion's station call and what liquid memory will do for it."""

    args: dict[str, Any]  # the station's generate args
    ids: SaveIds | None  # None on the native path
    match: bool = False  # the station was asked to match a saved session
    fixed: LiquidOutcome | None = None  # the native path's outcome, known before the call

    @property
    def liquid(self) -> bool:
        return self.ids is not None

    def frame(self) -> dict[str, object]:
        """The ``generate`` args as sent: read and written by their one definition
        (``gnosis_daemon.wire.GenerateArgs``), so the station gets exactly the fields it reads,
        held to the bounds it holds them to. A breach is the station's ``bad_request``."""
        try:
            return GenerateArgs.from_wire(self.args).to_wire()
        except OpError as exc:
            raise StationError(exc.code.value, exc.message) from None


class LiquidMemory:
    def __init__(self, env_enabled: bool, *, negotiate_timeout_s: float = 10.0) -> None:
        self.env_enabled = env_enabled
        self.negotiate_timeout_s = negotiate_timeout_s
        self.negotiated: Negotiated | None = None  # the last station's (kept while down)

    # -- on every (re)connect
    async def on_connect(self, conn: StationConnection, hello: dict[str, Any]) -> None:
        """Negotiate. Raises StationError/TooSlowError (the link retries) and nothing else."""
        with trio.fail_after(self.negotiate_timeout_s):
            negotiated = await negotiate(conn, hello)
        self.negotiated = negotiated
        state = self.state(connected=True)
        log.info("liquid_memory_state", effective=state.effective, reason=state.reason,
                 station_matches_sessions=self.has(Capability.KV_SESSION_MATCH))

    def state(self, *, connected: bool) -> LiquidState:
        return liquid.liquid_state(self.env_enabled, self.negotiated if connected else None)

    def has(self, capability: str) -> bool:
        return self.negotiated is not None and self.negotiated.has(capability)

    # -- per completion
    def can_pin(self) -> bool:
        """TTL pins can be asked for (``generate``'s ``pins``): liquid memory is effective and
        the station has ``kv_session_pins``. A caller refuses a pin it cannot get rather
        than drop it."""
        return self.state(connected=True).effective and self.has(PINS)

    def prepare(self, station_args: dict[str, Any], *, tenant: str,
                name: str | None, pins: list[dict[str, Any]] | None = None) -> Prepared:
        """``pins``: ``generate``'s pins (the caller has checked ``can_pin``)."""
        state = self.state(connected=True)
        if not state.effective:
            # The tenant still goes along: it salts the automatic prefix cache, so two
            # tenants never share cached blocks on the native path either.
            return Prepared({**station_args, "tenant": tenant}, None,
                            fixed=liquid.disabled(state.reason))
        prompt = tuple((k, station_args[k]) for k in _PROMPT_ARGS if k in station_args)
        ids = save_ids(tenant, prompt, name)
        match = self.has(Capability.KV_SESSION_MATCH)
        args = {**station_args, "tenant": tenant, "save_session": ids.save_session,
                "save_final_session": ids.save_final_session}
        if match:
            args["match_session"] = True
        if pins:
            args["pins"] = pins
        return Prepared(args, ids, match)

    def on_prefill(self, prepared: Prepared, event: PrefillEvent | None) -> LiquidOutcome:
        """The outcome, from the prefill event."""
        if prepared.fixed is not None:
            return prepared.fixed
        assert prepared.ids is not None
        outcome = liquid.from_prefill(event, save_asked=True, match_asked=prepared.match)
        if outcome.liquid_memory == "capture_failed":
            log.warning("liquid_capture_failed", reason=outcome.miss_reason,
                        session=prepared.ids.save_session)
        return outcome

    def on_result(self, prepared: Prepared, result: GenerateResult) -> None:
        if prepared.ids is not None and result.first.final_save_error:
            log.warning("liquid_final_save_failed", error=result.first.final_save_error,
                        session=prepared.ids.save_final_session)
