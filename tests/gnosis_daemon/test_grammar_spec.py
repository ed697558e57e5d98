"""The grammar spec checker (pure): accepted shapes, and every JSON Schema feature the grammar
engine would silently ignore refused by name with where it is."""

from __future__ import annotations

import math

import pytest

from gnosis_daemon.grammar_spec import GrammarSpecError, check_grammar, schema_problem

GOOD_SCHEMA = {
    "$defs": {"point": {"type": "object", "properties": {"x": {"type": "number"}},
                        "required": ["x"]}},
    "type": "object", "title": "T", "description": "d",
    "properties": {"p": {"$ref": "#/$defs/point"},
                   "s": {"type": "string", "pattern": "^[a-z]+$"},
                   "d": {"type": "string", "format": "date"},
                   "l": {"type": "string", "minLength": 1, "maxLength": 9},
                   "n": {"type": "integer", "minimum": 0, "multipleOf": 2},
                   "m": {"type": ["integer", "null"]},
                   "a": {"type": "array", "items": {"enum": [1, "x", None]}, "maxItems": 3},
                   "t": {"type": "array", "prefixItems": [{"const": 1}], "items": False},
                   "u": {"anyOf": [{"type": "boolean"}, {"type": "null"}]}},
    "additionalProperties": False}


def test_good_specs_pass():
    for spec in ({"type": "json_object"}, {"type": "json_schema", "schema": GOOD_SCHEMA},
                 {"type": "regex", "regex": "a+"}, {"type": "ebnf", "ebnf": 'root ::= "a"'},
                 {"type": "structural_tag", "structural_tag": {"type": "structural_tag",
                  "format": {"type": "tag", "begin": "<a>", "end": "</a>", "content": {
                      "type": "json_schema", "json_schema": GOOD_SCHEMA}}}}):
        assert check_grammar(spec) is spec
    assert schema_problem(GOOD_SCHEMA) is None


@pytest.mark.parametrize("schema, problem", [
    ({"not": {}}, "'not' at / is not supported"),
    ({"type": "array", "uniqueItems": True}, "'uniqueItems' at / is not supported"),
    ({"type": "array", "contains": {}}, "'contains'"),
    ({"if": {}, "then": {}}, "'if'"),
    ({"properties": {"a": {"dependentRequired": {}}}}, "'dependentRequired' at /properties/a"),
    ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "'oneOf' with more than one schema"),
    ({"allOf": [{"type": "integer"}, {"minimum": 3}]}, "'allOf' with more than one schema"),
    ({"type": "number", "multipleOf": 0.5}, "'multipleOf' at / is supported only with"),
    ({"type": "string", "format": "idn-email"}, "'format': 'idn-email'"),
    ({"$ref": "http://example.com/s.json"}, "'$ref' at / must point into the schema"),
    ({"type": "array", "items": [{"type": "string"}]}, "'items' as an array"),
    ({"type": "strin"}, "'type' at / must name JSON types, got 'strin'"),
    ({"$defs": {"d": {"anyOf": [{"not": {}}]}}}, "'not' at /$defs/d/anyOf/0"),
    ({"required": "a"}, "'required' at / must be an array of strings"),
    # xgrammar keeps the pattern and drops the lengths, with only a warning
    ({"type": "string", "pattern": "^a+$", "maxLength": 3}, "'pattern' with 'minLength' or"),
    ({"type": "string", "format": "email", "maxLength": 5}, "'format' with 'pattern', 'min"),
    ({"type": "string", "format": "date", "pattern": "^a+$"}, "'format' with 'pattern', 'min"),
])
def test_unenforceable_schema_features_are_named(schema, problem):
    assert problem in schema_problem(schema)
    with pytest.raises(GrammarSpecError, match="schema: "):
        check_grammar({"type": "json_schema", "schema": schema})


def test_deep_nesting_is_refused_without_recursion_trouble():
    schema: dict = {"type": "object"}
    for _ in range(100):
        schema = {"type": "object", "properties": {"a": schema}}
    assert "nested more than 64 levels" in schema_problem(schema)


@pytest.mark.parametrize("spec, words", [
    (None, "must be a map"), ({"type": 3}, "must be a map"),
    ({"type": "xml"}, "'xml' is not one of"),
    ({"type": "json_object", "schema": {}}, "unknown field 'schema'"),
    ({"type": "json_schema"}, "needs 'schema'"),
    ({"type": "json_schema", "schema": "{}"}, "must be a map"),
    ({"type": "regex", "regex": ""}, "non-empty string"),
    ({"type": "structural_tag", "structural_tag": {"format": {}}}, "must be a map"),
    ({"type": "structural_tag", "structural_tag": {"type": "structural_tag", "format": {
        "type": "json_schema", "json_schema": {"not": {}}}}}, "'not' at format/json_schema"),
    ({"type": "json_schema", "schema": {"enum": [b"bytes"]}}, "only JSON values"),
    ({"type": "json_schema", "schema": {"enum": [math.nan]}}, "only JSON values"),
    ({"type": "regex", "regex": "a" * 300_000}, "larger than"),
])
def test_bad_specs_are_named(spec, words):
    with pytest.raises(GrammarSpecError, match=None) as info:
        check_grammar(spec)
    assert words in str(info.value)


def test_the_node_bound_counts_every_json_value():
    from gnosis_daemon.grammar_spec import count_nodes

    assert count_nodes({"a": [1, 2, {"b": None}]}, 100) == 6  # the map, list, 1, 2, map, null
    assert count_nodes(list(range(10**6)), 50) == 51  # stops past the limit
    wide = {"type": "json_schema", "schema": {"type": "object", "properties": {
        f"p{i}": {"type": "integer"} for i in range(9000)}}}
    assert check_grammar(wide) is wide
    with pytest.raises(GrammarSpecError, match="more than 4096 JSON values .*grammar_max_nodes"):
        check_grammar(wide, 4096)
