"""Capability negotiation: what the connected station can do, and how each answer was learned.

Capabilities are negotiated, never assumed (DESIGN.md, "The failure this project exists to
prevent"): an explicit flag in ``hello`` is trusted, true or false; an absent flag is probed
with the op itself, where ``unknown_op`` means unsupported and any other answer (a result,
``bad_request``, ``not_found``...) means the station has the op. ``negotiate`` runs on every
(re)connect, so a station that gains a capability is noticed without a host restart.

Error handling: a connection lost during a probe raises ``StationUnavailable`` (the link
reconnects and negotiates again); it is never read as "unsupported" or "supported".
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from gnosis_daemon.client import StationConnection, StationError, StationUnavailable, is_unknown_op
from gnosis_daemon.logs import get_logger
from gnosis_daemon.protocol import Capability

log = get_logger("host.capabilities")

# The ops liquid memory and the API depend on: negotiated (flag or probe) on every connect.
NEGOTIATED = (Capability.GENERATE, Capability.KV_SESSION, Capability.DECODE_NEXT,
              Capability.FORWARD, Capability.EMBED)
DECODE_PATHS = (Capability.GENERATE, Capability.DECODE_NEXT)
FLAG, PROBE = "flag", "probe"


@dataclass(frozen=True, slots=True)
class Negotiated:
    """Every capability the station was asked about, and how the answer was learned."""

    flags: dict[str, bool]  # capability -> supported
    learned: dict[str, str]  # capability -> FLAG | PROBE

    def has(self, capability: str) -> bool:
        return self.flags.get(capability, False)

    @property
    def kv_session(self) -> bool:
        return self.has(Capability.KV_SESSION)

    @property
    def decode_path(self) -> bool:
        return any(self.has(name) for name in DECODE_PATHS)


async def probe(conn: StationConnection, op: str, args: dict[str, Any]) -> bool:
    """True unless the station answers ``unknown_op``."""
    try:
        await conn.request(op, args)
    except StationUnavailable:
        raise
    except StationError as exc:
        return not is_unknown_op(exc)
    return True


async def _probe_kv_session(conn: StationConnection) -> bool:
    # A session of prefix length 0 pins nothing; delete it at once so it never counts
    # against the station's session budget.
    probe_id = f"probe-{uuid.uuid4().hex}"
    supported = await probe(conn, "kv_session.save",
                            {"session_id": probe_id, "tokens": [], "prefix_len": 0})
    if supported:
        await probe(conn, "kv_session.delete", {"session_id": probe_id})
    return supported


async def negotiate(conn: StationConnection, hello: dict[str, Any]) -> Negotiated:
    """Trust explicit flags; probe each absent one with its op."""
    advertised = hello.get("capabilities") or {}
    flags: dict[str, bool] = {}
    learned: dict[str, str] = {}
    for name in NEGOTIATED:
        if name.value in advertised:
            flags[name.value] = bool(advertised[name.value])
            learned[name.value] = FLAG
            continue
        learned[name.value] = PROBE
        if name is Capability.KV_SESSION:
            flags[name.value] = await _probe_kv_session(conn)
        else:
            # Empty arguments: a station that has the op answers bad_request (supported).
            flags[name.value] = await probe(conn, name.value, {})
    # Flags outside NEGOTIATED (paged_kv, prefix_cache...) are informational: taken as given.
    for name, value in advertised.items():
        if name not in flags:
            flags[name] = bool(value)
            learned[name] = FLAG
    log.info("station_capabilities_negotiated", flags=flags, learned=learned)
    return Negotiated(flags, learned)
