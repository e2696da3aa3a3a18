"""`tools` + `tool_choice` "required" or a named function -> a structural tag that holds the answer
to Qwen/Hermes tool calls: `<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>`, the
arguments held to that tool's `parameters` schema (what ember.server.tool_parser reads back).

The call format is xgrammar's own Qwen 3 template (`get_builtin_structural_tag("qwen_3")`). For
"required" its template lets free text run before the first call; ember wants the answer to be
calls only (a small model must not talk until max_tokens), so the same call tags are put in a
`tags_with_separator` with at least one call.
"""
from __future__ import annotations

import xgrammar as xgr
from xgrammar.structural_tag import StructuralTag, TagsWithSeparatorFormat

from ember.errors import InvalidRequestError

MODEL_FORMAT = "qwen_3"


def tool_call_structural_tag(tools: list[dict], tool_choice: str | dict, parallel_tool_calls: bool = True,
                             max_whitespace: int | None = None) -> str:
    """The structural tag's JSON text; tools in OpenAI's shape ({"type": "function", "function": ...})."""
    names = [t["function"]["name"] for t in tools]
    if isinstance(tool_choice, dict):
        name = (tool_choice.get("function") or {}).get("name")
        if tool_choice.get("type") != "function" or not isinstance(name, str):
            raise InvalidRequestError('a named tool_choice is {"type": "function", "function": {"name": ...}}')
        if name not in names:
            raise InvalidRequestError(f"tool_choice names the function {name!r}, which is not in tools "
                                      f"({', '.join(repr(n) for n in names)})")
        tag = xgr.get_builtin_structural_tag(MODEL_FORMAT, tools=tools, tool_choice=tool_choice, reasoning=False,
                                             max_whitespace_cnt=max_whitespace)
        return tag.model_dump_json()
    if tool_choice != "required":
        raise ValueError(f"no structural tag for tool_choice {tool_choice!r}")
    auto = xgr.get_builtin_structural_tag(MODEL_FORMAT, tools=tools, tool_choice="auto", reasoning=False,
                                          max_whitespace_cnt=max_whitespace)
    calls = TagsWithSeparatorFormat(tags=auto.format.tags, separator="\n", at_least_one=True,
                                    stop_after_first=not parallel_tool_calls)
    return StructuralTag(format=calls).model_dump_json()
