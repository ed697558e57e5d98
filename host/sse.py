"""Server-sent events framing, as OpenAI streams it: ``data: <json>\\n\\n`` ... ``data: [DONE]``."""

from __future__ import annotations

import json
from typing import Any

DONE = b"data: [DONE]\n\n"
HEADERS = {
    "Content-Type": "text/event-stream; charset=utf-8",
    "Cache-Control": "no-cache",
    # Proxies (nginx) buffer responses unless told not to, which would hold every token back.
    "X-Accel-Buffering": "no",
}


def encode_json(obj: Any) -> str:
    # Compact and UTF-8 as-is: one event per line, no ASCII escaping of generated text.
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def event(obj: dict[str, Any]) -> bytes:
    """One SSE event carrying ``obj`` as JSON. JSON never contains a raw newline, so the
    event cannot be split by the blank-line terminator."""
    return b"data: " + encode_json(obj).encode("utf-8") + b"\n\n"


def take(pending: list[bytes]) -> bytes:
    """The events ``pending`` holds, as one write, and ``pending`` emptied. A stream body
    writes what is ready together before it would wait for the station, and at its end
    (host/sse_body.py, host/messages.py)."""
    joined = b"".join(pending)
    pending.clear()
    return joined
