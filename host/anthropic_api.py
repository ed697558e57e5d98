"""Anthropic Messages requests (``POST /v1/messages``) checked and put onto the chat path
(pure: no I/O, no station).

``parse_messages`` turns a decoded body into an ``AnthropicRequest``: a chat
``CompletionRequest`` whose ``station_args`` are exactly what ``/v1/chat/completions`` sends
for the same conversation (system blocks as the first message, ``tool_use`` blocks as the
assistant's ``tool_calls``, each ``tool_result`` as a ``tool`` message), so liquid memory
matches and saves the same sessions whichever dialect a prompt came in; plus the stop
sequences (the answer names the one that matched) and the ``cache_control`` breakpoints
(``host.cache_pins`` makes them the station's TTL pins).

Field policy, as Anthropic answers it (an ``invalid_request_error`` whose message starts
with the field's path, ``messages.1.content.0.type: ...``): every implemented field is
checked, ranges included; a field or content block that would change the answer and is not
implemented (``thinking``, images, documents, server tools, a final assistant message to
continue) is refused by name; a field that does not change the answer (``service_tier``,
``metadata.user_id``) is type-checked; any other field is refused ("Extra inputs are not
permitted").
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from host import errors
from host.anthropic_fields import (bad, cache_control, integer, known, number, stop_sequences,
                                   string, user_id)
from host.errors import ApiError
from host.openai_api import CHAT, CompletionRequest
from host.tool_fields import ToolRequest, tool_request

MAX_BREAKPOINTS = 4  # Anthropic's bound on cache_control blocks
FIELDS = frozenset({"model", "max_tokens", "messages", "system", "stop_sequences",
                    "temperature", "top_p", "top_k", "stream", "tools", "tool_choice",
                    "metadata", "service_tier", "thinking", "container", "mcp_servers",
                    "context_management", "cache_control", "output_config", "diagnostics",
                    "speed", "inference_geo", "user_profile_id", "workspace_id"})
# Anthropic fields that would change the answer: refused by name unless off.
UNSUPPORTED = ("container", "mcp_servers", "context_management", "output_config",
               "diagnostics")
# Fields that do not change the answer: type-checked, no effect here.
NO_EFFECT = {"speed": ("standard", "fast"), "inference_geo": None, "user_profile_id": None,
             "workspace_id": None, "service_tier": ("auto", "standard_only")}
TEXT_FIELDS = frozenset({"type", "text", "cache_control", "citations"})
TOOL_USE_FIELDS = frozenset({"type", "id", "name", "input", "cache_control", "caller"})
TOOL_RESULT_FIELDS = frozenset({"type", "tool_use_id", "content", "is_error", "cache_control"})
TOOL_FIELDS = frozenset({"type", "name", "description", "input_schema", "cache_control"})
CHOICE_FIELDS = frozenset({"type", "name", "disable_parallel_tool_use"})
# Content blocks Anthropic defines that this server cannot take (no vision, no documents,
# no extended thinking, no server-side tools).
OTHER_BLOCKS = frozenset({"image", "document", "search_result", "thinking", "redacted_thinking",
                          "server_tool_use", "web_search_tool_result", "web_fetch_tool_result",
                          "code_execution_tool_result", "mcp_tool_use", "mcp_tool_result",
                          "container_upload"})


@dataclass(frozen=True, slots=True)
class Breakpoint:
    """A ``cache_control`` block: its TTL class, the field that carries it, and where its
    prefix ends in the station's messages (``message`` None: after the tools; else the
    message its block lands in, ``ends`` True when the block is that message's last, else
    ``chars``: that message's content characters up to the block's end, when its blocks are
    text joined into one string)."""

    ttl: str
    where: str
    message: int | None
    ends: bool = True
    chars: int | None = None


@dataclass(frozen=True, slots=True)
class AnthropicRequest:
    chat: CompletionRequest  # the chat path's request (kind CHAT, one prompt)
    stop_sequences: tuple[str, ...] = ()
    breakpoints: tuple[Breakpoint, ...] = ()


@dataclass(slots=True)
class _Builder:
    """The station messages as they are built, and the breakpoints found on the way."""

    messages: list[dict[str, Any]] = field(default_factory=list)
    breakpoints: list[Breakpoint] = field(default_factory=list)

    def cache(self, block: dict[str, Any], where: str, message: int | None, ends: bool,
              chars: int | None = None) -> None:
        ttl = cache_control(block.get("cache_control"), f"{where}.cache_control")
        if ttl is not None:
            self.breakpoints.append(Breakpoint(ttl, f"{where}.cache_control", message, ends,
                                               None if ends else chars))


def parse_messages(body: Any) -> AnthropicRequest:
    if not isinstance(body, dict):
        raise errors.invalid("The request body must be a JSON object.")
    for key in body:
        if key not in FIELDS:
            raise bad(key[:64], "Extra inputs are not permitted")
    for key in UNSUPPORTED:
        if body.get(key) is not None:
            raise bad(key, "is not supported by this server.")
    thinking = body.get("thinking")
    if thinking is not None and thinking != {"type": "disabled"}:
        raise bad("thinking", "extended thinking is not supported by this server (only "
                  "{\"type\": \"disabled\"} is accepted).")
    model = body.get("model")
    if model is None:
        raise bad("model", "Field required")
    if not isinstance(model, str):
        raise bad("model", "Input should be a valid string")
    max_tokens = integer(body, "max_tokens", 1, required=True)
    built = _Builder()
    tools, tools_json = _tools(body.get("tools"), built)
    _system(body.get("system"), built)
    _conversation(body.get("messages"), built)
    # Top-level cache_control: a breakpoint on the last block of the last message.
    ttl = cache_control(body.get("cache_control"), "cache_control")
    if ttl is not None:
        built.breakpoints.append(Breakpoint(ttl, "cache_control", len(built.messages) - 1))
    _check_breakpoints(built.breakpoints)
    args: dict[str, Any] = {"messages": built.messages, "max_tokens": max_tokens,
                            "temperature": number(body, "temperature", 0.0, 1.0, 1.0),
                            "top_p": number(body, "top_p", 0.0, 1.0, 1.0, low_open=True)}
    top_k = integer(body, "top_k", 1)
    if top_k is not None:
        args["top_k"] = top_k
    stops = stop_sequences(body.get("stop_sequences"))
    if stops:
        args["stop"] = list(stops)
    request = _tool_choice(body.get("tool_choice"), tools)
    if request is not None:
        args["tools"] = request.tools
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise bad("stream", "Input should be a valid boolean")
    for key, allowed in NO_EFFECT.items():
        value = body.get(key)
        if value is not None and (not isinstance(value, str) or
                                  (allowed is not None and value not in allowed)):
            raise bad(key, "Input should be " + (" or ".join(repr(a) for a in allowed)
                                                 if allowed else "a valid string"))
    chars = sum(len(m["content"]) + (len(json.dumps(m["tool_calls"])) if m.get("tool_calls")
                                     else 0) for m in built.messages) + tools_json
    chat = CompletionRequest(CHAT, model, stream, False, args, "messages",
                             user_id(body.get("metadata")), chars, request,
                             "tool_choice" if request is not None and request.forced else None)
    return AnthropicRequest(chat, stops, tuple(built.breakpoints))


def _check_breakpoints(breakpoints: list[Breakpoint]) -> None:
    if len(breakpoints) > MAX_BREAKPOINTS:
        raise bad(breakpoints[MAX_BREAKPOINTS].where, f"A maximum of {MAX_BREAKPOINTS} blocks "
                  f"with cache_control may be provided. Found {len(breakpoints)}.")
    seen_short = None
    for point in breakpoints:  # in prompt order: tools, system, messages
        if point.ttl == "5m":
            seen_short = seen_short or point
        elif seen_short is not None:
            raise bad(point.where, f"a ttl='1h' cache_control block must not come after a "
                      f"ttl='5m' cache_control block ({seen_short.where}).")


def _tools(value: Any, built: _Builder) -> tuple[list[dict[str, Any]] | None, int]:
    """The tools as OpenAI tool maps (what the chat template renders), and their JSON size."""
    if value is None:
        return None, 0
    if not isinstance(value, list):
        raise bad("tools", "Input should be a valid list")
    out = []
    for i, tool in enumerate(value):
        where = f"tools.{i}"
        if not isinstance(tool, dict):
            raise bad(where, "Input should be a valid dictionary")
        kind = tool.get("type", "custom")
        if kind not in ("custom", None):
            raise bad(f"{where}.type", f"server tools ({kind!r}) are not supported by this "
                      f"server; only custom tools (name, description, input_schema) are.")
        known(tool, TOOL_FIELDS, where)
        name = string(tool, "name", where, required=True)
        schema = tool.get("input_schema")
        if schema is None:
            raise bad(f"{where}.input_schema", "Field required")
        if not isinstance(schema, dict):
            raise bad(f"{where}.input_schema", "Input should be a valid dictionary")
        function: dict[str, Any] = {"name": name, "parameters": schema}
        description = string(tool, "description", where)
        if description is not None:
            function["description"] = description
        out.append({"type": "function", "function": function})
        built.cache(tool, where, None, True)
    return out, len(json.dumps(out))


def _tool_choice(value: Any, tools: list[dict[str, Any]] | None) -> ToolRequest | None:
    """``tool_choice`` as the chat path's: auto -> auto, any -> required, tool -> that
    function, none -> no tools at all (the model is not told of them)."""
    choice: Any = "auto"
    parallel = True
    if value is not None:
        if not isinstance(value, dict):
            raise bad("tool_choice", "Input should be a valid dictionary")
        known(value, CHOICE_FIELDS, "tool_choice")
        kind = value.get("type")
        if kind not in ("auto", "any", "tool", "none"):
            raise bad("tool_choice.type", f"Input should be 'auto', 'any', 'tool' or 'none', "
                      f"but got {kind!r}")
        name = string(value, "name", "tool_choice", required=kind == "tool")
        if name is not None and kind != "tool":
            raise bad("tool_choice.name", "only a tool_choice of type 'tool' names a tool")
        disable = value.get("disable_parallel_tool_use")
        if disable is not None and not isinstance(disable, bool):
            raise bad("tool_choice.disable_parallel_tool_use", "Input should be a valid boolean")
        parallel = not disable
        if kind in ("any", "tool") and not tools:
            raise bad("tool_choice", f"a tool_choice of type {kind!r} needs 'tools'.")
        if kind == "tool" and name not in {t["function"]["name"] for t in tools or ()}:
            raise bad("tool_choice.name", f"names tool {name!r}, which is not in 'tools'.")
        choice = {"auto": "auto", "any": "required", "none": "none"}.get(kind) or \
            {"type": "function", "function": {"name": name}}
    if not tools:
        return None
    try:
        return tool_request({"tools": tools, "tool_choice": choice, "parallel_tool_calls": parallel})
    except ApiError as exc:  # named in the chat path's terms: tools[i].function.x
        param = (exc.param or "tools").replace("].function.parameters", "].input_schema")
        param = param.replace("].function.", "].").replace("[", ".").replace("]", "")
        raise bad(param, exc.message) from None


def _system(value: Any, built: _Builder) -> None:
    if value is None:
        return
    if isinstance(value, str):
        if value:
            built.messages.append({"role": "system", "content": value})
        return
    if not isinstance(value, list):
        raise bad("system", "Input should be a valid string or a list of text blocks")
    at = len(built.messages)
    texts = []
    for j, block in enumerate(value):
        texts.append(_text_block(block, f"system.{j}"))
        built.cache(block, f"system.{j}", at, j == len(value) - 1, sum(map(len, texts)))
    built.messages.append({"role": "system", "content": "".join(texts)})


def _conversation(value: Any, built: _Builder) -> None:
    if value is None:
        raise bad("messages", "Field required")
    if not isinstance(value, list):
        raise bad("messages", "Input should be a valid list")
    if not value:
        raise bad("messages", "at least one message is required")
    for i, message in enumerate(value):
        where = f"messages.{i}"
        if not isinstance(message, dict):
            raise bad(where, "Input should be a valid dictionary")
        known(message, {"role", "content"}, where)
        role = message.get("role")
        if role not in ("user", "assistant"):
            raise bad(f"{where}.role", f"Input should be 'user' or 'assistant', but got {role!r}")
        content = message.get("content")
        if content is None:
            raise bad(f"{where}.content", "Field required")
        if isinstance(content, str):
            content = [{"type": "text", "text": content}]
        elif not isinstance(content, list):
            raise bad(f"{where}.content", "Input should be a valid string or list of blocks")
        if not content or content == [{"type": "text", "text": ""}]:
            raise bad(where, "all messages must have non-empty content")
        if role == "assistant" and i == len(value) - 1:
            raise bad(where, "a final assistant message (a prefill for the answer to "
                      "continue) is not supported by this server.")
        if role == "user":
            _user(content, where, built, plain=isinstance(message["content"], str))
        else:
            _assistant(content, where, built, plain=isinstance(message["content"], str))


def _user(blocks: list[Any], where: str, built: _Builder, plain: bool) -> None:
    texts: list[tuple[str, dict[str, Any], str]] = []
    for j, block in enumerate(blocks):
        at = where if plain else f"{where}.content.{j}"
        kind = _block_type(block, at, ("text", "tool_result"))
        if kind == "text":
            texts.append((_text_block(block, at), block, at))
            continue
        if texts:
            raise bad(f"{at}.type", "tool_result blocks must come before any text in a user "
                      "message.")
        known(block, TOOL_RESULT_FIELDS, at)
        call_id = string(block, "tool_use_id", at, required=True)
        result = block.get("content", "")
        if isinstance(result, list):
            result = "".join(_text_block(b, f"{at}.content.{k}") for k, b in enumerate(result))
        elif not isinstance(result, str):
            raise bad(f"{at}.content", "Input should be a valid string or list of text blocks")
        is_error = block.get("is_error")
        if is_error is not None and not isinstance(is_error, bool):
            raise bad(f"{at}.is_error", "Input should be a valid boolean")
        built.messages.append({"role": "tool", "tool_call_id": call_id,
                               "content": f"Error: {result}" if is_error else result})
        built.cache(block, at, len(built.messages) - 1, True)
    if texts:
        built.messages.append({"role": "user", "content": "".join(t for t, _, _ in texts)})
        for k, (_, block, at) in enumerate(texts):
            built.cache(block, at, len(built.messages) - 1, k == len(texts) - 1,
                        sum(len(t) for t, _, _ in texts[:k + 1]))


def _assistant(blocks: list[Any], where: str, built: _Builder, plain: bool) -> None:
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    marks: list[tuple[dict[str, Any], str]] = []
    for j, block in enumerate(blocks):
        at = where if plain else f"{where}.content.{j}"
        kind = _block_type(block, at, ("text", "tool_use"))
        if kind == "text":
            if calls:
                raise bad(f"{at}.type", "text after a tool_use block in an assistant message "
                          "is not supported by this server.")
            texts.append(_text_block(block, at))
        else:
            known(block, TOOL_USE_FIELDS, at)
            call_id = string(block, "id", at, required=True)
            name = string(block, "name", at, required=True)
            caller = block.get("caller")
            if caller is not None and caller != {"type": "direct"}:
                raise bad(f"{at}.caller", "only a direct caller ({\"type\": \"direct\"}) is "
                          "supported by this server.")
            arguments = block.get("input")
            if not isinstance(arguments, dict):
                raise bad(f"{at}.input", "Input should be a valid dictionary")
            calls.append({"id": call_id, "type": "function",
                          "function": {"name": name, "arguments": arguments}})
        marks.append((block, at))
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if calls:
        message["tool_calls"] = calls
    built.messages.append(message)
    for k, (block, at) in enumerate(marks):
        built.cache(block, at, len(built.messages) - 1, k == len(marks) - 1)


def _block_type(block: Any, where: str, allowed: tuple[str, ...]) -> str:
    if not isinstance(block, dict):
        raise bad(where, "Input should be a valid dictionary")
    kind = block.get("type")
    if kind in allowed:
        return str(kind)
    if kind in OTHER_BLOCKS or kind in ("text", "tool_use", "tool_result"):
        raise bad(f"{where}.type", f"{kind!r} content blocks are not supported here by this "
                  f"server (it takes {' and '.join(repr(a) for a in allowed)}).")
    raise bad(f"{where}.type", f"Input tag {kind!r} does not match any of the expected "
              f"tags: {', '.join(repr(a) for a in allowed)}")


def _text_block(block: Any, where: str) -> str:
    if not isinstance(block, dict):
        raise bad(where, "Input should be a valid dictionary")
    if block.get("type") != "text":
        raise bad(f"{where}.type", f"Input should be 'text', but got {block.get('type')!r}")
    known(block, TEXT_FIELDS, where)
    if block.get("citations"):
        raise bad(f"{where}.citations", "citations are not supported by this server.")
    cache_control(block.get("cache_control"), f"{where}.cache_control")  # checked early
    text = string(block, "text", where, required=True)
    assert text is not None
    return text


