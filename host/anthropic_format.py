"""Anthropic response shapes (pure): the ``message`` object, its ``usage``, the streamed
events, and the error body every ``/v1/messages`` error carries.

A stream is Anthropic's event sequence, each event ``event: <type>`` + ``data: <json>``:
``message_start`` (the message with no content, the prompt's usage), then per content block
``content_block_start``, its deltas (``text_delta`` / ``input_json_delta``) and
``content_block_stop`` (one ``ping`` after the first block's start), then ``message_delta``
(``stop_reason``, ``stop_sequence``, the final usage and the ``_gnosis`` block) and
``message_stop``. A failure once the stream is open is an ``error`` event, as Anthropic
sends one.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from host import sse
from host.cache_pins import PinUsage
from host.tool_calls import ToolCall

# HTTP status -> Anthropic's error type (https://docs.anthropic.com/en/api/errors).
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               403: "permission_error", 404: "not_found_error", 413: "request_too_large",
               429: "rate_limit_error", 500: "api_error", 503: "overloaded_error",
               529: "overloaded_error"}


def error_type(status: int) -> str:
    return ERROR_TYPES.get(status) or ("api_error" if status >= 500 else "invalid_request_error")


def error_body(status: int, message: str, request_id: str | None) -> dict[str, Any]:
    body: dict[str, Any] = {"type": "error",
                            "error": {"type": error_type(status), "message": message}}
    if request_id is not None:
        body["request_id"] = request_id
    return body


def usage(prompt_tokens: int, output_tokens: int, pins: PinUsage) -> dict[str, Any]:
    """Anthropic's usage: ``input_tokens`` are the prompt tokens past the last cache
    breakpoint (neither read from nor written to a pin), as Anthropic counts them."""
    return {"input_tokens": max(0, prompt_tokens - pins.read - pins.creation),
            "output_tokens": output_tokens,
            "cache_creation_input_tokens": pins.creation,
            "cache_read_input_tokens": pins.read,
            "cache_creation": {"ephemeral_5m_input_tokens": pins.creation_5m,
                               "ephemeral_1h_input_tokens": pins.creation_1h}}


def tool_use(call: ToolCall) -> dict[str, Any]:
    """A parsed call as a ``tool_use`` block (``toolu_`` id, ``input`` the arguments' object)."""
    try:
        arguments = json.loads(call.arguments)
    except ValueError:
        arguments = {}
    return {"type": "tool_use", "id": "toolu_" + call.id.removeprefix("call_"),
            "name": call.name, "input": arguments if isinstance(arguments, dict) else {}}


def stop_reason(finish_reason: str, calls: bool, stop_sequence: str | None) -> str:
    if calls:
        return "tool_use"
    if finish_reason == "length":
        return "max_tokens"
    return "stop_sequence" if stop_sequence is not None else "end_turn"


def matched_stop(full_text: str, text: str, stops: tuple[str, ...]) -> str | None:
    """The stop sequence that ended the output: the earliest one in the decoded tokens past
    the text the answer kept (None: the model's own end of turn)."""
    tail = full_text[len(text):] if full_text.startswith(text) else full_text
    found = [(tail.find(s), -len(s), s) for s in stops if s in tail]
    return min(found)[2] if found else None


class MessageFormatter:
    """One answer's objects: one ``msg_`` id and model for the message and its events."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.id = "msg_" + uuid.uuid4().hex[:24]
        self.blocks = 0  # content blocks opened so far (the next one's index)
        self.open: str | None = None  # the open block's type
        self.pinged = False

    def message(self, content: list[dict[str, Any]], stop: str | None, stop_sequence: str | None,
                usage_: dict[str, Any], gnosis: dict[str, Any] | None) -> dict[str, Any]:
        out = {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
               "content": content, "stop_reason": stop, "stop_sequence": stop_sequence,
               "usage": usage_}
        if gnosis is not None:
            out["_gnosis"] = gnosis
        return out

    # -- streamed events
    def start(self, usage_: dict[str, Any]) -> bytes:
        return event("message_start", {"type": "message_start",
                                       "message": self.message([], None, None, usage_, None)})

    def text(self, text: str) -> list[bytes]:
        """Text, in the open text block (opened when none is)."""
        if not text:
            return []
        out = [] if self.open == "text" else self._open({"type": "text", "text": ""})
        out.append(event("content_block_delta", {
            "type": "content_block_delta", "index": self.blocks - 1,
            "delta": {"type": "text_delta", "text": text}}))
        return out

    def call(self, call: ToolCall) -> list[bytes]:
        """A whole call: its block's start (``input`` empty), its JSON, its stop."""
        block = tool_use(call)
        out = self._open({**block, "input": {}})
        out.append(event("content_block_delta", {
            "type": "content_block_delta", "index": self.blocks - 1,
            "delta": {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}}))
        out += self.close()
        return out

    def close(self) -> list[bytes]:
        if self.open is None:
            return []
        self.open = None
        return [event("content_block_stop", {"type": "content_block_stop",
                                             "index": self.blocks - 1})]

    def end(self, stop: str, stop_sequence: str | None, usage_: dict[str, Any],
            gnosis: dict[str, Any]) -> list[bytes]:
        out = self.close() + self._ping()
        out.append(event("message_delta", {
            "type": "message_delta", "delta": {"stop_reason": stop, "stop_sequence": stop_sequence},
            "usage": usage_, "_gnosis": gnosis}))
        out.append(event("message_stop", {"type": "message_stop"}))
        return out

    def _open(self, block: dict[str, Any]) -> list[bytes]:
        out = self.close()
        out.append(event("content_block_start", {"type": "content_block_start",
                                                 "index": self.blocks, "content_block": block}))
        self.blocks += 1
        self.open = block["type"]
        return out + self._ping()

    def _ping(self) -> list[bytes]:
        if self.pinged:
            return []
        self.pinged = True
        return [event("ping", {"type": "ping"})]


def event(kind: str, data: dict[str, Any]) -> bytes:
    """One SSE event as Anthropic frames it: its type on an ``event:`` line, then its JSON."""
    return b"event: " + kind.encode() + b"\ndata: " + sse.encode_json(data).encode("utf-8") + b"\n\n"
