"""Per-tenant control of liquid memory: ``GET /v1/sessions``, ``DELETE /v1/sessions/{id}``
and ``DELETE /v1/sessions``.

A caller sees and deletes only its own tenant's KV sessions (``kv_session.list {tenant}``,
``kv_session.delete {tenant, forget}``): another tenant's id is a 404, as one that does not
exist, so a caller learns nothing of other tenants. A delete forgets: the session leaves
every tier (its disk files within the write-behind bound) and its blocks leave the
automatic prefix cache where nothing else holds them, so the same prompt again is a miss.
The list is also filtered here by tenant, so the answer never shows another tenant's
session whatever the station sends.
"""

from __future__ import annotations

import time
from typing import Any

import trio
from quart import Response, g

from gnosis_daemon.client import StationError
from host import errors
from host.completions import json_response
from host.errors import ApiError
from host.station_link import StationLink

_TIMEOUT_S = 30.0  # a list or delete runs in one engine turn; past this, 504


def not_found(session_id: str) -> ApiError:
    return ApiError(404, f"No session found with id '{session_id}'.", errors.INVALID_REQUEST,
                    None, "not_found")


def entry(session: dict[str, Any], now: float) -> dict[str, Any]:
    """One session as the API shows it."""
    last_used = session.get("last_used")
    return {"id": session.get("session_id"), "object": "session",
            "tokens": session.get("num_tokens"), "tier": session.get("tier"),
            "age_s": None if last_used is None else round(max(0.0, now - last_used), 3),
            "expires_at": session.get("expires_at"), "pinned": bool(session.get("pinned")),
            "durable": session.get("durable"), "bytes": session.get("bytes")}


async def _call(link: StationLink, op: str, args: dict[str, Any]) -> Any:
    try:
        conn = link.current()
        with trio.fail_after(_TIMEOUT_S):
            return await conn.request(op, args)
    except StationError as exc:
        raise errors.from_station(exc, "session_id") from None
    except trio.TooSlowError:
        raise ApiError(504, f"The model station did not answer {op} within {_TIMEOUT_S:g} s.",
                       errors.SERVER_ERROR, None, "timeout") from None


async def sessions(link: StationLink, tenant: str) -> list[dict[str, Any]]:
    """The tenant's sessions as the station lists them (most recently used first)."""
    listed = await _call(link, "kv_session.list", {"tenant": tenant})
    return [s for s in (listed or {}).get("sessions", []) if s.get("tenant") == tenant]


def register(app: Any, link: StationLink) -> None:
    """The routes, on the host's app (``host.app.create_app``)."""

    @app.get("/v1/sessions")
    async def list_sessions() -> Response:
        now = time.time()
        data = [entry(s, now) for s in await sessions(link, g.tenant)]
        return json_response({"object": "list", "data": data})

    @app.delete("/v1/sessions/<session_id>")
    async def delete_session(session_id: str) -> Response:
        # The station checks the tenant too; asking first keeps another tenant's id a 404
        # on a station that predates the tenant argument.
        if not any(s.get("session_id") == session_id for s in await sessions(link, g.tenant)):
            raise not_found(session_id)
        result = await _call(link, "kv_session.delete", {"session_id": session_id,
                                                         "tenant": g.tenant, "forget": True})
        if not (result or {}).get("deleted"):
            raise not_found(session_id)
        return json_response({"id": session_id, "object": "session", "deleted": True})

    @app.delete("/v1/sessions")
    async def delete_sessions() -> Response:
        result = await _call(link, "kv_session.delete", {"all": True, "tenant": g.tenant,
                                                         "forget": True})
        return json_response({"object": "list", "deleted": int((result or {}).get("deleted")
                                                                or 0)})
