"""The chat arguments of ``generate`` and ``tokenize`` as they travel: messages and tools.

A message is ``{role, content}`` plus, optionally, ``tool_calls`` (an assistant's calls:
``[{"id", "type": "function", "function": {"name", "arguments"}}]``, ``arguments`` a map or
a string), ``tool_call_id`` and ``name`` (a tool result's). ``tools`` is the list of
OpenAI tool definitions (``{"type": "function", "function": {"name", ...}}``), given to the
chat template as they are. Both hold only JSON values. Only their shape is checked here;
what the template makes of them is the station's (``station.serving.chat``).
"""

from __future__ import annotations

import json

from gnosis_daemon.wire.bounds import MAX_TOOLS
from gnosis_daemon.wire.read import bad

Message = dict[str, object]
Tool = dict[str, object]
MESSAGE_KEYS = ("tool_calls", "tool_call_id", "name")  # a message's fields beside role, content


def check_messages(value: object) -> list[Message]:
    """A non-empty list of messages, each rebuilt from the fields it may carry."""
    if not isinstance(value, list) or not value:
        raise bad("argument 'messages' must be a non-empty list of {role, content} maps")
    out = []
    for i, message in enumerate(value):
        if not (isinstance(message, dict) and isinstance(message.get("role"), str)
                and isinstance(message.get("content"), str)):
            raise bad(f"messages[{i}] must be a map with string 'role' and 'content'")
        checked: Message = {"role": message["role"], "content": message["content"]}
        for key in ("tool_call_id", "name"):
            if message.get(key) is not None:
                if not isinstance(message[key], str):
                    raise bad(f"messages[{i}].{key} must be a string")
                checked[key] = message[key]
        if message.get("tool_calls"):
            checked["tool_calls"] = _tool_calls(message["tool_calls"], f"messages[{i}]")
        out.append(checked)
    return out


def _tool_calls(calls: object, where: str) -> list[dict[str, object]]:
    if not isinstance(calls, list):
        raise bad(f"{where}.tool_calls must be a list")
    out: list[dict[str, object]] = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not (isinstance(call, dict) and isinstance(function, dict)
                and isinstance(function.get("name"), str)
                and isinstance(function.get("arguments"), (dict, str))):
            raise bad(f"{where}.tool_calls[{j}] must be a map with 'function': "
                      f"{{'name': string, 'arguments': map or string}}")
        if not isinstance(call.get("id", ""), str):
            raise bad(f"{where}.tool_calls[{j}].id must be a string")
        out.append({"id": call.get("id", ""), "type": "function",
                    "function": {"name": function["name"], "arguments": function["arguments"]}})
    json_only(out, f"{where}.tool_calls")
    return out


def check_tools(value: object) -> list[Tool] | None:
    """``tools``: None or a list of 1 to ``MAX_TOOLS`` ``{"type": "function", "function":
    {"name", ...}}`` maps (passed to the template as they are)."""
    if value is None:
        return None
    if not isinstance(value, list) or not 1 <= len(value) <= MAX_TOOLS:
        raise bad(f"argument 'tools' must be a list of 1 to {MAX_TOOLS} tool maps")
    tools: list[Tool] = []
    for i, tool in enumerate(value):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not (isinstance(tool, dict) and isinstance(function, dict)
                and isinstance(function.get("name"), str) and function["name"]):
            raise bad(f"tools[{i}] must be a map with 'function': {{'name': string, ...}}")
        tools.append(tool)
    json_only(tools, "argument 'tools'")
    return tools


def json_only(value: object, what: str) -> None:
    """Refuse ``value`` unless JSON can hold it (a raw frame may carry bytes, NaN, odd keys)."""
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError, RecursionError):
        raise bad(f"{what} must hold only JSON values") from None


def json_chars(value: object) -> int:
    return len(json.dumps(value, ensure_ascii=False)) if value else 0


def messages_chars(messages: list[Message] | tuple[Message, ...]) -> int:
    """The characters the template writes of the messages: roles, contents, tool fields."""
    return sum(len(str(m["role"])) + len(str(m["content"]))
               + sum(json_chars(m.get(k)) for k in MESSAGE_KEYS) for m in messages)
