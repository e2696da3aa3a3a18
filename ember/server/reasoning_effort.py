"""OpenAI's `reasoning_effort` -> the chat template's variables (`reasoning_effort`, `enable_thinking`).

A request names an effort in one of four places, all ending here: `chat_template_kwargs.reasoning_effort`,
a top-level `reasoning_effort` on /v1/chat/completions (OpenAI's field; the openai SDK sends it), the
Responses API's `reasoning.effort`, and Anthropic's `output_config.effort` (the last two become the chat
request's top-level field in their translations).

Precedence: an explicit `chat_template_kwargs.reasoning_effort` wins and goes to the template verbatim
(what llama-server's `--chat-template-kwargs` and vLLM users pass: they address the template, so the
template judges the value; a template that refuses it with raise_exception is a 400 naming its message).
The top-level value is OpenAI's vocabulary (EFFORTS) and is fitted to the template:

- a template that reads `reasoning_effort` and compares it with known strings (Qwen3.8's: low, medium,
  xhigh) gets the nearest of those on OpenAI's scale, a tie going up: `high` -> `xhigh` (as DashScope and
  the Qwen3.8 recipes map it; Claude Code sends `high` by default, and vLLM passing it verbatim makes the
  Qwen3.8 template raise: QwenLM/Qwen3.8#217), `minimal` -> `low`, `max` -> `xhigh`. A value the template
  lists goes as it is. `none` turns thinking off where the template has `enable_thinking`; where it has
  no off switch (Qwen3.8-Flash-Next always thinks) `none` is a 400 that says so;
- a template that reads `reasoning_effort` but whose values cannot be read off its source gets the value
  verbatim; one that does not read it at all gets nothing (it renders as before);
- a template with `enable_thinking` gets it from the effort, `none` -> false, any other -> true, unless
  the request sets enable_thinking itself (vLLM's mapping; Anthropic's `thinking` sets it explicitly, so it
  keeps deciding).

A value outside EFFORTS is a 400 naming the field and the values. The template's reading (which variables,
which values) is taken from its Jinja syntax tree once per template source.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jinja2
import jinja2.meta
import jinja2.nodes as nodes

from ember.errors import ParamError

# OpenAI's reasoning efforts (chat and Responses), with vLLM's and Anthropic's `max`, in rising order.
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
VARIABLE = "reasoning_effort"
THINKING_SWITCH = "enable_thinking"


@dataclass(frozen=True)
class TemplateEffort:
    """What a chat template does with an effort: whether it reads the variable, the values it compares it
    with (in the template's order; empty when none can be read), and whether it has enable_thinking."""

    reads_effort: bool
    levels: tuple[str, ...]
    has_thinking_switch: bool

    def level_for(self, effort: str, param: str) -> str | None:
        """The template's value for OpenAI's `effort` (None: pass no value; thinking is turned off)."""
        if effort in self.levels or (not self.levels and effort != "none"):
            return effort
        if effort == "none":
            if self.has_thinking_switch:
                return None
            if not self.levels:
                return effort  # the template's own business: it may know "none"
            raise ParamError(
                f"reasoning_effort 'none' is not available: this model's chat template always thinks (it has "
                f"no way to turn thinking off); it takes {', '.join(self.levels)}",
                param,
            )
        ranked = [level for level in self.levels if level in EFFORTS and level != "none"]
        if not ranked:
            raise ParamError(
                f"reasoning_effort {effort!r} has no counterpart in this model's chat template, which takes "
                f"{', '.join(self.levels)}; send one of those in chat_template_kwargs.reasoning_effort",
                param,
            )
        want = EFFORTS.index(effort)
        # the nearest on OpenAI's scale; of two equally near, the higher
        return min(ranked, key=lambda level: (abs(EFFORTS.index(level) - want), -EFFORTS.index(level)))


def template_kwargs(
    template: str | None, chat_template_kwargs: dict | None, effort: str | None, param: str = VARIABLE
) -> dict:
    """The variables the template gets: chat_template_kwargs, plus what `effort` (OpenAI's top-level
    value, or None) means for this template (the module docstring). chat_template_kwargs is not changed."""
    kwargs = dict(chat_template_kwargs or {})
    if effort is None or VARIABLE in kwargs:
        return kwargs
    if effort not in EFFORTS:
        raise ParamError(f"{param} {effort!r} is not one of {', '.join(EFFORTS)}", param)
    reading = template_effort(template or "")
    if reading.has_thinking_switch:
        kwargs.setdefault(THINKING_SWITCH, effort != "none")
    if reading.reads_effort:
        level = reading.level_for(effort, param)
        if level is not None:
            kwargs[VARIABLE] = level
    return kwargs


@functools.lru_cache(maxsize=16)
def template_effort(template: str) -> TemplateEffort:
    """How `template` reads reasoning_effort (a template that does not parse reads nothing here; rendering
    it says what is wrong)."""
    from ember.loader.tokenizer import _environment  # the environment the template renders in (its tags)

    try:
        tree = _environment().parse(template)
    except jinja2.TemplateSyntaxError:
        return TemplateEffort(False, (), False)
    levels = _levels(tree)  # before find_undeclared_variables, whose code generator folds literal lists in place
    free = jinja2.meta.find_undeclared_variables(tree)
    reads = VARIABLE in free
    return TemplateEffort(reads, levels if reads else (), THINKING_SWITCH in free)


def _levels(tree: nodes.Template) -> tuple[str, ...]:
    """The strings the template compares reasoning_effort (or a name set from it) with: `==`, `!=`, `in`."""
    names = {VARIABLE}
    assigns = [a for a in tree.find_all(nodes.Assign) if isinstance(a.target, nodes.Name)]
    grew = True
    while grew:  # {% set effort = reasoning_effort | default('xhigh') %}, and names set from those
        new = {a.target.name for a in assigns if _mentions(a.node, names)} - names
        names |= new
        grew = bool(new)
    found: list[str] = []
    for compare in tree.find_all(nodes.Compare):
        sides = [compare.expr, *(op.expr for op in compare.ops)]
        if any(_is_effort(side, names) for side in sides):
            found += [text for side in sides for text in _strings(side)]
    return tuple(dict.fromkeys(found))


def _mentions(expr: nodes.Node, names: set[str]) -> bool:
    if isinstance(expr, nodes.Name):
        return expr.name in names
    return any(n.name in names for n in expr.find_all(nodes.Name))


def _is_effort(expr: nodes.Node, names: set[str]) -> bool:
    """The effort itself, or it through filters (`reasoning_effort | lower`)."""
    while isinstance(expr, nodes.Filter) and expr.node is not None:
        expr = expr.node
    return isinstance(expr, nodes.Name) and expr.name in names


def _strings(expr: nodes.Node) -> list[str]:
    if isinstance(expr, nodes.Const) and isinstance(expr.value, str):
        return [expr.value]
    if isinstance(expr, (nodes.List, nodes.Tuple)):
        return [item.value for item in expr.items if isinstance(item, nodes.Const) and isinstance(item.value, str)]
    return []
