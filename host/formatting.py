"""OpenAI response shapes (pure): ``chat.completion`` / ``chat.completion.chunk`` and
``text_completion`` objects, and the usage block every completion carries."""

from __future__ import annotations

import time
import uuid
from typing import Any

from host.openai_api import CHAT, TEXT


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    # cached_tokens is always present, 0 included: dashboards read it unconditionally.
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


class Formatter:
    """Shapes one completion's JSON objects (one id and ``created`` for all its chunks)."""

    def __init__(self, kind: str, model: str, include_usage: bool = False) -> None:
        assert kind in (CHAT, TEXT), kind
        self.kind = kind
        self.model = model
        self.include_usage = include_usage
        prefix = "chatcmpl-" if kind == CHAT else "cmpl-"
        self.id = prefix + uuid.uuid4().hex
        self.created = int(time.time())

    def _envelope(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def completion(self, text: str | None, finish_reason: str, usage_: dict[str, Any],
                   gnosis: dict[str, Any],
                   tool_calls: list[dict[str, Any]] | None = None, *,
                   choices: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """``tool_calls`` (chat): the calls parsed from the output, ``text`` the content
        before them (None when there is none). ``choices``: several, made by ``choice``."""
        out = self._envelope("chat.completion" if self.kind == CHAT else "text_completion")
        out["choices"] = choices if choices is not None else \
            [self.choice(text, finish_reason, tool_calls=tool_calls)]
        out["usage"] = usage_
        out["_gnosis"] = gnosis
        return out

    def choice(self, text: str | None, finish_reason: str, *, index: int = 0,
               logprobs: dict[str, Any] | None = None,
               tool_calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """One choice of a whole completion (``logprobs``: host.choices' shapes)."""
        if self.kind == CHAT:
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if tool_calls:
                message["tool_calls"] = tool_calls
            return {"index": index, "message": message, "logprobs": logprobs,
                    "finish_reason": finish_reason}
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        out = self._envelope("chat.completion.chunk" if self.kind == CHAT else "text_completion")
        out["choices"] = choices
        if self.include_usage:
            out["usage"] = None  # OpenAI sends null usage on every chunk but the last
        return out

    def _choice(self, text: str, finish_reason: str | None, *, role: bool = False,
                index: int = 0, logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
        if self.kind == TEXT:
            return {"index": index, "text": text, "logprobs": logprobs,
                    "finish_reason": finish_reason}
        delta: dict[str, Any] = {"role": "assistant", "content": text} if role else \
            ({"content": text} if finish_reason is None else {})
        return {"index": index, "delta": delta, "logprobs": logprobs,
                "finish_reason": finish_reason}

    def role_chunk(self, index: int = 0) -> dict[str, Any] | None:
        """The first chat chunk announces the role; text completions have none."""
        return self._chunk([self._choice("", None, role=True, index=index)]) \
            if self.kind == CHAT else None

    def delta_chunk(self, text: str, index: int = 0,
                    logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
        return self._chunk([self._choice(text, None, index=index, logprobs=logprobs)])

    def tool_call_chunks(self, index: int, call: dict[str, Any],
                         choice: int = 0) -> list[dict[str, Any]]:
        """A call streamed as OpenAI streams one: its id, type and name with empty
        arguments, then the arguments."""
        head = {"index": index, "id": call["id"], "type": "function",
                "function": {"name": call["function"]["name"], "arguments": ""}}
        args = {"index": index, "function": {"arguments": call["function"]["arguments"]}}
        return [self._chunk([{"index": choice, "delta": {"tool_calls": [part]}, "logprobs": None,
                              "finish_reason": None}]) for part in (head, args)]

    def finish_chunk(self, finish_reason: str, gnosis: dict[str, Any] | None,
                     index: int = 0) -> dict[str, Any]:
        out = self._chunk([self._choice("", finish_reason, index=index)])
        if gnosis is not None:
            out["_gnosis"] = gnosis
        return out

    def usage_chunk(self, usage_: dict[str, Any], gnosis: dict[str, Any]) -> dict[str, Any]:
        assert self.include_usage
        out = self._chunk([])
        out["usage"] = usage_
        out["_gnosis"] = gnosis
        return out
