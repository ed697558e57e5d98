"""``tools``, ``tool_choice``, ``parallel_tool_calls``, ``response_format`` and the tool fields
of chat messages: checked the way OpenAI shapes them, each bad value an ``ApiError`` 400
naming the field. A JSON schema the station's grammar engine cannot enforce is refused by
name (``gnosis_daemon.grammar_spec``) before the station sees it.

What they become (``ToolRequest``, then ``host.completions``):

- ``response_format`` ``json_object`` / ``json_schema`` -> the station's ``grammar``
  (``json_object`` does not require the word "JSON" in the messages, as OpenAI does: the
  grammar makes the output JSON whatever the prompt says);
- ``tools`` with ``tool_choice`` ``auto`` (the default), ``required`` or a named function ->
  the tools go to the chat template and the output is parsed for calls; ``required`` and a
  named function also get a grammar forcing the call (built once the station's tool parser
  is known); ``tool_choice: "none"`` sends no tools at all (the model is not told about
  them, so it answers in text) and parses nothing.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from gnosis_daemon.grammar_spec import schema_problem
from gnosis_daemon.wire import MAX_TOOLS
from host import errors, json_body
from host.fields import check_known

_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
TOOL_FIELDS = frozenset({"type", "function"})
FUNCTION_FIELDS = frozenset({"name", "description", "parameters", "strict"})
RESPONSE_FORMAT_FIELDS = frozenset({"type", "json_schema"})
JSON_SCHEMA_FIELDS = frozenset({"name", "description", "schema", "strict"})
CALL_FIELDS = frozenset({"id", "type", "function"})
CALL_FUNCTION_FIELDS = frozenset({"name", "arguments"})


@dataclass(frozen=True, slots=True)
class ToolRequest:
    """The tool side of a chat request: ``tools`` to render (None: none), ``choice``
    (``auto`` | ``required`` | a function's name), ``parallel`` (several calls allowed)."""

    tools: list[dict[str, Any]]
    choice: str
    parallel: bool
    named: bool  # choice is a function's name

    @property
    def forced(self) -> bool:
        return self.named or self.choice == "required"

    def forced_tools(self) -> list[dict[str, Any]]:
        if not self.named:
            return self.tools
        return [t for t in self.tools if t["function"]["name"] == self.choice]


def tool_request(body: dict[str, Any]) -> ToolRequest | None:
    """None when the request has no tools to use (none given, or ``tool_choice: none``)."""
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise errors.invalid_type("tools", "an array", tools)
        if len(tools) > MAX_TOOLS:
            raise errors.invalid_value("tools", f"array too long. Expected an array with maximum "
                                       f"length {MAX_TOOLS}, but got an array with length "
                                       f"{len(tools)} instead.")
        tools = [_tool(t, f"tools[{i}]") for i, t in enumerate(tools)]
        names = [t["function"]["name"] for t in tools]
        if len(set(names)) != len(names):
            raise errors.invalid_value("tools", "function names must be unique.")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise errors.invalid_type("parallel_tool_calls", "a boolean", parallel)
    choice, named = _tool_choice(body.get("tool_choice"), tools or [])
    if not tools or choice == "none":
        return None
    request = ToolRequest(tools, choice, parallel is not False, named)
    for i, tool in enumerate(tools):
        if tool in request.forced_tools() and request.forced:
            _check_schema(tool["function"].get("parameters"), f"tools[{i}].function.parameters")
    return request


def _tool(tool: Any, where: str) -> dict[str, Any]:
    if not isinstance(tool, dict):
        raise errors.invalid_type(where, "an object", tool)
    check_known(tool, TOOL_FIELDS, f"{where}.")
    if tool.get("type") != "function":
        raise errors.invalid_value(f"{where}.type", f"only 'function' tools are supported, but "
                                   f"got {tool.get('type')!r}.")
    function = tool.get("function")
    if not isinstance(function, dict):
        raise errors.invalid_type(f"{where}.function", "an object", function)
    check_known(function, FUNCTION_FIELDS, f"{where}.function.")
    _name(function.get("name"), f"{where}.function.name")
    for key, kind, expected in (("description", str, "a string"),
                                ("parameters", dict, "an object"), ("strict", bool, "a boolean")):
        value = function.get(key)
        if value is not None and not isinstance(value, kind):
            raise errors.invalid_type(f"{where}.function.{key}", expected, value)
    out = {k: v for k, v in function.items() if v is not None and k != "strict"}
    return {"type": "function", "function": out}


def _name(name: Any, where: str) -> str:
    if name is None:
        raise errors.missing(where)
    if not isinstance(name, str):
        raise errors.invalid_type(where, "a string", name)
    if not _NAME.fullmatch(name):
        raise errors.invalid_value(where, "must be 1 to 64 characters of a-z, A-Z, 0-9, "
                                   "underscores and dashes.")
    return name


def _tool_choice(choice: Any, tools: list[dict[str, Any]]) -> tuple[str, bool]:
    if choice is None:
        return ("auto" if tools else "none"), False
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise errors.invalid_value("tool_choice", f"must be 'none', 'auto', 'required' or "
                                       f"an object naming a function, but got {choice!r}.")
        if choice == "required" and not tools:
            raise errors.invalid_value("tool_choice", "'required' needs 'tools'.")
        return choice, False
    if not isinstance(choice, dict):
        raise errors.invalid_type("tool_choice", "a string or an object", choice)
    check_known(choice, TOOL_FIELDS, "tool_choice.")
    if choice.get("type") != "function" or not isinstance(choice.get("function"), dict):
        raise errors.invalid_value("tool_choice", "an object must be {\"type\": \"function\", "
                                   "\"function\": {\"name\": ...}}.")
    check_known(choice["function"], {"name"}, "tool_choice.function.")
    name = _name(choice["function"].get("name"), "tool_choice.function.name")
    if name not in {t["function"]["name"] for t in tools}:
        raise errors.invalid_value("tool_choice", f"names function {name!r}, which is not in "
                                   f"'tools'.")
    return name, True


def _check_schema(schema: Any, param: str) -> None:
    problem = schema_problem(schema) if schema is not None else None
    if problem:
        raise errors.unsupported(param, f"uses a JSON Schema feature this server cannot "
                                 f"enforce: {problem}.")


def response_format(value: Any) -> dict[str, Any] | None:
    """The station ``grammar`` of ``response_format`` (None: plain text)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise errors.invalid_type("response_format", "an object", value)
    check_known(value, RESPONSE_FORMAT_FIELDS, "response_format.")
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind != "json_schema":
        raise errors.invalid_value("response_format.type", f"must be 'text', 'json_object' or "
                                   f"'json_schema', but got {kind!r}.")
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise errors.missing("response_format.json_schema") if spec is None else \
            errors.invalid_type("response_format.json_schema", "an object", spec)
    check_known(spec, JSON_SCHEMA_FIELDS, "response_format.json_schema.")
    _name(spec.get("name"), "response_format.json_schema.name")
    for key, kind_, expected in (("description", str, "a string"), ("schema", dict, "an object"),
                                 ("strict", bool, "a boolean")):
        if spec.get(key) is not None and not isinstance(spec[key], kind_):
            raise errors.invalid_type(f"response_format.json_schema.{key}", expected, spec[key])
    schema = spec.get("schema")
    if schema is None:
        return {"type": "json_object"}
    _check_schema(schema, "response_format.json_schema.schema")
    return {"type": "json_schema", "schema": schema}


def message_tool_fields(message: dict[str, Any], role: str, where: str) -> dict[str, Any]:
    """A message's ``tool_calls`` (assistant) and ``tool_call_id`` (tool), as the station
    takes them: each call's ``arguments`` parsed to an object when it is one, which is
    what chat templates expect to render."""
    out: dict[str, Any] = {}
    call_id = message.get("tool_call_id")
    if call_id is not None:
        if not isinstance(call_id, str):
            raise errors.invalid_type(f"{where}.tool_call_id", "a string", call_id)
        out["tool_call_id"] = call_id
    calls = message.get("tool_calls")
    if calls is None or calls == []:
        return out
    if not isinstance(calls, list):
        raise errors.invalid_type(f"{where}.tool_calls", "an array", calls)
    if role != "assistant":
        raise errors.invalid_value(f"{where}.tool_calls", "only assistant messages have "
                                   "tool calls.")
    checked = []
    for j, call in enumerate(calls):
        at = f"{where}.tool_calls[{j}]"
        if not isinstance(call, dict):
            raise errors.invalid_type(at, "an object", call)
        check_known(call, CALL_FIELDS, f"{at}.")
        if not isinstance(call.get("id"), str):
            raise errors.invalid_type(f"{at}.id", "a string", call.get("id"))
        if call.get("type", "function") != "function":
            raise errors.invalid_value(f"{at}.type", "must be 'function'.")
        function = call.get("function")
        if not isinstance(function, dict):
            raise errors.invalid_type(f"{at}.function", "an object", function)
        check_known(function, CALL_FUNCTION_FIELDS, f"{at}.function.")
        name = function.get("name")
        if not isinstance(name, str):
            raise errors.invalid_type(f"{at}.function.name", "a string", name)
        arguments = function.get("arguments")
        if not isinstance(arguments, str):
            raise errors.invalid_type(f"{at}.function.arguments", "a string", arguments)
        try:
            parsed = json.loads(arguments)
        except ValueError:
            parsed = None
        unfit = json_body.unfit_path(parsed, f"{at}.function.arguments") if parsed is not None else None
        if unfit is not None:  # the arguments travel to the station's chat template as JSON
            raise errors.invalid_value(*unfit)
        checked.append({"id": call["id"], "type": "function", "function": {
            "name": name, "arguments": parsed if isinstance(parsed, dict) else arguments}})
    out["tool_calls"] = checked
    return out
