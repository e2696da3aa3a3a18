"""A parameter's text, as an XML tool call writes it, typed by the request's tool schema.

Qwen3-Coder's XML format writes every value as bare text (`<parameter=days>\\n3\\n</parameter>`), so
the JSON type comes from `tools[i].function.parameters.properties[NAME]`, as vLLM's and SGLang's
qwen3_coder parsers read it:

- string (or a type list that allows string), and a parameter the schema does not name: the text;
- integer: int; number: int when the text has no `.` or exponent, else a finite float;
- boolean: true / false (any case);
- object, array: JSON, else a Python literal (`{'a': 1}`, `True`), as small models write them;
- enum without a type: the member the text spells;
- the text `null`: null, whatever the type.

A value that does not convert stays the text: a call is never lost to one odd value (mlx-lm and
llama.cpp both dropped whole calls that way). Whatever comes back is JSON-serialisable.
"""

from __future__ import annotations

import ast
import json
import math
from typing import Any

_LITERAL_ERRORS = (ValueError, TypeError, SyntaxError, MemoryError, RecursionError)


def parameter_schemas(tools: list[dict]) -> dict[str, dict[str, Any]]:
    """function name -> {parameter name: its schema}, from tools in OpenAI's shape."""
    out: dict[str, dict[str, Any]] = {}
    for tool in tools:
        function = tool.get("function") or {}
        params = function.get("parameters") or {}
        props = params.get("properties") if isinstance(params, dict) else None
        if isinstance(function.get("name"), str):
            out[function["name"]] = props if isinstance(props, dict) else {}
    return out


def typed_value(text: str, schema: Any) -> Any:
    """text as the value schema describes (None: a parameter the tool does not declare)."""
    bare = text.strip()
    if bare == "null":
        return None
    if not isinstance(schema, dict):
        return text
    types = _types(schema)
    if not types and "enum" in schema:
        return _enum_member(text, bare, schema["enum"])
    if not types or "string" in types:
        return text
    for kind in types:
        value = _CONVERTERS.get(kind, _no_conversion)(bare)
        if value is not _FAILED:
            return value
    return text


def _types(schema: dict) -> list[str]:
    """The JSON types a schema allows, in its order (anyOf / oneOf branches included)."""
    kind = schema.get("type")
    types = [kind] if isinstance(kind, str) else [k for k in kind or [] if isinstance(k, str)]
    for key in ("anyOf", "oneOf"):
        for branch in schema.get(key) or []:
            if isinstance(branch, dict):
                types += [k for k in _types(branch) if k not in types]
    return [k for k in types if k != "null"]


def _enum_member(text: str, bare: str, members: Any) -> Any:
    for member in members if isinstance(members, list) else []:
        if isinstance(member, str):
            if member in (text, bare):
                return member
        elif json.dumps(member) == bare:
            return member
    return text


_FAILED = object()


def _no_conversion(bare: str) -> Any:
    return _FAILED


def _integer(bare: str) -> Any:
    try:
        return int(bare)
    except ValueError:
        return _FAILED


def _number(bare: str) -> Any:
    if not any(c in bare for c in ".eE"):
        value = _integer(bare)
        if value is not _FAILED:
            return value
    try:
        value = float(bare)
    except ValueError:
        return _FAILED
    return value if math.isfinite(value) else _FAILED  # JSON has no NaN or Infinity


def _boolean(bare: str) -> Any:
    return {"true": True, "false": False}.get(bare.lower(), _FAILED)


def _structured(bare: str) -> Any:
    try:
        value = json.loads(bare)
    except (json.JSONDecodeError, RecursionError):
        try:
            value = ast.literal_eval(bare)
        except _LITERAL_ERRORS:
            return _FAILED
    try:  # a literal may be a set, bytes or a complex number: not JSON; a tuple becomes a list
        return json.loads(json.dumps(value, allow_nan=False))
    except (TypeError, ValueError, RecursionError):
        return _FAILED


_CONVERTERS = {"integer": _integer, "number": _number, "boolean": _boolean, "object": _structured, "array": _structured}
