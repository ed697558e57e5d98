"""The ``grammar`` argument of the station's ``generate`` op, and the JSON Schema features the
station's grammar engine (xgrammar) enforces.

Pure (no torch, no xgrammar): the host checks a request's ``response_format`` and forced
tool calls with it before anything reaches the station, and the station checks every frame
with it again, so a schema keyword the engine would silently ignore (``not``,
``uniqueItems``...) is refused by name instead of producing output that does not validate.

Shapes (``check_grammar``):

- ``{"type": "json_object"}``: any JSON object;
- ``{"type": "json_schema", "schema": {...}}``: JSON matching the schema (only the
  keywords in ``SCHEMA_KEYWORDS``, ``format`` only in ``FORMATS``);
- ``{"type": "structural_tag", "structural_tag": {...}}``: xgrammar's structural tag
  (``{"type": "structural_tag", "format": {...}}``); every ``json_schema`` inside it is
  checked as above;
- ``{"type": "regex", "regex": str}`` and ``{"type": "ebnf", "ebnf": str}`` (xgrammar's
  EBNF, root rule ``root``).
"""

from __future__ import annotations

import json
from typing import Any

GRAMMAR_TYPES = ("json_object", "json_schema", "structural_tag", "regex", "ebnf")
# The grammar as JSON text: far past any real schema, small beside a frame.
MAX_GRAMMAR_CHARS = 256 * 1024
MAX_DEPTH = 64  # nesting of schemas (and of structural-tag formats)

JSON_TYPES = frozenset({"object", "array", "string", "number", "integer", "boolean", "null"})
# Keywords that constrain nothing.
ANNOTATIONS = frozenset({
    "title", "description", "default", "examples", "$schema", "$id", "$comment", "deprecated",
    "readOnly", "writeOnly", "contentMediaType", "contentEncoding"})
# Keywords the engine enforces (checked against xgrammar 0.2: an instance that breaks the
# keyword is refused by the grammar).
SCHEMA_KEYWORDS = frozenset({
    "type", "enum", "const", "properties", "required", "additionalProperties",
    "patternProperties", "propertyNames", "unevaluatedProperties", "minProperties",
    "maxProperties", "items", "prefixItems", "minItems", "maxItems", "minLength", "maxLength",
    "pattern", "format", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
    "multipleOf", "anyOf", "oneOf", "allOf", "$ref", "$defs", "definitions"}) | ANNOTATIONS
FORMATS = frozenset({
    "email", "date", "time", "date-time", "duration", "uuid", "uri", "uri-reference",
    "uri-template", "ipv4", "ipv6", "hostname", "json-pointer", "relative-json-pointer"})
# Keywords whose value is a map of name -> subschema, a subschema, or a list of subschemas.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SCHEMA_ONE = ("additionalProperties", "unevaluatedProperties", "propertyNames", "items")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")


class GrammarSpecError(ValueError):
    """A grammar the station cannot enforce; the message names the problem."""


def count_nodes(value: Any, limit: int) -> int:
    """The JSON values in ``value`` (every map, list and scalar, keys not counted), counted
    up to ``limit + 1``: what a grammar's compile time grows with (superlinearly)."""
    count, stack = 0, [value]
    while stack and count <= limit:
        item = stack.pop()
        count += 1
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return count


def check_grammar(value: Any, max_nodes: int | None = None) -> dict[str, Any]:
    """``value`` as a grammar spec (see the module docstring), or ``GrammarSpecError``;
    ``max_nodes``: the most JSON values it may hold (the ``grammar_max_nodes`` setting)."""
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise GrammarSpecError("must be a map with a string 'type'")
    kind = value["type"]
    if kind not in GRAMMAR_TYPES:
        raise GrammarSpecError(f"type {kind!r} is not one of {', '.join(GRAMMAR_TYPES)}")
    fields = {"json_object": (), "json_schema": ("schema",),
              "structural_tag": ("structural_tag",), "regex": ("regex",),
              "ebnf": ("ebnf",)}[kind]
    extra = sorted(set(value) - {"type", *fields})
    if extra:
        raise GrammarSpecError(f"unknown field {extra[0]!r} for type {kind!r}")
    for name in fields:
        if name not in value:
            raise GrammarSpecError(f"type {kind!r} needs {name!r}")
    try:
        text = canonical(value)
    except (TypeError, ValueError, RecursionError):  # bytes, NaN, odd keys, deep nesting
        raise GrammarSpecError("must hold only JSON values (maps with string keys, lists, "
                               "strings, finite numbers, booleans, null)") from None
    if len(text) > MAX_GRAMMAR_CHARS:
        raise GrammarSpecError(f"is larger than {MAX_GRAMMAR_CHARS} characters as JSON")
    if max_nodes is not None and count_nodes(value, max_nodes) > max_nodes:
        raise GrammarSpecError(f"holds more than {max_nodes} JSON values (the grammar_max_nodes "
                               f"bound: compiling a grammar grows faster than its size)")
    if kind == "json_schema":
        schema = value["schema"]
        if not isinstance(schema, dict):
            raise GrammarSpecError("'schema' must be a map (a JSON Schema object)")
        problem = schema_problem(schema)
        if problem:
            raise GrammarSpecError(f"schema: {problem}")
    elif kind == "structural_tag":
        tag = value["structural_tag"]
        if not isinstance(tag, dict) or tag.get("type") != "structural_tag" \
                or not isinstance(tag.get("format"), dict):
            raise GrammarSpecError("'structural_tag' must be a map {\"type\": "
                                   "\"structural_tag\", \"format\": {...}}")
        problem = _tag_problem(tag["format"], "format", 0)
        if problem:
            raise GrammarSpecError(f"structural_tag: {problem}")
    elif kind in ("regex", "ebnf") and not (isinstance(value[kind], str) and value[kind]):
        raise GrammarSpecError(f"{kind!r} must be a non-empty string")
    return value


def canonical(spec: Any) -> str:
    """The spec as JSON text with sorted keys: the compiled-grammar cache's key."""
    return json.dumps(spec, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                      allow_nan=False)


def schema_problem(schema: Any, path: str = "", depth: int = 0) -> str | None:
    """The first feature of ``schema`` the engine cannot enforce, as ``'<keyword>' at
    <path>: why``, or None. ``path`` is a JSON pointer of where it was found."""
    where = path or "/"
    if depth > MAX_DEPTH:
        return f"nested more than {MAX_DEPTH} levels at {where}"
    if isinstance(schema, bool):
        return None
    if not isinstance(schema, dict):
        return f"a schema must be an object or a boolean, at {where}"
    for key, value in schema.items():
        if key not in SCHEMA_KEYWORDS:
            return f"'{key}' at {where} is not supported"
        problem = _keyword_problem(key, value, schema, where)
        if problem:
            return problem
    for key in _SCHEMA_MAPS:
        for name, sub in (schema.get(key) or {}).items():
            problem = schema_problem(sub, f"{path}/{key}/{name}", depth + 1)
            if problem:
                return problem
    for key in _SCHEMA_ONE:
        if key in schema:
            problem = schema_problem(schema[key], f"{path}/{key}", depth + 1)
            if problem:
                return problem
    for key in _SCHEMA_LISTS:
        for i, sub in enumerate(schema.get(key) or ()):
            problem = schema_problem(sub, f"{path}/{key}/{i}", depth + 1)
            if problem:
                return problem
    return None


def _keyword_problem(key: str, value: Any, schema: dict[str, Any], where: str) -> str | None:
    if key == "type":
        types = value if isinstance(value, list) else [value]
        bad = [t for t in types if not isinstance(t, str) or t not in JSON_TYPES]
        if bad or not types:
            return f"'type' at {where} must name JSON types, got {bad[0] if bad else value!r}"
    elif key in _SCHEMA_MAPS and not isinstance(value, dict):
        return f"'{key}' at {where} must be an object"
    elif key in _SCHEMA_LISTS and not isinstance(value, list):
        return f"'{key}' at {where} must be an array"
    elif key == "items" and isinstance(value, list):
        return f"'items' as an array at {where} is not supported (use 'prefixItems')"
    elif key in ("oneOf", "allOf") and len(value) > 1:
        # xgrammar treats oneOf as anyOf and keeps only one allOf branch.
        return f"'{key}' with more than one schema at {where} is not supported (use 'anyOf')"
    elif key == "format" and (not isinstance(value, str) or value not in FORMATS):
        return f"'format': {value!r} at {where} is not supported"
    elif key == "format" and any(k in schema for k in ("pattern", "minLength", "maxLength")):
        # xgrammar enforces the format and drops the others (the lengths with a warning).
        return (f"'format' with 'pattern', 'minLength' or 'maxLength' at {where} is not "
                f"supported (use one 'pattern' for all of it)")
    elif key == "pattern" and ("minLength" in schema or "maxLength" in schema) \
            and "format" not in schema:
        # xgrammar keeps the pattern and drops the lengths (with only a warning).
        return (f"'pattern' with 'minLength' or 'maxLength' at {where} is not supported "
                f"(put the lengths in the pattern: {{m,n}})")
    elif key == "multipleOf" and schema.get("type") != "integer":
        return f"'multipleOf' at {where} is supported only with \"type\": \"integer\""
    elif key == "$ref" and not (isinstance(value, str) and value.startswith("#")):
        return f"'$ref' at {where} must point into the schema ('#...'), got {value!r}"
    elif key == "required" and not (isinstance(value, list)
                                     and all(isinstance(v, str) for v in value)):
        return f"'required' at {where} must be an array of strings"
    return None


def _tag_problem(fmt: Any, path: str, depth: int) -> str | None:
    """A structural-tag format: every json_schema in it must pass ``schema_problem``."""
    if depth > MAX_DEPTH:
        return f"nested more than {MAX_DEPTH} levels at {path}"
    if isinstance(fmt, list):
        for i, item in enumerate(fmt):
            problem = _tag_problem(item, f"{path}/{i}", depth + 1)
            if problem:
                return problem
        return None
    if not isinstance(fmt, dict):
        return None
    if fmt.get("type") == "json_schema":
        if fmt.get("style", "json") != "json":
            return f"json_schema style {fmt.get('style')!r} at {path} is not supported"
        schema = fmt.get("json_schema")
        if isinstance(schema, dict):
            return schema_problem(schema, f"{path}/json_schema")
        return None if isinstance(schema, bool) else \
            f"'json_schema' at {path} must be an object or a boolean"
    for key, value in fmt.items():
        if isinstance(value, (dict, list)):
            problem = _tag_problem(value, f"{path}/{key}", depth + 1)
            if problem:
                return problem
    return None
