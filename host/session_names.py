"""The ids the host saves KV sessions under (which session a prompt loads is the station's
choice: ``generate``'s ``match_session``, see docs/engine.md "Who matches prompts to sessions").

Session ids carry the tenant and a digest, never the caller's text: ``<tenant>.p.<digest of
the prompt>`` (the prompt's KV, saved when its prefill ends: the same prompt saves under the
same id), ``<tenant>.c.<random>`` (prompt + completion, saved when the generation finishes),
``<tenant>.n.<digest of the name>`` (a named session: ``session_id`` / ``prompt_cache_key`` /
``user``, replaced on every turn), ``<tenant>.r.<digest of the response id>`` (a stored
``/v1/responses`` answer's prompt + output, which its follow-up loads), ``<tenant>.t.<digest
of the prefix>`` (a TTL pin: the same prefix pins under the same id, so a repeated
breakpoint refreshes one pin). Sessions are scoped per tenant
(``gnosis_daemon.api_keys``): the station only ever matches a tenant's own sessions.
"""

from __future__ import annotations

import hashlib
import uuid
from dataclasses import dataclass
from typing import Any


def _digest(*parts: object) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(repr(part).encode())
        h.update(b"\0")
    return h.hexdigest()[:24]


@dataclass(frozen=True, slots=True)
class SaveIds:
    tenant: str
    save_session: str  # the prompt's KV, when its prefill ends
    save_final_session: str  # prompt + completion, when the generation ends


def save_ids(tenant: str, prompt: Any, name: str | None) -> SaveIds:
    """Where a completion's KV is saved. ``prompt`` is what the station tokenizes (the
    ``generate`` arguments that make the prompt: messages, or a text prompt and whether
    special tokens are added), so one prompt always digests to one id."""
    if name:
        save = final = f"{tenant}.n.{_digest(tenant, name)}"
    else:
        save = f"{tenant}.p.{_digest(tenant, prompt)}"
        final = f"{tenant}.c.{uuid.uuid4().hex[:24]}"
    return SaveIds(tenant, save, final)


def response_session(tenant: str, response_id: str) -> str:
    """The session a stored response's conversation (prompt + output) is saved under."""
    return f"{tenant}.r.{_digest(tenant, response_id)}"


def pin_session(tenant: str, prefix: Any) -> str:
    """The session a TTL pin of ``prefix`` (what the station renders and pins) is saved
    under: one id per tenant and prefix."""
    return f"{tenant}.t.{_digest(tenant, prefix)}"

