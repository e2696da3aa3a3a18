"""Reasoning parsers: a thinking model's `<think>...</think>` split from its answer (vLLM's
`--reasoning-parser qwen3` / `deepseek_r1`).

Where the reasoning starts is read from the prompt: a chat template that opens the turn with
`<think>` (DeepSeek-R1, Qwen3-2507 thinking, Qwen3.5) leaves the output inside the reasoning; one
that closes it (`<think>\\n\\n</think>`: Qwen3 with enable_thinking false) leaves it in the
answer. With neither in the prompt, `qwen3` lets the model decide (its output may open with
`<think>`) and `deepseek_r1` takes the output as reasoning up to `</think>`, as R1 writes it.

`ReasoningSplitter.feed(text)` takes text deltas and returns what may be shown now, as
(reasoning, content) deltas; text that could still be the start of a tag is held back until it
is decided. `finish()` flushes. The whole answer is the same splitter fed the text at once, so
the two paths agree.

A splitter may be told tags that end the reasoning implicitly (`implicit_ends`): when a request
has tools, `<tool_call>`, because Qwen3.5 sometimes opens a call inside its think block without
writing `</think>` first (vLLM's qwen3 parser reads it the same way). Such a tag is not consumed:
it starts the content, where the tool-call parser finds it. The engine uses `starts_in_reasoning` and `END` to start a structured-output
constraint where the answer begins (vLLM's rule).

A leaf module: plain strings, no engine, no server.
"""

from __future__ import annotations

from ember.config.groups import check_reasoning_parser

START = "<think>"
END = "</think>"

_UNDECIDED, _REASONING, _CONTENT = "undecided", "reasoning", "content"


def prompt_state(prompt_text: str) -> str | None:
    """'open' when the prompt's last think tag opens a reasoning block, 'closed' when it closes
    one, None when the prompt has neither."""
    start, end = prompt_text.rfind(START), prompt_text.rfind(END)
    if start == end == -1:
        return None
    return "open" if start > end else "closed"


def starts_in_reasoning(parser: str, prompt_text: str) -> bool | None:
    """Whether the output begins inside the reasoning: True, False, or None (qwen3, no tag in the
    prompt: the model decides with its first tokens)."""
    state = prompt_state(prompt_text)
    if state is not None:
        return state == "open"
    return True if parser == "deepseek_r1" else None


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest tail of text that is a proper prefix of tag."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class ReasoningSplitter:
    def __init__(self, parser: str, prompt_text: str = "", implicit_ends: tuple[str, ...] = ()):
        check_reasoning_parser(parser)
        begins = starts_in_reasoning(parser, prompt_text)
        self._state = _UNDECIDED if begins is None else (_REASONING if begins else _CONTENT)
        self._opened = False  # a leading <think> in the output has been consumed
        self._ends = (END, *implicit_ends)  # END is consumed, an implicit end starts the content
        self._buf = ""
        self.reasoning = ""
        self.content = ""

    def feed(self, text: str) -> tuple[str, str]:
        r0, c0 = len(self.reasoning), len(self.content)
        self._buf += text
        while self._buf:
            if self._state == _UNDECIDED:
                lead = self._buf.lstrip()
                if START.startswith(lead) and len(lead) < len(START):
                    break  # could still become <think>
                if lead.startswith(START):
                    self._state, self._buf = _REASONING, lead[len(START) :]
                    self._opened = True
                else:
                    self._state = _CONTENT
            elif self._state == _REASONING:
                if not self._opened:
                    lead = self._buf.lstrip()
                    if START.startswith(lead) and len(lead) < len(START):
                        break
                    self._opened = True
                    if lead.startswith(START):  # a template that opens <think> and a model that repeats it
                        self._buf = lead[len(START) :]
                        continue
                found = self._first_end()
                if found is None:
                    keep = max(partial_suffix(self._buf, tag) for tag in self._ends)
                    self.reasoning += self._buf[: len(self._buf) - keep]
                    self._buf = self._buf[len(self._buf) - keep :]
                    break
                at, tag = found
                self.reasoning += self._buf[:at]
                self._buf = self._buf[at + len(END) :] if tag == END else self._buf[at:]
                self._state = _CONTENT
            else:
                self.content += self._buf
                self._buf = ""
        return self.reasoning[r0:], self.content[c0:]

    def _first_end(self) -> tuple[int, str] | None:
        """(position, tag) of the first tag in the held text that ends the reasoning, or None."""
        hits = [(at, tag) for tag in self._ends if (at := self._buf.find(tag)) != -1]
        return min(hits) if hits else None

    def finish(self) -> tuple[str, str]:
        """The model stopped: held-back text goes where it was heading."""
        rest, self._buf = self._buf, ""
        if not rest:
            return "", ""
        if self._state == _REASONING:
            self.reasoning += rest
            return rest, ""
        self.content += rest
        return "", rest


def split_reasoning(
    parser: str, prompt_text: str, text: str, implicit_ends: tuple[str, ...] = ()
) -> tuple[str | None, str | None]:
    """The whole answer: (reasoning_content or None, content or None)."""
    s = ReasoningSplitter(parser, prompt_text, implicit_ends)
    s.feed(text)
    s.finish()
    return (s.reasoning or None), (s.content or None)
