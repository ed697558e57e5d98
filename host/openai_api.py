"""OpenAI request validation and response/chunk formatting (pure: no I/O, no station).

``parse_chat`` / ``parse_completion`` turn a decoded JSON body into a ``CompletionRequest``
whose ``station_args`` are the station's ``generate`` arguments, or raise ``ApiError`` with
OpenAI's error body. ``Formatter`` shapes the results: ``chat.completion`` /
``chat.completion.chunk`` and ``text_completion`` objects. Fields OpenAI defines that this
server does not implement are ignored unless ignoring them would change the answer the
client asked for (``n > 1``, ``logprobs``, ``echo``): those are rejected as unsupported.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

from host import errors

CHAT = "chat"
TEXT = "text"
ROLES = ("system", "user", "assistant", "tool", "developer")
MAX_STOP = 4
# Fields that name a liquid-memory session, first present wins (OpenAI's prompt_cache_key
# and user are such names; session_id is this server's own).
SESSION_FIELDS = ("session_id", "prompt_cache_key", "user")


@dataclass(frozen=True, slots=True)
class CompletionRequest:
    kind: str  # CHAT | TEXT
    model: str | None
    stream: bool
    include_usage: bool
    station_args: dict[str, Any]  # the station's `generate` args
    prompt_param: str  # "messages" | "prompt": where a context overflow is blamed
    # A named liquid-memory session: session_id, else prompt_cache_key, else user.
    session_name: str | None = None

    def __post_init__(self) -> None:
        assert self.kind in (CHAT, TEXT), self.kind
        assert not self.include_usage or self.stream


def parse_chat(body: Any) -> CompletionRequest:
    body = _object(body)
    messages = body.get("messages")
    if messages is None:
        raise errors.missing("messages")
    if not isinstance(messages, list):
        raise errors.invalid_type("messages", "an array", messages)
    if not messages:
        raise errors.invalid_value("messages", "empty array. Expected an array with minimum "
                                   "length 1, but got an empty array instead.")
    args = {"messages": [_message(m, f"messages[{i}]") for i, m in enumerate(messages)]}
    if _present(body, "logprobs") and body["logprobs"] is not False:
        raise errors.unsupported("logprobs", "is not supported by this server.")
    max_tokens = _positive_int(body, "max_completion_tokens")
    if max_tokens is None:
        max_tokens = _positive_int(body, "max_tokens")
    return _finish(CHAT, body, args, max_tokens, "messages")


def parse_completion(body: Any) -> CompletionRequest:
    body = _object(body)
    if not _present(body, "prompt"):
        raise errors.missing("prompt")
    args = _prompt(body["prompt"])
    if _present(body, "logprobs"):
        raise errors.unsupported("logprobs", "is not supported by this server.")
    if _present(body, "echo") and body["echo"] is not False:
        raise errors.unsupported("echo", "is not supported by this server.")
    if _present(body, "suffix"):
        raise errors.unsupported("suffix", "is not supported by this server.")
    return _finish(TEXT, body, args, _positive_int(body, "max_tokens"), "prompt")


def _finish(kind: str, body: dict[str, Any], args: dict[str, Any], max_tokens: int | None,
            prompt_param: str) -> CompletionRequest:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise errors.invalid_type("model", "a string", model)
    if max_tokens is not None:
        args["max_tokens"] = max_tokens
    # OpenAI's default temperature is 1.0, so an unset temperature samples; 0 is greedy.
    args["temperature"] = _number(body, "temperature", 0.0, 2.0, low_open=False, default=1.0)
    args["top_p"] = _number(body, "top_p", 0.0, 1.0, low_open=True, default=1.0)
    n = body.get("n")
    if n is not None:
        if not _is_int(n):
            raise errors.invalid_type("n", "an integer", n)
        if n != 1:
            raise errors.unsupported("n", f"must be 1 on this server, but got {n}.")
    stop = body.get("stop")
    if stop is not None:
        args["stop"] = _stop(stop)
    seed = body.get("seed")
    if seed is not None:
        if not _is_int(seed):
            raise errors.invalid_type("seed", "an integer", seed)
        args["seed"] = seed
    # vLLM's extension: keep decoding past EOS (benchmarks, load drills).
    ignore_eos = body.get("ignore_eos")
    if ignore_eos is not None:
        if not isinstance(ignore_eos, bool):
            raise errors.invalid_type("ignore_eos", "a boolean", ignore_eos)
        args["ignore_eos"] = ignore_eos
    session_name = None
    for key in SESSION_FIELDS:
        value = body.get(key)
        if value is not None and not isinstance(value, str):
            raise errors.invalid_type(key, "a string", value)
        session_name = session_name or value or None
    stream = body.get("stream")
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise errors.invalid_type("stream", "a boolean", stream)
    include_usage = False
    options = body.get("stream_options")
    if options is not None:
        if not isinstance(options, dict):
            raise errors.invalid_type("stream_options", "an object", options)
        if not stream:
            raise errors.invalid("The 'stream_options' parameter is only allowed when 'stream' "
                                 "is enabled.", "stream_options", "invalid_value")
        include_usage = options.get("include_usage")
        if include_usage is None:
            include_usage = False
        if not isinstance(include_usage, bool):
            raise errors.invalid_type("stream_options.include_usage", "a boolean", include_usage)
    return CompletionRequest(kind, model, stream, include_usage, args, prompt_param, session_name)


def _object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise errors.invalid(f"The request body must be a JSON object, but got "
                             f"{errors._json_type(body)} instead.")
    return body


def _present(body: dict[str, Any], key: str) -> bool:
    return body.get(key) is not None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _message(message: Any, where: str) -> dict[str, str]:
    if not isinstance(message, dict):
        raise errors.invalid_type(where, "an object", message)
    role = message.get("role")
    if role is None:
        raise errors.missing(f"{where}.role")
    if role not in ROLES:
        raise errors.invalid_value(f"{where}.role", f"value must be one of "
                                   f"{', '.join(repr(r) for r in ROLES)}, but got {role!r}.")
    content = message.get("content")
    if content is None and role == "assistant":
        content = ""  # an assistant turn that only made tool calls has no content
    elif isinstance(content, list):
        content = "".join(_text_part(part, f"{where}.content[{i}]")
                          for i, part in enumerate(content))
    elif content is None:
        raise errors.missing(f"{where}.content")
    elif not isinstance(content, str):
        raise errors.invalid_type(f"{where}.content", "a string or an array of text parts",
                                  content)
    # Chat templates know system/user/assistant/tool; OpenAI's "developer" is the system role.
    return {"role": "system" if role == "developer" else role, "content": content}


def _text_part(part: Any, where: str) -> str:
    if not isinstance(part, dict):
        raise errors.invalid_type(where, "an object", part)
    if part.get("type") != "text":
        raise errors.invalid_value(f"{where}.type", f"only 'text' content parts are supported, "
                                   f"but got {part.get('type')!r}.")
    text = part.get("text")
    if not isinstance(text, str):
        raise errors.invalid_type(f"{where}.text", "a string", text)
    return text


def _prompt(prompt: Any) -> dict[str, Any]:
    if isinstance(prompt, str):
        return {"prompt": prompt}
    if isinstance(prompt, list) and prompt:
        if all(_is_int(t) for t in prompt):
            if any(t < 0 for t in prompt):
                raise errors.invalid_value("prompt", "token ids must be non-negative integers.")
            return {"tokens": list(prompt)}
        if len(prompt) == 1 and isinstance(prompt[0], str):
            return {"prompt": prompt[0]}
        if len(prompt) == 1 and isinstance(prompt[0], list) and prompt[0] \
                and all(_is_int(t) and t >= 0 for t in prompt[0]):
            return {"tokens": list(prompt[0])}
        if len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
            raise errors.unsupported("prompt", "must hold one prompt on this server (batched "
                                     "prompts are not supported).")
    raise errors.invalid_type("prompt", "a string, an array with one string, or an array of "
                              "token ids", prompt)


def _positive_int(body: dict[str, Any], key: str) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if not _is_int(value):
        raise errors.invalid_type(key, "an integer", value)
    if value < 1:
        raise errors.invalid_value(key, f"integer below minimum value. Expected a value >= 1, "
                                   f"but got {value} instead.")
    return value


def _number(body: dict[str, Any], key: str, low: float, high: float, *, low_open: bool,
            default: float) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise errors.invalid_type(key, "a decimal", value)
    if value < low or (low_open and value == low):
        bound = ">" if low_open else ">="
        raise errors.invalid_value(key, f"decimal below minimum value. Expected a value "
                                   f"{bound} {low:g}, but got {value} instead.")
    if value > high:
        raise errors.invalid_value(key, f"decimal above maximum value. Expected a value <= "
                                   f"{high:g}, but got {value} instead.")
    return float(value)


def _stop(stop: Any) -> list[str]:
    if isinstance(stop, str):
        return [stop] if stop else []
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise errors.invalid_type("stop", "a string or an array of strings", stop)
    if len(stop) > MAX_STOP:
        raise errors.invalid_value("stop", f"array too long. Expected an array with maximum "
                                   f"length {MAX_STOP}, but got an array with length "
                                   f"{len(stop)} instead.")
    return [s for s in stop if s]


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

    def completion(self, text: str, finish_reason: str, usage_: dict[str, Any],
                   gnosis: dict[str, Any]) -> dict[str, Any]:
        if self.kind == CHAT:
            out = self._envelope("chat.completion")
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "logprobs": None, "finish_reason": finish_reason}
        else:
            out = self._envelope("text_completion")
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        out["choices"] = [choice]
        out["usage"] = usage_
        out["_gnosis"] = gnosis
        return out

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        out = self._envelope("chat.completion.chunk" if self.kind == CHAT else "text_completion")
        out["choices"] = choices
        if self.include_usage:
            out["usage"] = None  # OpenAI sends null usage on every chunk but the last
        return out

    def _choice(self, text: str, finish_reason: str | None, *, role: bool = False) -> dict[str, Any]:
        if self.kind == TEXT:
            return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        delta: dict[str, Any] = {"role": "assistant", "content": text} if role else \
            ({"content": text} if finish_reason is None else {})
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}

    def role_chunk(self) -> dict[str, Any] | None:
        """The first chat chunk announces the role; text completions have none."""
        return self._chunk([self._choice("", None, role=True)]) if self.kind == CHAT else None

    def delta_chunk(self, text: str) -> dict[str, Any]:
        return self._chunk([self._choice(text, None)])

    def finish_chunk(self, finish_reason: str, gnosis: dict[str, Any] | None) -> dict[str, Any]:
        out = self._chunk([self._choice("", finish_reason)])
        if gnosis is not None:
            out["_gnosis"] = gnosis
        return out

    def usage_chunk(self, usage_: dict[str, Any], gnosis: dict[str, Any]) -> dict[str, Any]:
        assert self.include_usage
        out = self._chunk([])
        out["usage"] = usage_
        out["_gnosis"] = gnosis
        return out
