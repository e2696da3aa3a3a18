"""What every tool-call parser hands out: whole calls (`ToolCall`) and the deltas of a streamed answer
(`ParsedDelta`), in OpenAI's shapes."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text of the arguments object


@dataclass
class ParsedDelta:
    content: str = ""
    # OpenAI streaming tool-call deltas: the first of a call is {"index", "id", "type": "function",
    # "function": {"name", "arguments"}}, later ones {"index", "function": {"arguments": piece}}
    tool_calls: list[dict] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.tool_calls)

    def extend(self, later: ParsedDelta) -> None:
        """Append what a later delta says (a stream's last feed and its finish go out as one chunk)."""
        self.content += later.content
        self.tool_calls += later.tool_calls
