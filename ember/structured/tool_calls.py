"""`tools` + `tool_choice` "required" or a named function -> a structural tag that holds the answer
to tool calls in the model's own format, the arguments held to that tool's `parameters` schema:

- `qwen_3` (Hermes JSON, Qwen3 and older): `<tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>`
- `qwen_3_5` (Qwen3-Coder XML, Qwen3.5 and Qwen3-Coder):
  `<tool_call>\n<function=f>\n<parameter=p>\nvalue\n</parameter>\n</function>\n</tool_call>`

The server's tool-call parser names the format (ember.server.tool_parsers: what reads the calls
back), so a forced call is written the way the model was trained to write one. The call tags are
xgrammar's own (`get_builtin_structural_tag(format)`). For "required" its template lets free text run
before the first call and any number of calls after; ember wants the answer to be calls only, and to
end (a small model must not talk, or call again and again, until max_tokens), so the same call tags
are put in a sequence: one call, then up to MAX_PARALLEL_TOOL_CALLS - 1 more after a newline (none
when parallel_tool_calls is false), the way whitespace runs are bounded.
"""

from __future__ import annotations

import xgrammar as xgr
from xgrammar.structural_tag import ConstStringFormat, OrFormat, RepeatFormat, SequenceFormat, StructuralTag

from ember.errors import InvalidRequestError, UnenforcedKeywordError
from ember.structured.schema_check import prepare_schema
from ember.structured_params import DEFAULT_MAX_WHITESPACE

# xgrammar's builtin formats that ember's tool-call parsers read back
MODEL_FORMATS = ("qwen_3", "qwen_3_5")
# Most calls in one answer under tool_choice "required" with parallel_tool_calls.
MAX_PARALLEL_TOOL_CALLS = 4


def _arguments_schema(tool: dict) -> dict:
    """A tool's `parameters` as the schema its arguments object must meet: none means `{}` (OpenAI's
    function without parameters), a schema without a type is an object's; keywords xgrammar would not
    enforce are refused here too."""
    params = tool["function"].get("parameters")
    if not params:
        return {"type": "object", "properties": {}}
    params = dict(params)
    params.setdefault("type", "object")
    try:
        return prepare_schema(params)
    except UnenforcedKeywordError as e:
        name = tool["function"]["name"]
        raise InvalidRequestError(
            str(e).replace("structured_outputs.json", f"the parameters of tool {name!r}")
        ) from None


def tool_call_structural_tag(
    tools: list[dict],
    tool_choice: str | dict,
    parallel_tool_calls: bool = True,
    max_whitespace: int | None = DEFAULT_MAX_WHITESPACE,
    model_format: str = "qwen_3",
) -> str:
    """The structural tag's JSON text; tools in OpenAI's shape ({"type": "function", "function": ...});
    model_format: one of MODEL_FORMATS, the call format the answer is written in."""
    if model_format not in MODEL_FORMATS:
        raise ValueError(f"no tool-call structural tag for the format {model_format!r}")
    names = [t["function"]["name"] for t in tools]
    tools = [{**t, "function": {**t["function"], "parameters": _arguments_schema(t)}} for t in tools]
    if isinstance(tool_choice, dict):
        name = (tool_choice.get("function") or {}).get("name")
        if tool_choice.get("type") != "function" or not isinstance(name, str):
            raise InvalidRequestError('a named tool_choice is {"type": "function", "function": {"name": ...}}')
        if name not in names:
            raise InvalidRequestError(
                f"tool_choice names the function {name!r}, which is not in tools ({', '.join(repr(n) for n in names)})"
            )
        tag = xgr.get_builtin_structural_tag(
            model_format, tools=tools, tool_choice=tool_choice, reasoning=False, max_whitespace_cnt=max_whitespace
        )
        return tag.model_dump_json()
    if tool_choice != "required":
        raise ValueError(f"no structural tag for tool_choice {tool_choice!r}")
    auto = xgr.get_builtin_structural_tag(
        model_format, tools=tools, tool_choice="auto", reasoning=False, max_whitespace_cnt=max_whitespace
    )
    call = OrFormat(elements=list(auto.format.tags))
    if not parallel_tool_calls:
        return StructuralTag(format=call).model_dump_json()
    more = RepeatFormat(
        min=0, max=MAX_PARALLEL_TOOL_CALLS - 1, content=SequenceFormat(elements=[ConstStringFormat(value="\n"), call])
    )
    return StructuralTag(format=SequenceFormat(elements=[call, more])).model_dump_json()
