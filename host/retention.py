"""OpenAI's ``prompt_cache_retention`` on chat, completions and responses.

``"in_memory"`` (or no value) is liquid memory as it always is: the prompt's KV is saved as
an ordinary session, which the session budget and pool pressure may expire. ``"24h"`` asks
the station to also keep the whole prompt as a TTL pin (``generate``'s ``pins``, capability
``kv_session_pins``) for ``cache_retention_24h_s``, refreshed by every hit: the budgets do
not drop it, and at expiry it is deleted from every tier. The pin's session id is a digest
of the tenant and the prompt (``host.session_names.pin_session``), so the same prompt
refreshes one pin. A station that cannot pin (or liquid memory off) answers ``"24h"`` with
a 400 naming the field: the retention asked for is never silently shortened.
"""

from __future__ import annotations

from typing import Any, Iterable

from gnosis_daemon.settings import Settings
from gnosis_daemon.wire.pins import PinReport
from host import errors
from host.liquid_memory import LiquidMemory
from host.metrics import RequestRecord
from host.session_names import pin_session

PIN_TTL = "24h"  # the TTL class (the pins metric's label)
# The generate arguments that make the prompt: what the pin's id digests.
_PROMPT_ARGS = ("messages", "tools", "prompt", "tokens", "add_special_tokens")


def pins(settings: Settings, memory: LiquidMemory, retention: str | None, tenant: str,
         station_args: dict[str, Any]) -> list[dict[str, Any]] | None:
    """``generate``'s pins for ``retention`` (None: none asked)."""
    if retention != "24h":
        return None
    if not memory.can_pin():
        state = memory.state(connected=True)
        why = state.reason or "the model station lacks kv_session_pins"
        raise errors.unsupported("prompt_cache_retention", f"'24h' cannot be honoured by this "
                                 f"server right now ({why}).")
    prompt = tuple((k, station_args[k]) for k in _PROMPT_ARGS if k in station_args)
    return [{"session_id": pin_session(tenant, prompt),
             "ttl_s": float(settings.cache_retention_24h_s)}]


def note_pins(record: RequestRecord, reports: Iterable[PinReport]) -> None:
    """Count what became of the request's pins (the prefill event's ``pins``)."""
    for report in reports:
        if report.pinned:
            outcome = "read" if report.read_tokens > 0 else "created"
        else:
            outcome = "downgraded" if report.reason == "pin_budget" else "refused"
        record.pins.append((PIN_TTL, outcome))
