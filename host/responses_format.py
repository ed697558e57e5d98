"""OpenAI's Responses API shapes (pure): the ``response`` object, its output message item,
its usage, and the streamed events in OpenAI's order.

A stream is ``response.created``, ``response.in_progress``, ``response.output_item.added``,
``response.content_part.added``, one ``response.output_text.delta`` per piece of text,
``response.output_text.done``, ``response.content_part.done``,
``response.output_item.done``, then ``response.completed`` (``response.incomplete`` when
``max_output_tokens`` cut the answer; ``response.failed`` when the station failed after the
headers went). Each event is framed as OpenAI frames it, ``event: <type>`` then ``data:
<json>``, and carries a ``sequence_number`` counting from 0.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

from host import sse
from host.responses_fields import ResponsesRequest


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {"input_tokens": prompt_tokens,
            "input_tokens_details": {"cached_tokens": cached_tokens},
            "output_tokens": completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt_tokens + completion_tokens}


def status_of(finish_reason: str) -> str:
    """A station finish reason as the response's status (``length``: cut by the budget)."""
    return "incomplete" if finish_reason == "length" else "completed"


@dataclass(slots=True)
class ResponseShape:
    """One response's fixed fields (its id, times, model, the request's echoed fields) and
    the builders of its objects and events."""

    id: str
    model: str
    req: ResponsesRequest
    created_at: int = field(default_factory=lambda: int(time.time()))
    message_id: str = field(default_factory=lambda: "msg_" + os.urandom(24).hex())
    sequence: int = 0

    def message(self, text: str, status: str) -> dict[str, Any]:
        content = [self.part(text)] if status != "in_progress" else []
        return {"id": self.message_id, "type": "message", "status": status,
                "role": "assistant", "content": content}

    @staticmethod
    def part(text: str) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def response(self, status: str, *, text: str | None = None,
                 usage_: dict[str, Any] | None = None, gnosis: dict[str, Any] | None = None,
                 error: dict[str, Any] | None = None) -> dict[str, Any]:
        """The ``response`` object; ``text`` None: no output yet."""
        req = self.req
        out: dict[str, Any] = {
            "id": self.id, "object": "response", "created_at": self.created_at,
            "status": status, "background": False, "error": error,
            "incomplete_details": ({"reason": "max_output_tokens"} if status == "incomplete"
                                   else None),
            "instructions": req.instructions, "metadata": req.metadata or {},
            "model": self.model,
            "output": [] if text is None else [
                self.message(text, "incomplete" if status == "incomplete" else "completed")],
            "previous_response_id": req.previous_response_id, "store": req.store,
            "reasoning": {"effort": None, "summary": None}, "usage": usage_,
            **req.echo}
        if status in ("completed", "incomplete"):
            out["completed_at"] = int(time.time())
        if gnosis is not None:
            out["_gnosis"] = gnosis
        return out

    def event(self, kind: str, **fields: Any) -> bytes:
        """One SSE event of ``kind`` with the next sequence number."""
        obj = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\n".encode() + sse.event(obj)

    def opening(self) -> list[bytes]:
        """The events before the first piece of text."""
        where = {"output_index": 0}
        part = {"item_id": self.message_id, "output_index": 0, "content_index": 0}
        return [self.event("response.created", response=self.response("in_progress")),
                self.event("response.in_progress", response=self.response("in_progress")),
                self.event("response.output_item.added", item=self.message("", "in_progress"),
                           **where),
                self.event("response.content_part.added", part=self.part(""), **part)]

    def delta(self, text: str) -> bytes:
        return self.event("response.output_text.delta", item_id=self.message_id,
                          output_index=0, content_index=0, delta=text, logprobs=[])

    def closing(self, text: str, status: str, usage_: dict[str, Any],
                gnosis: dict[str, Any]) -> list[bytes]:
        """The events after the last piece of text, ending with the whole response."""
        part = {"item_id": self.message_id, "output_index": 0, "content_index": 0}
        item_status = "incomplete" if status == "incomplete" else "completed"
        final = "response.incomplete" if status == "incomplete" else "response.completed"
        return [self.event("response.output_text.done", text=text, logprobs=[], **part),
                self.event("response.content_part.done", part=self.part(text), **part),
                self.event("response.output_item.done", item=self.message(text, item_status),
                           output_index=0),
                self.event(final, response=self.response(status, text=text, usage_=usage_,
                                                          gnosis=gnosis))]

    def failed(self, error: dict[str, Any]) -> bytes:
        """The station failed after the headers went: the response ends failed."""
        detail = {"code": error.get("code") or "server_error", "message": error["message"]}
        return self.event("response.failed", response=self.response("failed", error=detail))
