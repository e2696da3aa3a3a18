"""StructuredOutputsParams -> an xgrammar Grammar (tokenizer-independent, cheap to build).

Building it is where a bad schema, regex or grammar is found, so it runs when the request is
added and the client gets a 400 naming the problem; compiling it against the vocabulary (the
expensive part) is ember.structured.manager's, off the step's critical path.
"""

from __future__ import annotations

import json

import xgrammar as xgr

from ember.errors import GrammarError, UnenforcedKeywordError
from ember.structured.schema_check import prepare_schema
from ember.structured_params import StructuredOutputsParams


def _library_message(e: Exception) -> str:
    # xgrammar prefixes "[hh:mm:ss] /project/cpp/file.cc:line: "; the client needs what follows.
    text = str(e).strip()
    head, sep, rest = text.partition(": ")
    if sep and head.startswith("[") and ".cc:" in head:
        text = rest.strip()
    return text.splitlines()[0] if text else type(e).__name__


def _whitespace(params: StructuredOutputsParams) -> dict:
    if params.disable_any_whitespace:
        return {"any_whitespace": False}
    return {"any_whitespace": True, "max_whitespace_cnt": params.max_whitespace}


def build_grammar(params: StructuredOutputsParams) -> xgr.Grammar:
    kind = params.kind
    try:
        if kind == "json":
            schema = params.json
            if schema is True or schema == {}:  # "any JSON value"
                return xgr.Grammar.from_json_schema({}, strict_mode=True, **_whitespace(params))
            if schema is False:
                raise GrammarError("structured_outputs.json is false: a schema that allows nothing", "json")
            schema = prepare_schema(schema)  # refuses keywords xgrammar would not enforce
            return xgr.Grammar.from_json_schema(json.dumps(schema), strict_mode=True, **_whitespace(params))
        if kind == "json_object":
            return xgr.Grammar.from_json_schema({"type": "object"}, strict_mode=False, **_whitespace(params))
        if kind == "regex":
            return xgr.Grammar.from_regex(params.regex)
        if kind == "choice":
            # EBNF string literals; ensure_ascii=False: xgrammar reads a \uXXXX escape as one code point, so an
            # escaped surrogate pair would become two (invalid) characters instead of the one above U+FFFF
            return xgr.Grammar.from_ebnf(
                "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in params.choice)
            )
        if kind == "grammar":
            return _ebnf_or_lark(params.grammar)
        return xgr.Grammar.from_structural_tag(params.structural_tag)
    except GrammarError:
        raise
    except UnenforcedKeywordError as e:
        raise GrammarError(str(e), kind) from None
    except (RuntimeError, ValueError, TypeError) as e:  # xgrammar's parse and conversion errors
        raise GrammarError(f"structured_outputs.{kind} cannot be compiled: {_library_message(e)}", kind) from None


def _ebnf_or_lark(text: str) -> xgr.Grammar:
    """EBNF (`root ::= ...`, as xgrammar and llama.cpp's GBNF write it), else Lark (`start: ...`)."""
    if "::=" in text:
        return xgr.Grammar.from_ebnf(text)
    try:
        return xgr.Grammar.from_lark(text)
    except (RuntimeError, ValueError) as e:
        raise GrammarError(
            "structured_outputs.grammar cannot be compiled: it has no `::=` rule (EBNF) and is "
            f"not a Lark grammar either ({_library_message(e)})",
            "grammar",
        ) from None
