"""A request's structured-output fields -> one StructuredOutputsParams (or None).

OpenAI's `response_format` (json_object, json_schema), vLLM's `structured_outputs` object, its
legacy `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`, and the tool-call
constraint of `tool_choice` "required" or a named function all land here; giving two of them is
a 400 that names both, never a silent pick. A constraint the grammar library cannot build is a 400
naming the field the client used and the library's reason.
"""

from __future__ import annotations

import json
from typing import Any

from ember.errors import InvalidRequestError, ParamError
from ember.structured_params import StructuredOutputsParams

_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
BACKENDS = (None, "auto", "xgrammar")


def _response_format(rf: dict[str, Any]) -> dict[str, Any] | None:
    kind = rf.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = rf.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec and "json_schema" not in spec:
            raise ParamError(
                'response_format json_schema needs {"json_schema": {"name": ..., "schema": {...}}}', "response_format"
            )
        schema = spec.get("schema", spec.get("json_schema"))
        return {"json": schema}
    if kind == "structural_tag":
        if not isinstance(rf.get("format"), dict):
            raise ParamError(
                'response_format structural_tag takes xgrammar\'s form {"type": "structural_tag", '
                '"format": {...}}; the older "structures" / "triggers" form is not supported',
                "response_format",
            )
        return {"structural_tag": json.dumps(rf)}
    raise ParamError(
        f"response_format type {kind!r} is not one of text, json_object, json_schema, structural_tag", "response_format"
    )


def structured_params(
    req, tool_constraint: dict[str, Any] | None = None, built=lambda params: False
) -> StructuredOutputsParams | None:
    """tool_constraint: {"structural_tag": ...} for tool_choice required / named (chat only); built(params):
    whether the engine already holds this constraint's grammar (then it is not built again here)."""
    given: list[tuple[str, dict[str, Any]]] = []
    if req.response_format:
        fields = _response_format(req.response_format)
        if fields is not None:
            given.append(("response_format", fields))
    if req.structured_outputs is not None:
        given.append(("structured_outputs", dict(req.structured_outputs)))
    for name, field in _GUIDED.items():
        value = getattr(req, name)
        if value is not None:
            given.append((name, {field: value}))
    if req.structural_tag is not None:
        given.append(("structural_tag", {"structural_tag": req.structural_tag}))
    if tool_constraint is not None:
        given.append(("tool_choice", tool_constraint))
    if req.guided_decoding_backend not in BACKENDS:
        raise ParamError(
            f"guided_decoding_backend {req.guided_decoding_backend!r}: ember compiles grammars with "
            "xgrammar; leave it unset or say xgrammar",
            "guided_decoding_backend",
        )
    if not given:
        if req.guided_whitespace_pattern is not None:
            raise ParamError(
                "guided_whitespace_pattern needs a guided_json or response_format constraint",
                "guided_whitespace_pattern",
            )
        return None
    if len(given) > 1:
        names = " and ".join(n for n, _ in given)
        raise ParamError(f"{names} both constrain the answer; give one of them", given[1][0])
    name, fields = given[0]
    if req.guided_whitespace_pattern is not None:
        fields["whitespace_pattern"] = req.guided_whitespace_pattern
    from ember.structured.grammar import build_grammar

    try:
        params = StructuredOutputsParams.from_dict(fields)
        if not built(params):  # here, so that the 400 names the field the client used (the engine builds it again)
            build_grammar(params)
    except InvalidRequestError as e:
        raise ParamError(str(e), name) from None
    return params
