"""Tool calls in a model's output (pure): the parsers of the common families, streamed or
not, and the grammar that forces a call (``tool_choice`` ``required`` or a named function).

Families (the station's ``hello`` names the one its chat template teaches, or the
``tool_parser`` setting does):

- ``hermes`` (Hermes, Qwen2/2.5, the SmolLM family): ``<tool_call>{"name": ..., "arguments":
  {...}}</tool_call>``, one block per call, after optional text;
- ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` (the marker is a
  special token, so the text may start at ``[``), or ``[TOOL_CALLS]name[ARGS]{...}``;
- ``llama3``: the output is a JSON object ``{"name": ..., "parameters": {...}}`` (or
  several, separated by ``;``), optionally after ``<|python_tag|>``;
- ``generic`` (a template that renders no tools, ``host.generic_tools``): the output is one
  JSON object ``{"tool_calls": [{"name": ..., "arguments": {...}}, ...]}``.

``ToolCallParser`` reads the output as it streams: text that cannot be the start of a call
is content at once; text that may be (a prefix of a marker) is held back until it is known;
a call is emitted when it is complete (hermes: at its ``</tool_call>``; the JSON forms: at
the end). Output that looks like a call but does not parse is content, as it was written.
The non-streamed answer is the same parser fed the whole text, so both agree.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

PARSERS = ("hermes", "mistral", "llama3", "generic")
_MARKER = {"hermes": "<tool_call>", "mistral": "[TOOL_CALLS]", "llama3": "<|python_tag|>",
           "generic": '{"tool_calls"'}
_HERMES_END = "</tool_call>"
# The JSON forms may start the output without a marker (it is a special token, skipped).
_BARE_JSON = {"hermes": "", "mistral": "[", "llama3": "{", "generic": "{"}
MAX_WHITESPACE = 4  # consecutive whitespace characters a forced call's JSON may hold


@dataclass(frozen=True, slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text

    def openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


def call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


class ToolCallParser:
    """Streaming parser of one completion: ``feed`` text pieces, then ``finish``; each
    returns ``(content text, new calls)``. ``max_calls`` 1 keeps only the first call
    (``parallel_tool_calls: false``)."""

    def __init__(self, family: str, max_calls: int | None = None) -> None:
        assert family in PARSERS, family
        self.family = family
        self.marker = _MARKER[family]
        self.max_calls = max_calls
        self.calls: list[ToolCall] = []
        self._pending = ""
        self._mode = "start"  # start (nothing but whitespace yet) | text | calls

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        self._pending += text
        return self._drain(final=False)

    def finish(self) -> tuple[str, list[ToolCall]]:
        return self._drain(final=True)

    # -- the parsing
    def _drain(self, final: bool) -> tuple[str, list[ToolCall]]:
        content: list[str] = []
        before = len(self.calls)
        if self._mode == "start":
            head = self._pending.lstrip()
            if not head and not final:
                return "", []
            bare = _BARE_JSON[self.family]
            self._mode = "calls" if bare and head.startswith(bare) else "text"
        if self._mode == "text":
            at = self._pending.find(self.marker)
            if at >= 0:
                content.append(self._pending[:at])
                self._pending = self._pending[at:]
                self._mode = "calls"
            else:
                keep = 0 if final else _partial_suffix(self._pending, self.marker)
                content.append(self._pending[:len(self._pending) - keep])
                self._pending = self._pending[len(self._pending) - keep:]
        if self._mode == "calls":
            if self.family == "hermes":
                content.append(self._hermes(final))
            elif final:
                content.append(self._json_calls())
        return "".join(content), self.calls[before:]

    def _add(self, name: Any, arguments: Any) -> bool:
        if not isinstance(name, str) or not name or not isinstance(arguments, (dict, str)):
            return False
        if self.max_calls is None or len(self.calls) < self.max_calls:
            text = arguments if isinstance(arguments, str) else json.dumps(arguments,
                                                                            ensure_ascii=False)
            self.calls.append(ToolCall(call_id(), name, text))
        return True

    def _hermes(self, final: bool) -> str:
        content = []
        while True:
            stripped = self._pending.lstrip()
            if stripped.startswith(self.marker):
                end = stripped.find(_HERMES_END)
                if end < 0 and not final:
                    break  # the call is not complete yet
                block = stripped[:end + len(_HERMES_END)] if end >= 0 else stripped
                body = block[len(self.marker):len(block) - (len(_HERMES_END) if end >= 0 else 0)]
                self._pending = stripped[len(block):]
                value = _loads(body)
                if not (isinstance(value, dict)
                        and self._add(value.get("name"), value.get("arguments", {}))):
                    content.append(block)  # not a call after all: the text as written
                continue
            if not stripped or (not final and self.marker.startswith(stripped)):
                if final:
                    self._pending = ""
                break  # whitespace between calls, or what may be the next marker
            at = self._pending.find(self.marker)  # text after the calls is content
            if at >= 0:
                content.append(self._pending[:at])
                self._pending = self._pending[at:]
                continue
            keep = 0 if final else _partial_suffix(self._pending, self.marker)
            content.append(self._pending[:len(self._pending) - keep])
            self._pending = self._pending[len(self._pending) - keep:]
            break
        return "".join(content)

    def _json_calls(self) -> str:
        """Final: the whole rest is the mistral / llama3 calls, or content if it is not."""
        text, self._pending = self._pending, ""
        body = text.strip()
        if body.startswith(self.marker) and self.family != "generic":
            body = body[len(self.marker):].strip()
        found = {"mistral": _mistral, "llama3": _llama3, "generic": _generic}[self.family](body)
        if not found:
            return text
        for name, arguments in found:
            self._add(name, arguments)
        return ""


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that is a proper prefix of ``marker``."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def _loads(text: str) -> Any:
    """JSON, raw control characters in strings allowed (a forced call's grammar can let one
    into a string with minLength/maxLength); the arguments are written back escaped."""
    try:
        return json.loads(text, strict=False)
    except ValueError:
        return None


def _mistral(body: str) -> list[tuple[Any, Any]] | None:
    value = _loads(body)
    if isinstance(value, dict):
        value = [value]
    if isinstance(value, list) and value and all(isinstance(v, dict) and "name" in v
                                                 for v in value):
        return [(v["name"], v.get("arguments", {})) for v in value]
    calls = []  # the v11 form: name[ARGS]{...}, each call after its own [TOOL_CALLS]
    for part in body.split(_MARKER["mistral"]):
        name, sep, args = part.strip().partition("[ARGS]")
        value = _loads(args)
        if not sep or not isinstance(value, dict):
            return None
        calls.append((name.strip(), value))
    return calls or None


def _llama3(body: str) -> list[tuple[Any, Any]] | None:
    decoder, calls, pos = json.JSONDecoder(strict=False), [], 0
    while pos < len(body):
        try:
            value, pos = decoder.raw_decode(body, pos)
        except ValueError:
            return None
        if not (isinstance(value, dict) and "name" in value):
            return None
        calls.append((value["name"], value.get("parameters", value.get("arguments", {}))))
        while pos < len(body) and body[pos] in " \t\r\n;":
            pos += 1
    return calls or None


def _generic(body: str) -> list[tuple[Any, Any]] | None:
    value = _loads(body)
    calls = value.get("tool_calls") if isinstance(value, dict) and len(value) == 1 else None
    if isinstance(calls, list) and calls and all(isinstance(c, dict) and "name" in c
                                                 for c in calls):
        return [(c["name"], c.get("arguments", {})) for c in calls]
    return None


def parse_tool_calls(text: str, family: str,
                     max_calls: int | None = None) -> tuple[str | None, list[ToolCall]]:
    """A whole completion -> (content, or None when it is only whitespace; the calls)."""
    parser = ToolCallParser(family, max_calls)
    first, _ = parser.feed(text)
    rest, _ = parser.finish()
    content = first + rest
    return (content if content.strip() else None), parser.calls


# -- forcing a call: an xgrammar structural tag (gnosis_daemon.grammar_spec)
_FORCED = {  # family -> (prefix, call begin with {name}, call end, separator, suffix)
    "hermes": ("", '<tool_call>\n{{"name": "{name}", "arguments": ', "}\n</tool_call>", "\n", ""),
    "mistral": ("[", '{{"name": "{name}", "arguments": ', "}", ", ", "]"),
    "llama3": ("", '{{"name": "{name}", "parameters": ', "}", "; ", ""),
    "generic": ('{"tool_calls": [', '{{"name": "{name}", "arguments": ', "}", ", ", "]}"),
}


def forced_grammar(family: str, tools: list[dict[str, Any]], one: bool) -> dict[str, Any]:
    """The station grammar that makes the output one call (``one``) or one or more calls to
    ``tools`` (OpenAI tool maps), in the family's syntax, with each function's
    ``parameters`` as the arguments' JSON schema."""
    prefix, begin, end, separator, suffix = _FORCED[family]
    tags = [{"type": "tag", "begin": begin.format(name=tool["function"]["name"]),
             "content": {"type": "json_schema",
                         "json_schema": tool["function"].get("parameters") or {"type": "object"},
                         "max_whitespace_cnt": MAX_WHITESPACE},
             "end": end} for tool in tools]
    calls: dict[str, Any] = {"type": "tags_with_separator", "tags": tags, "separator": separator,
                             "at_least_one": True, "stop_after_first": one}
    parts = ([{"type": "const_string", "value": prefix}] if prefix else []) + [calls] + \
        ([{"type": "const_string", "value": suffix}] if suffix else [])
    fmt = parts[0] if len(parts) == 1 else {"type": "sequence", "elements": parts}
    return {"type": "structural_tag",
            "structural_tag": {"type": "structural_tag", "format": fmt}}
