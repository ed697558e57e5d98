"""Liquid memory in the host: negotiation on connect, and each completion's liquid plan.

``LiquidMemory.on_connect`` is the ``StationLink`` hook: on every (re)connect it negotiates
the station's capabilities (``host.capabilities``) and rebuilds the session index from
``kv_session.list`` (so a restarted host keeps hitting the sessions its station holds).

Per completion, ``prepare`` picks the path. When liquid memory is effective: tokenize in
the station (chat template applied there, so the tokens are the ones ``generate`` would
use), plan against the tenant's sessions, and call the station's native ``generate`` with
``tokens`` + ``load_session`` + ``save_session`` + ``save_final_session`` + ``tenant``.
That is the same decode loop as the native path, so liquid memory never decodes slower; it
only skips the prefill a saved session holds. When it is not effective: the native path
exactly as before (no tokenize round trip, no session arguments), outcome ``disabled``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import trio

from gnosis_daemon.client import StationConnection, StationError, StationUnavailable
from gnosis_daemon.logs import get_logger
from host import liquid
from host.capabilities import Negotiated, negotiate
from host.liquid import LiquidOutcome, LiquidState
from host.session_index import Plan, SessionIndex

log = get_logger("host.liquid")

# Session errors after which the index entry is stale (the station no longer has it for
# this tenant); "no_common_prefix" keeps it, it may serve another prompt.
_STALE_SESSION_ERRORS = ("not_found", "tenant_mismatch")


@dataclass(slots=True)
class Prepared:
    """One completion's station call and what liquid memory will do for it."""

    args: dict[str, Any]  # the station's generate args
    plan: Plan | None  # None on the native path
    prompt_tokens: tuple[int, ...] = ()
    fixed: LiquidOutcome | None = None  # the native path's outcome, known before the call

    @property
    def liquid(self) -> bool:
        return self.plan is not None


class LiquidMemory:
    def __init__(self, env_enabled: bool, budget: int, *, negotiate_timeout_s: float = 10.0,
                 ) -> None:
        self.env_enabled = env_enabled
        self.negotiate_timeout_s = negotiate_timeout_s
        self.negotiated: Negotiated | None = None  # the last station's (kept while down)
        self.index = SessionIndex(budget)
        self.block_size = 1

    # -- on every (re)connect
    async def on_connect(self, conn: StationConnection, hello: dict[str, Any]) -> None:
        """Negotiate and rebuild the index. Raises StationError/TooSlowError (the link
        retries) and nothing else: a bad answer to kv_session.list only empties the index."""
        with trio.fail_after(self.negotiate_timeout_s):
            negotiated = await negotiate(conn, hello)
            sessions: list[dict[str, Any]] = []
            if negotiated.kv_session:
                try:
                    listed = await conn.request("kv_session.list", {"include_tokens": True})
                    sessions = list(listed.get("sessions") or [])
                except StationUnavailable:
                    raise
                except StationError as exc:
                    log.warning("kv_session_list_failed", error=str(exc))
        self.block_size = max(1, int((hello.get("kv_pool") or {}).get("block_size") or 1))
        self.index.replace_all(sessions)
        self.negotiated = negotiated
        state = self.state(connected=True)
        log.info("liquid_memory_state", effective=state.effective, reason=state.reason,
                 sessions=len(self.index))

    def state(self, *, connected: bool) -> LiquidState:
        return liquid.liquid_state(self.env_enabled, self.negotiated if connected else None)

    def has(self, capability: str) -> bool:
        return self.negotiated is not None and self.negotiated.has(capability)

    # -- per completion
    async def prepare(self, conn: StationConnection, station_args: dict[str, Any], *,
                      tenant: str, name: str | None, rid: str | None) -> Prepared:
        state = self.state(connected=True)
        if not state.effective:
            # The tenant still goes along: it salts the automatic prefix cache, so two
            # tenants never share cached blocks on the native path either.
            return Prepared({**station_args, "tenant": tenant}, None,
                            fixed=liquid.disabled(state.reason))
        tokens = await _prompt_tokens(conn, station_args, rid)
        plan = self.index.plan(tenant, tokens, name, min_tokens=self.block_size)
        args = {k: v for k, v in station_args.items() if k not in ("messages", "prompt")}
        args.update(tokens=list(tokens), tenant=tenant, save_session=plan.save_session,
                    save_final_session=plan.save_final_session)
        if plan.load_session is not None:
            args["load_session"] = plan.load_session
        return Prepared(args, plan, tuple(tokens))

    def on_prefill(self, prepared: Prepared, event: dict[str, Any] | None) -> LiquidOutcome:
        """The outcome, from the prefill event; the index learns the saved prompt at once
        (so a concurrent request with the same prefix can already load it)."""
        if prepared.fixed is not None:
            return prepared.fixed
        plan = prepared.plan
        assert plan is not None
        outcome = liquid.from_prefill(event, loaded_asked=plan.load_session is not None,
                                      save_asked=True)
        event = event or {}
        if plan.load_session is not None and event.get("session_error") in _STALE_SESSION_ERRORS:
            self.index.drop(plan.load_session)
        if outcome.liquid_kv_saved:
            self.index.put(plan.save_session, plan.tenant, prepared.prompt_tokens)
        elif outcome.liquid_memory == "capture_failed":
            log.warning("liquid_capture_failed", reason=outcome.miss_reason,
                        session=plan.save_session)
        return outcome

    def on_result(self, prepared: Prepared, result: dict[str, Any]) -> None:
        plan = prepared.plan
        if plan is None:
            return
        if result.get("final_saved"):
            completion = tuple(int(t) for t in result.get("token_ids") or ())
            self.index.put(plan.save_final_session, plan.tenant,
                           prepared.prompt_tokens + completion)
        elif result.get("final_save_error"):
            log.warning("liquid_final_save_failed", error=result["final_save_error"],
                        session=plan.save_final_session)


async def _prompt_tokens(conn: StationConnection, args: dict[str, Any],
                         rid: str | None) -> list[int]:
    """The prompt's tokens exactly as ``generate`` would build them from the same args."""
    if "tokens" in args:
        return list(args["tokens"])
    if "messages" in args:
        request = {"messages": args["messages"], "add_generation_prompt": True}
    else:
        # generate's own default for a text prompt is to add the tokenizer's special tokens.
        request = {"text": args["prompt"],
                   "add_special_tokens": bool(args.get("add_special_tokens", True))}
    result = await conn.request("tokenize", request, rid=rid)
    return [int(t) for t in result.get("tokens") or ()]
