"""The blocks of a chat answer (ember.server.chat_blocks) -> the Responses API's output items and
Response object, in the shapes of the openai SDK's types (`openai.types.responses`).

A thinking block is a `reasoning` item (its text as one `reasoning_text` content part, `summary`
empty: ember writes no summaries), a text block a `message` item with one `output_text` part, a tool
call a `function_call` item, or a `custom_tool_call` item when it calls one of the request's custom
(freeform) tools: its `input` is the string the model wrote as the function's one parameter.

`ResponseBuilder` is shared by the whole answer and the stream (ember.server.responses.stream), so
the two cannot differ: an item's ids are made once, when its block opens, and the item that
`response.output_item.added`, `response.output_item.done` and the final Response carry has the same
`id` and `call_id`. A block's item is complete when the block closes; the last one is `incomplete`
when the answer ran out of max_output_tokens.
"""

from __future__ import annotations

import json
import uuid
from typing import Callable

from ember.sampling import SamplingParams
from ember.server.chat_blocks import TEXT, THINKING, Block, BlockEvent, ChatBlocks
from ember.server.responses.protocol import ResponsesRequest
from ember.server.responses.translate import ChatTranslation

# A finish reason that leaves the Response incomplete -> its incomplete_details
INCOMPLETE = {"length": {"reason": "max_output_tokens"}}
# "abort": the engine ended the request (a shutdown's timeout ran out): the Response failed
ABORTED = "the server ended this response early (it is shutting down); send the request again"


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def custom_tool_input(arguments: str) -> str:
    """The raw input of a custom tool call, offered as a function whose one string parameter is
    `input`: that string; failing that, the only string the arguments hold; failing that (the
    model wrote something else), the arguments text itself, so nothing it wrote is lost."""
    try:  # strict=False: a raw newline inside the string (a patch's lines, as small models write them) is kept
        args = json.loads(arguments, strict=False)
    except json.JSONDecodeError:
        return arguments
    if isinstance(args, dict):
        if isinstance(args.get("input"), str):
            return args["input"]
        strings = [v for v in args.values() if isinstance(v, str)]
        if len(strings) == 1:
            return strings[0]
    return arguments


class ResponseBuilder:
    """Everything one request's Response objects and items are made from."""

    def __init__(
        self,
        req: ResponsesRequest,
        translation: ChatTranslation,
        response_id: str,
        created_at: int,
        model: str,
        count_tokens: Callable[[str], int],
    ):
        self.req = req
        self.custom_tools = translation.custom_tools
        self.tools = translation.tools
        self.id = response_id
        self.created_at = created_at
        self.model = model
        self.count_tokens = count_tokens  # text -> tokens: the reasoning tokens of the usage
        self._ids: dict[int, str] = {}  # block index -> its item's id, made when the block opens
        self.done: list[dict] = []  # the items of the blocks closed so far, in output order

    # -- the Response object ------------------------------------------------------------------
    def body(
        self,
        status: str = "in_progress",
        usage: dict | None = None,
        *,
        error: dict | None = None,
        incomplete_details: dict | None = None,
    ) -> dict:
        """The Response with the items done so far; the request's fields echoed as the SDK's
        Response type wants them."""
        req = self.req
        fmt = (req.text or {}).get("format") or {"type": "text"}
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "background": False,
            "error": error,
            "incomplete_details": incomplete_details,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "max_tool_calls": None,
            "model": self.model,
            "output": list(self.done),
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": None,
            "reasoning": {"effort": None, "summary": None, **(req.reasoning or {})},
            "service_tier": req.service_tier,
            "store": False,
            "temperature": req.temperature if req.temperature is not None else SamplingParams.temperature,
            "text": {**(req.text or {}), "format": fmt},
            "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
            "tools": self.tools,
            "top_p": req.top_p if req.top_p is not None else SamplingParams.top_p,
            "truncation": req.truncation or "disabled",
            "usage": usage,
            "user": req.user,
            "metadata": req.metadata or {},
            "prompt_cache_key": req.prompt_cache_key,
            "safety_identifier": req.safety_identifier,
        }

    def final_body(self, blocks: ChatBlocks, prompt_tokens: int, output_tokens: int, cached: int) -> dict:
        """The finished Response: its status from the answer's finish reason, and its usage."""
        reason = blocks.finish_reason
        usage = self.usage(blocks, prompt_tokens, output_tokens, cached)
        if reason == "abort":
            return self.body("failed", usage, error={"code": "server_error", "message": ABORTED})
        if reason in INCOMPLETE:
            return self.body("incomplete", usage, incomplete_details=INCOMPLETE[reason])
        return self.body("completed", usage)

    def usage(self, blocks: ChatBlocks, prompt_tokens: int, output_tokens: int, cached: int) -> dict:
        """Response usage. reasoning_tokens counts the reasoning text encoded again (the engine counts
        an answer's tokens, not which block each went to), at most the output tokens."""
        thought = sum(self.count_tokens(b.text) for b in blocks.blocks if b.kind == THINKING)
        return {
            "input_tokens": prompt_tokens,
            # ember's prefix cache is automatic: a hit is cached_tokens, nothing is written on request
            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens": output_tokens,
            "output_tokens_details": {"reasoning_tokens": min(thought, output_tokens)},
            "total_tokens": prompt_tokens + output_tokens,
        }

    # -- items --------------------------------------------------------------------------------
    def is_custom(self, block: Block) -> bool:
        return block.kind not in (TEXT, THINKING) and block.name in self.custom_tools

    def item(self, block: Block, status: str = "in_progress") -> dict:
        """The output item of a block: as it opens (status in_progress, no text yet), or done
        (status completed or incomplete, all its text)."""
        item_id, call_id = self.item_id(block), block.call_id
        done = status != "in_progress"
        if block.kind == THINKING:
            content = [{"type": "reasoning_text", "text": block.text}] if done else []
            return {
                "id": item_id,
                "type": "reasoning",
                "summary": [],
                "content": content,
                "encrypted_content": None,
                "status": status,
            }
        if block.kind == TEXT:
            content = [self.text_part(block.text)] if done else []
            return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": content}
        if self.is_custom(block):  # the SDK's ResponseCustomToolCall has no status
            text = custom_tool_input(block.text) if done else ""
            return {"id": item_id, "type": "custom_tool_call", "call_id": call_id, "name": block.name, "input": text}
        return {
            "id": item_id,
            "type": "function_call",
            "call_id": call_id,
            "name": block.name,
            "arguments": block.text if done else "",
            "status": status,
        }

    @staticmethod
    def text_part(text: str) -> dict:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def close(self, block: Block, finish_reason: str | None = None) -> dict:
        """The done item of a block that closed; kept for the Response's output. A block closes
        when the next begins (finish_reason None: complete) or at the end of the answer, with its
        finish reason (incomplete when cut by max_output_tokens)."""
        item = self.item(block, "incomplete" if finish_reason in INCOMPLETE else "completed")
        self.done.append(item)
        return item

    def item_id(self, block: Block) -> str:
        if block.index not in self._ids:
            prefix = {THINKING: "rs", TEXT: "msg"}.get(block.kind) or ("ctc" if self.is_custom(block) else "fc")
            self._ids[block.index] = _new_id(prefix)
        return self._ids[block.index]


def whole_response(builder: ResponseBuilder, answer: dict, cached: int) -> dict:
    """The Response for a whole chat answer (ChatHandler.whole: one choice): its message read into
    blocks exactly as a stream's chunks are."""
    choice = answer["choices"][0]
    blocks = ChatBlocks()
    events: list[BlockEvent] = blocks.feed_message(choice["message"], choice["finish_reason"], answer["usage"])
    for i, event in enumerate(events):
        if event.what == "close":  # the last event is the answer's end, where the last block closes
            builder.close(event.block, blocks.finish_reason if i == len(events) - 1 else None)
    usage = answer["usage"]
    return builder.final_body(blocks, usage["prompt_tokens"], usage["completion_tokens"], cached)
