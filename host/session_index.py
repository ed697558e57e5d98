"""The host's index of the station's KV sessions: which saved prefix a prompt should load.

The station is the source of truth (it expires sessions LRU under its budget and may lose
them in a restart without persistence): the index is rebuilt from ``kv_session.list`` on
every connect, and a session the station reports missing is dropped. Sessions are scoped
per tenant (``gnosis_daemon.api_keys``): a plan never names another tenant's session.

Session ids carry the tenant and a digest, never the caller's text: ``<tenant>.p.<digest of
the prompt>`` (the prompt's KV, saved when its prefill ends), ``<tenant>.c.<random>`` (prompt
+ completion, saved when the generation finishes), ``<tenant>.n.<digest of the name>`` (a
named session: ``session_id`` / ``prompt_cache_key`` / ``user``, replaced on every turn).
"""

from __future__ import annotations

import hashlib
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Sequence

from gnosis_daemon.tokens import common_prefix_len


def _digest(*parts: object) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(repr(part).encode())
        h.update(b"\0")
    return h.hexdigest()[:24]


@dataclass(frozen=True, slots=True)
class Plan:
    tenant: str
    load_session: str | None  # the tenant's session sharing the longest prefix, if worth loading
    load_tokens: int  # prompt tokens that session covers (the station reuses its full blocks)
    save_session: str
    save_final_session: str


class SessionIndex:
    """Per-tenant sessions in LRU order (most recently used last), at most ``budget``."""

    def __init__(self, budget: int) -> None:
        assert budget >= 1
        self.budget = budget
        self._sessions: OrderedDict[str, tuple[str, tuple[int, ...]]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._sessions)

    def __contains__(self, session_id: object) -> bool:
        return session_id in self._sessions

    def replace_all(self, sessions: Sequence[dict[str, Any]]) -> None:
        """Load the station's ``kv_session.list`` (least recently used first)."""
        self._sessions.clear()
        # The list crosses a process boundary: an entry that is not well formed is skipped
        # (it only costs a miss), never allowed to break the connect.
        valid = [e for e in sessions if isinstance(e, dict) and _well_formed(e)]
        for entry in sorted(valid, key=lambda e: float(e.get("last_used") or 0)):
            self.put(entry["session_id"], str(entry.get("tenant") or ""), entry["tokens"])

    def put(self, session_id: str, tenant: str, tokens: Sequence[int]) -> None:
        self._sessions[session_id] = (tenant, tuple(tokens))
        self._sessions.move_to_end(session_id)
        while len(self._sessions) > self.budget:
            self._sessions.popitem(last=False)

    def drop(self, session_id: str) -> None:
        self._sessions.pop(session_id, None)

    def tokens(self, session_id: str) -> tuple[int, ...] | None:
        entry = self._sessions.get(session_id)
        return None if entry is None else entry[1]

    def longest_prefix(self, tenant: str, tokens: Sequence[int]) -> tuple[str | None, int]:
        """The tenant's session sharing the longest common prefix with ``tokens``."""
        best_id, best_len = None, 0
        prompt = tuple(tokens)
        for session_id, (owner, saved) in self._sessions.items():
            if owner != tenant:
                continue
            n = common_prefix_len(saved, prompt)
            if n > best_len:
                best_id, best_len = session_id, n
        if best_id is not None:
            self._sessions.move_to_end(best_id)
        return best_id, best_len

    def plan(self, tenant: str, tokens: Sequence[int], name: str | None, *,
             min_tokens: int = 1) -> Plan:
        """Which session to load (only when it covers ``min_tokens``: the station reuses
        whole blocks, so a shorter common prefix saves nothing) and where to save."""
        session_id, covered = self.longest_prefix(tenant, tokens)
        if covered < max(1, min_tokens):
            session_id, covered = None, 0
        if name:
            save = final = f"{tenant}.n.{_digest(tenant, name)}"
        else:
            save = f"{tenant}.p.{_digest(tenant, tuple(tokens))}"
            final = f"{tenant}.c.{uuid.uuid4().hex[:24]}"
        return Plan(tenant, session_id, covered, save, final)


def _well_formed(entry: dict[str, Any]) -> bool:
    tokens = entry.get("tokens")
    return (isinstance(entry.get("session_id"), str) and bool(entry["session_id"])
            and isinstance(tokens, list) and bool(tokens)
            and all(isinstance(t, int) for t in tokens)
            and isinstance(entry.get("last_used") or 0, (int, float)))
