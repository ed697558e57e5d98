"""The generic tool format, for a model whose chat template does not render tools (the
default SmolLM2-135M-Instruct's, like llama.cpp's generic handler for such templates).

The station's ``hello`` names the parser ``generic`` (``tool_parser = auto`` on such a
template, or ``tool_parser = generic``). The host then renders the tools itself, as text
the template does render (``generic_messages``):

- the tools go into the system message (appended to the request's own system message, or
  a new one first): ``TOOLS_INTRO``, each tool as one JSON line ``{"name", "description",
  "parameters"}``, then ``CALL_RULES``;
- an assistant message's ``tool_calls`` become its content, the same JSON object the model
  is asked to write (after the message's own text, on a line of its own);
- a ``tool`` message becomes a ``user`` message ``Tool result (<tool_call_id>): <content>``.

The model calls tools by answering with exactly one JSON object
``{"tool_calls": [{"name": <name>, "arguments": {...}}, ...]}`` (parsed by
``host.tool_calls``, family ``generic``); ``tool_choice`` ``required`` or a named function
forces that object by grammar, ``auto`` only asks for it.
"""

from __future__ import annotations

import json
from typing import Any

TOOLS_INTRO = "You can call these tools (one JSON object each: name, description, parameters):"
CALL_RULES = ('To call tools, answer with only this JSON object and nothing else: '
              '{"tool_calls": [{"name": "<tool name>", "arguments": {<the arguments>}}]} '
              '(one entry per call; the arguments must follow the tool\'s parameters schema). '
              'Otherwise, answer in plain text. The result of a call comes back in a message '
              'starting with "Tool result".')


def tools_text(tools: list[dict[str, Any]]) -> str:
    """The system prompt's part that describes ``tools`` (OpenAI tool maps)."""
    lines = [TOOLS_INTRO]
    for tool in tools:
        function = tool["function"]
        entry = {"name": function["name"]}
        for key in ("description", "parameters"):
            if function.get(key) is not None:
                entry[key] = function[key]
        lines.append(json.dumps(entry, ensure_ascii=False))
    lines.append(CALL_RULES)
    return "\n".join(lines)


def calls_text(calls: list[dict[str, Any]]) -> str:
    """An assistant's tool calls (station form: arguments a map or a string) as the JSON
    object the model writes."""
    out = []
    for call in calls:
        arguments = call["function"]["arguments"]
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                pass
        out.append({"name": call["function"]["name"], "arguments": arguments})
    return json.dumps({"tool_calls": out}, ensure_ascii=False)


def generic_messages(messages: list[dict[str, Any]],
                     tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """The station's chat messages with tools, calls and results written as plain text."""
    out: list[dict[str, Any]] = []
    for message in messages:
        role, content = message["role"], message.get("content") or ""
        if role == "tool":
            call_id = message.get("tool_call_id")
            head = f"Tool result ({call_id})" if call_id else "Tool result"
            out.append({"role": "user", "content": f"{head}: {content}"})
        elif message.get("tool_calls"):
            text = calls_text(message["tool_calls"])
            out.append({"role": role, "content": f"{content}\n{text}" if content else text})
        else:
            out.append({k: v for k, v in message.items() if k not in ("tool_calls", "tool_call_id")})
    if tools:
        described = tools_text(tools)
        if out and out[0]["role"] in ("system", "developer"):
            first = out[0]["content"]
            out[0] = {**out[0], "content": f"{first}\n\n{described}" if first else described}
        else:
            out.insert(0, {"role": "system", "content": described})
    return out
