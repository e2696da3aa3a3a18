"""StructuredOutputsParams: the shape a request's answer must have (vLLM's names and fields).

Exactly one constraint: `json` (a JSON schema, as a dict or its text), `json_object` (any JSON
object), `regex`, `choice` (one of these strings), `grammar` (EBNF, as xgrammar reads it; GBNF
and Lark-style rules are close enough for most grammars) or `structural_tag` (xgrammar's JSON
format; the server builds one for `tool_choice`). The options shape JSON only:
`disable_any_whitespace` allows only the fixed separators `, ` and `: `, `max_whitespace` bounds each
run of it (ember's bound by default, so a small model cannot loop on spaces until max_tokens),
`disable_additional_properties` forbids keys the schema does not name, `whitespace_pattern` is
vLLM's knob and is refused: xgrammar bounds whitespace by count, not by pattern.

A leaf module: it checks the fields' types; whether the constraint compiles is the grammar
library's call (ember.structured), made when the request is added.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ember.errors import InvalidRequestError

# Whitespace characters allowed in a row between JSON tokens by default: room for a newline and
# an indent of a few levels, while a model that keeps choosing spaces is made to move on.
DEFAULT_MAX_WHITESPACE = 16

CONSTRAINTS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")


def _bad(name: str, value: object, allowed: str) -> InvalidRequestError:
    shown = value if len(repr(value)) < 80 else f"{repr(value)[:77]}..."
    return InvalidRequestError(f"structured_outputs.{name}={shown!r} is invalid: {allowed}")


@dataclass
class StructuredOutputsParams:
    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    max_whitespace: int = DEFAULT_MAX_WHITESPACE
    disable_fallback: bool = False  # vLLM's: there is one backend, so nothing to fall back to

    def __post_init__(self) -> None:
        given = [name for name in CONSTRAINTS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise InvalidRequestError(
                "structured_outputs needs exactly one of "
                + ", ".join(CONSTRAINTS)
                + (f"; got {', '.join(given)}" if given else "; got none")
            )
        if isinstance(self.json, str):
            try:
                self.json = json.loads(self.json)
            except json.JSONDecodeError as e:
                raise _bad("json", self.json, f"the schema is not valid JSON ({e})") from None
        if self.json is not None and not isinstance(self.json, (dict, bool)):
            raise _bad("json", self.json, "a JSON schema: an object (or its JSON text)")
        for name in ("regex", "grammar", "structural_tag"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise _bad(name, v, "a non-empty string")
        if self.choice is not None:
            if (
                not isinstance(self.choice, (list, tuple))
                or not self.choice
                or not all(isinstance(c, str) for c in self.choice)
            ):
                raise _bad("choice", self.choice, "a non-empty list of strings")
            self.choice = list(self.choice)
        if self.whitespace_pattern is not None:
            raise _bad(
                "whitespace_pattern",
                self.whitespace_pattern,
                "ember's grammar library bounds whitespace by count, not by a pattern; use "
                "disable_any_whitespace (none at all) or leave it unset (a bounded run)",
            )
        if not isinstance(self.max_whitespace, int) or isinstance(self.max_whitespace, bool) or self.max_whitespace < 0:
            raise _bad("max_whitespace", self.max_whitespace, "an integer >= 0")
        for name in ("disable_any_whitespace", "disable_additional_properties", "disable_fallback"):
            if not isinstance(getattr(self, name), bool):
                raise _bad(name, getattr(self, name), "true or false")

    @property
    def kind(self) -> str:
        return next(name for name in CONSTRAINTS if getattr(self, name) not in (None, False))

    def key(self) -> str:
        """One string per distinct compiled grammar: the cache key."""
        return json.dumps(
            {
                "kind": self.kind,
                "value": getattr(self, self.kind),
                "ws": 0 if self.disable_any_whitespace else self.max_whitespace,
                "strict": self.disable_additional_properties,
            },
            sort_keys=True,
        )

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StructuredOutputsParams:
        unknown = sorted(set(d) - set(cls.__dataclass_fields__))
        if unknown:
            raise InvalidRequestError(
                f"structured_outputs has unknown fields {unknown}; it takes " + ", ".join(cls.__dataclass_fields__)
            )
        return cls(**{k: v for k, v in d.items() if v is not None})
