"""JSON-schema keywords the grammar library accepts but does not enforce, found before compiling.

xgrammar (0.2.9) compiles a schema with `uniqueItems`, `allOf`, `if`/`then`/`else`, `contains`,
`not`, `dependentRequired`, `dependentSchemas` or a fractional `multipleOf` without error, and then
lets answers through that break them (tests/structured/test_structured_units.py shows each). A
"guaranteed" answer that does not validate is the silent garbage ember refuses to give: such a
schema is a 400 naming the keyword and where it is. Two shapes are rewritten instead, because
generators emit them for plain references: `{"allOf": [X]}` (one branch) is X, and `allOf` of
object schemas that only list properties and required keys is their union.

`oneOf` is enforced as `anyOf` (an answer matching two overlapping branches passes); pydantic's
discriminated unions, the common use, have disjoint branches.
"""

from __future__ import annotations

from ember.errors import UnenforcedKeywordError

UNENFORCED = ("allOf", "if", "then", "else", "contains", "not", "dependentRequired", "dependentSchemas")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_VALUES = (
    "items",
    "additionalProperties",
    "propertyNames",
    "contains",
    "not",
    "if",
    "then",
    "else",
    "unevaluatedProperties",
    "unevaluatedItems",
    "additionalItems",
)
_SCHEMA_LISTS = ("prefixItems", "anyOf", "oneOf", "allOf")
_MERGEABLE = {"type", "properties", "required", "description", "title", "additionalProperties"}


def prepare_schema(schema: object) -> object:
    """The schema with the allOf shapes above merged; raises UnenforcedKeywordError for the rest."""
    return _walk(schema, "")


def _walk(node: object, where: str) -> object:
    if not isinstance(node, dict):
        return node
    node = _merge_all_of(node, where)
    out = dict(node)
    for key, value in node.items():
        if key in UNENFORCED:
            raise UnenforcedKeywordError(_message(key, where))
        if key == "uniqueItems" and value is True:
            raise UnenforcedKeywordError(_message(key, where))
        if key == "multipleOf" and not (node.get("type") == "integer" and float(value).is_integer()):
            raise UnenforcedKeywordError(_message(key, where, "except as a whole number on an integer"))
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {k: _walk(v, f"{where}/{key}/{k}") for k, v in value.items()}
        elif key in _SCHEMA_VALUES:
            out[key] = _walk(value, f"{where}/{key}")
        elif key in _SCHEMA_LISTS and isinstance(value, list):
            out[key] = [_walk(v, f"{where}/{key}/{i}") for i, v in enumerate(value)]
    return out


def _merge_all_of(node: dict, where: str) -> dict:
    branches = node.get("allOf")
    if not isinstance(branches, list) or not all(isinstance(b, dict) for b in branches):
        return node
    rest = {k: v for k, v in node.items() if k != "allOf"}
    if len(branches) == 1 and not (set(rest) & set(branches[0])):
        return {**rest, **branches[0]}
    if (
        all(set(b) <= _MERGEABLE and b.get("type", "object") == "object" for b in branches)
        and set(rest) <= _MERGEABLE
        and rest.get("type", "object") == "object"
    ):
        merged = {
            **rest,
            "type": "object",
            "properties": dict(rest.get("properties", {})),
            "required": list(rest.get("required", [])),
        }
        for b in branches:
            for name, sub in b.get("properties", {}).items():
                if name in merged["properties"] and merged["properties"][name] != sub:
                    raise UnenforcedKeywordError(_message("allOf", where, f"where two branches define {name!r}"))
                merged["properties"][name] = sub
            merged["required"] += [r for r in b.get("required", []) if r not in merged["required"]]
            if "additionalProperties" in b:
                merged["additionalProperties"] = b["additionalProperties"]
        return merged
    return node


def _message(key: str, where: str, detail: str = "") -> str:
    at = where or "the top level"
    extra = f" ({detail})" if detail else ""
    return (
        f"structured_outputs.json uses `{key}` at {at}{extra}, which ember's grammar library (xgrammar) does "
        "not enforce: an answer could break it. Drop the keyword, or express it with properties, required, "
        "enum, anyOf, pattern and bounds"
    )
