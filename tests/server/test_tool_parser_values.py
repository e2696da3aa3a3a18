"""An XML tool call's parameter text typed by the tool's JSON schema (vLLM's and SGLang's rules), and
the failures that keep the text."""

from __future__ import annotations

import json

import pytest

from ember.server.tool_parsers.values import parameter_schemas, typed_value

CASES = [
    # text, schema, value
    ("Paris", {"type": "string"}, "Paris"),
    ("42", {"type": "string"}, "42"),  # a string stays text even when it reads as a number
    (" padded ", {"type": "string"}, " padded "),  # a string's own blanks are kept
    ("celsius", {"type": "string", "enum": ["celsius", "fahrenheit"]}, "celsius"),
    ("7", {"type": "integer"}, 7),
    (" -12 ", {"type": "integer"}, -12),
    ("2", {"type": "number"}, 2),  # integral text without . or e: an int
    ("2.0", {"type": "number"}, 2.0),
    ("1e3", {"type": "number"}, 1000.0),
    ("-0.25", {"type": "number"}, -0.25),
    ("true", {"type": "boolean"}, True),
    ("False", {"type": "boolean"}, False),
    ('{"a": [1, 2], "b": null}', {"type": "object"}, {"a": [1, 2], "b": None}),
    ("{'a': True, 'b': None}", {"type": "object"}, {"a": True, "b": None}),  # a Python literal
    ("[1, 'two']", {"type": "array"}, [1, "two"]),
    ("(1, 2)", {"type": "array"}, [1, 2]),  # a tuple is JSON's array
    ("null", {"type": "integer"}, None),
    ("null", {"type": "string"}, None),  # vLLM's rule: the text null is null, whatever the type
    ("5", {"type": ["integer", "null"]}, 5),
    ("5", {"anyOf": [{"type": "integer"}, {"type": "boolean"}]}, 5),
    ("5", {"type": ["integer", "string"]}, "5"),  # a string is allowed: the text is the value
    ("2", {"enum": [1, 2, 3]}, 2),  # an enum without a type: the member the text spells
    ("b", {"enum": ["a", "b"]}, "b"),
    ("c", {"enum": ["a", "b"]}, "c"),
    ("anything", {}, "anything"),  # a schema without a type
    ("12", None, "12"),  # a parameter the tool does not declare
]

FAILURES = [
    # text, schema: the text does not convert, so it stays the value
    ("three", {"type": "integer"}),
    ("1.5", {"type": "integer"}),
    ("nan", {"type": "number"}),  # JSON has no NaN
    ("inf", {"type": "number"}),
    ("1,5", {"type": "number"}),
    ("yes", {"type": "boolean"}),
    ("{oops", {"type": "object"}),
    ("{1, 2}", {"type": "array"}),  # a Python set: no JSON for it
    ("b'x'", {"type": "array"}),  # bytes
    ("[" * 5000, {"type": "array"}),  # deeper than the parsers go
]


@pytest.mark.parametrize("text, schema, value", CASES)
def test_values_are_typed_by_the_schema(text, schema, value):
    got = typed_value(text, schema)
    assert got == value and type(got) is type(value)


@pytest.mark.parametrize("text, schema", FAILURES)
def test_a_value_that_does_not_convert_stays_the_text(text, schema):
    got = typed_value(text, schema)
    assert got == text
    json.dumps(got, allow_nan=False)  # whatever comes back is JSON


def test_parameter_schemas_by_function():
    tools = [
        {"type": "function", "function": {"name": "f", "parameters": {"properties": {"x": {"type": "integer"}}}}},
        {"type": "function", "function": {"name": "g"}},  # no parameters at all
        {"type": "function", "function": {"name": "h", "parameters": {"type": "object", "properties": "bad"}}},
    ]
    assert parameter_schemas(tools) == {"f": {"x": {"type": "integer"}}, "g": {}, "h": {}}
