"""``POST /v1/responses`` request validation (pure: no I/O, no station).

``parse`` turns a decoded JSON body into a ``ResponsesRequest`` or raises ``ApiError`` with
OpenAI's error body naming the field. The field policy is chat's (``host.openai_api``):
implemented fields are checked, ranges included; fields that would change the answer and
are not implemented (``tools``, ``reasoning``, ``conversation``...) are refused naming the
field unless they hold their default; fields that do not change the answer
(``safety_identifier``, ``service_tier``) are type-checked; any other field is refused as
OpenAI refuses it. Input items are messages (a string or ``input_text`` / ``output_text``
parts); function calls and their outputs are refused naming the item, since this server
runs no tools on the Responses API.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from host import errors
from host.fields import (as_object, bounded_int, check_known, default_only, is_bool, is_dict,
                         is_int, is_list, is_str, is_str_dict, number, present, typed)
from host.openai_api import MAX_INT32, check_retention

FIELDS = frozenset({
    "model", "input", "instructions", "previous_response_id", "store", "stream",
    "stream_options", "max_output_tokens", "temperature", "top_p", "prompt_cache_key",
    "prompt_cache_retention", "metadata", "user", "safety_identifier", "service_tier",
    "background", "include", "parallel_tool_calls", "tool_choice", "tools", "truncation",
    "text", "top_logprobs", "max_tool_calls", "reasoning", "conversation", "prompt",
    "context_management", "prompt_cache_options", "moderation", "image", "access_programs",
    "background_options"})
# OpenAI fields this server does not implement at any value but null.
_UNSUPPORTED = ("reasoning", "conversation", "prompt", "context_management",
                "prompt_cache_options", "moderation", "image", "access_programs",
                "background_options")
ROLES = ("user", "assistant", "system", "developer")
MESSAGE_FIELDS = frozenset({"type", "role", "content", "id", "status"})
PART_TYPES = ("input_text", "output_text")
PART_FIELDS = frozenset({"type", "text", "annotations", "logprobs"})
# Item types OpenAI defines that are not messages: refused naming the item.
_TOOL_ITEMS = ("function_call", "function_call_output", "reasoning", "item_reference",
               "file_search_call", "computer_call", "computer_call_output", "web_search_call",
               "image_generation_call", "code_interpreter_call", "local_shell_call",
               "local_shell_call_output", "mcp_call", "mcp_list_tools", "mcp_approval_request",
               "mcp_approval_response", "custom_tool_call", "custom_tool_call_output")
MAX_METADATA_KEYS = 16



@dataclass(frozen=True, slots=True)
class ResponsesRequest:
    model: str | None
    input: list[dict[str, str]]  # this turn's input as chat messages ({role, content})
    instructions: str | None
    previous_response_id: str | None
    store: bool
    stream: bool
    sampling: dict[str, Any]  # generate's temperature, top_p, max_tokens
    session_name: str | None  # prompt_cache_key, else user
    retention: str | None  # prompt_cache_retention: None | in_memory | 24h
    metadata: dict[str, str] | None
    # The request's fields the answer echoes (temperature, top_p, user...).
    echo: dict[str, Any] = field(default_factory=dict)

    @property
    def chars(self) -> int:
        return sum(len(m["content"]) for m in self.input) + len(self.instructions or "")


def parse(body: Any) -> ResponsesRequest:
    body = as_object(body)
    check_known(body, FIELDS)
    if not present(body, "input"):
        raise errors.missing("input")
    items = _input(body["input"])
    model = body.get("model")
    typed(body, "model", is_str, "a string")
    for key in ("instructions", "previous_response_id", "prompt_cache_key", "user",
                "safety_identifier", "service_tier"):
        typed(body, key, is_str, "a string")
    store = _flag(body, "store", True)
    stream = _flag(body, "stream", False)
    options = body.get("stream_options")
    if options is not None:
        if not is_dict(options):
            raise errors.invalid_type("stream_options", "an object", options)
        if not stream:
            raise errors.invalid("The 'stream_options' parameter is only allowed when 'stream' "
                                 "is enabled.", "stream_options", "invalid_value")
        check_known(options, ("include_obfuscation",), "stream_options.")
        typed(options, "include_obfuscation", is_bool, "a boolean", "stream_options.")
    metadata = body.get("metadata")
    typed(body, "metadata", is_str_dict, "an object of strings")
    if metadata is not None and len(metadata) > MAX_METADATA_KEYS:
        raise errors.invalid_value("metadata", f"at most {MAX_METADATA_KEYS} keys, but got "
                                   f"{len(metadata)}.")
    _defaults(body)
    sampling: dict[str, Any] = {
        # OpenAI's defaults: temperature 1 (sampled), top_p 1.
        "temperature": number(body, "temperature", 0.0, 2.0, low_open=False, default=1.0),
        "top_p": number(body, "top_p", 0.0, 1.0, low_open=True, default=1.0)}
    max_tokens = bounded_int(body, "max_output_tokens", 1, MAX_INT32)
    if max_tokens is not None:
        sampling["max_tokens"] = max_tokens
    retention = check_retention(body)
    echo = {"temperature": sampling["temperature"], "top_p": sampling["top_p"],
            "max_output_tokens": max_tokens, "prompt_cache_key": body.get("prompt_cache_key"),
            "prompt_cache_retention": retention, "user": body.get("user"),
            "safety_identifier": body.get("safety_identifier"),
            "service_tier": body.get("service_tier") or "default",
            "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "tool_choice": body.get("tool_choice") or "auto", "tools": [],
            "truncation": "disabled", "text": {"format": {"type": "text"}}}
    return ResponsesRequest(
        model=model, input=items, instructions=body.get("instructions"),
        previous_response_id=body.get("previous_response_id"), store=store, stream=stream,
        sampling=sampling, session_name=body.get("prompt_cache_key") or body.get("user") or None,
        retention=retention, metadata=metadata, echo=echo)


def _flag(body: dict[str, Any], key: str, default: bool) -> bool:
    value = body.get(key)
    if value is None:
        return default
    if not is_bool(value):
        raise errors.invalid_type(key, "a boolean", value)
    return bool(value)


def _defaults(body: dict[str, Any]) -> None:
    """The fields accepted only at the value that changes nothing here."""
    default_only(body, "background", is_bool, "a boolean", lambda v: v is False)
    default_only(body, "include", is_list, "an array", lambda v: not v)
    typed(body, "parallel_tool_calls", is_bool, "a boolean")  # no tools: no calls either way
    default_only(body, "tool_choice", lambda v: is_str(v) or is_dict(v), "a string or an object",
                 lambda v: v in ("auto", "none"))
    default_only(body, "tools", is_list, "an array", lambda v: not v)
    default_only(body, "truncation", is_str, "a string", lambda v: v == "disabled")
    default_only(body, "text", is_dict, "an object",
                 lambda v: v.get("format") in (None, {"type": "text"})
                 and set(v) <= {"format", "verbosity"} and v.get("verbosity") in (None, "medium"))
    default_only(body, "top_logprobs", is_int, "an integer", lambda v: v == 0)
    typed(body, "max_tool_calls", is_int, "an integer")
    for key in _UNSUPPORTED:
        if present(body, key):
            raise errors.unsupported(key, "is not supported by this server.")


def _input(value: Any) -> list[dict[str, str]]:
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list):
        raise errors.invalid_type("input", "a string or an array of input items", value)
    if not value:
        raise errors.invalid_value("input", "empty array. Expected a string or an array with "
                                   "minimum length 1.")
    return [_item(item, f"input[{i}]") for i, item in enumerate(value)]


def _item(item: Any, where: str) -> dict[str, str]:
    if not isinstance(item, dict):
        raise errors.invalid_type(where, "an object", item)
    kind = item.get("type")
    if kind in _TOOL_ITEMS:
        raise errors.unsupported(f"{where}.type", f"{kind!r} items are not supported by this "
                                 f"server (it runs no tools on the Responses API).")
    if kind not in (None, "message"):
        raise errors.invalid_value(f"{where}.type", f"expected 'message', but got {kind!r}.")
    check_known(item, MESSAGE_FIELDS, f"{where}.")
    role = item.get("role")
    if role is None:
        raise errors.missing(f"{where}.role")
    if role not in ROLES:
        raise errors.invalid_value(f"{where}.role", f"value must be one of "
                                   f"{', '.join(repr(r) for r in ROLES)}, but got {role!r}.")
    typed(item, "id", is_str, "a string", f"{where}.")
    typed(item, "status", is_str, "a string", f"{where}.")
    content = item.get("content")
    if content is None:
        raise errors.missing(f"{where}.content")
    if isinstance(content, list):
        content = "".join(_part(part, f"{where}.content[{i}]")
                          for i, part in enumerate(content))
    elif not isinstance(content, str):
        raise errors.invalid_type(f"{where}.content", "a string or an array of text parts",
                                  content)
    # Chat templates know system/user/assistant; OpenAI's "developer" is the system role.
    return {"role": "system" if role == "developer" else role, "content": content}


def _part(part: Any, where: str) -> str:
    if not isinstance(part, dict):
        raise errors.invalid_type(where, "an object", part)
    kind = part.get("type")
    if kind not in PART_TYPES:
        raise errors.invalid_value(f"{where}.type", f"only 'input_text' and 'output_text' "
                                   f"content parts are supported, but got {kind!r}.")
    check_known(part, PART_FIELDS, f"{where}.")
    text = part.get("text")
    if not isinstance(text, str):
        raise errors.invalid_type(f"{where}.text", "a string", text)
    return text
