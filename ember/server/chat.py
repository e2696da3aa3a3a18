"""POST /v1/chat/completions: messages through the chat template, then one engine request with n
sequences; answered whole or as SSE chunks, with tool calls parsed from the model's output by the
server's tool-call parser (Hermes JSON or Qwen3-Coder XML: ember.server.tool_parsers) and, under
--reasoning-parser, the model's <think> reasoning split off into reasoning_content (and vLLM's newer
name for it, reasoning).

tool_choice "required" or a named function holds the answer to tool calls in the parser's format
with a grammar (ember.structured.tool_calls); "auto" lets the model choose and parses what it wrote."""

from __future__ import annotations

import json
import logging
import time
from typing import Any, AsyncIterator

from ember.engine.async_engine import RequestStream
from ember.errors import InvalidRequestError, ParamError
from ember.server.completions import vllm_prompt_logprobs
from ember.server.logprobs import chat_logprobs
from ember.server.protocol import BatchChatCompletionRequest, ChatCompletionRequest, now, request_id
from ember.server.serving import STREAM_ERROR, Serving, all_or_none, merged, sse_writers, unless_disconnected
from ember.server.structured import structured_params
from ember.server.tool_parsers import TaggedToolParser
from ember.structured.reasoning import ReasoningSplitter

# Prompt tokens read back to see whether the template opened a reasoning block (ember.structured.reasoning).
PROMPT_TAIL_TOKENS = 64

logger = logging.getLogger("ember.server")


def _message_dict(m) -> dict[str, Any]:
    d = m.model_dump(exclude_none=True)
    content = m.content
    if isinstance(content, list):
        texts = []
        for part in content:
            if part.type != "text" or part.text is None:
                raise ParamError(
                    f"content part type {part.type!r} is not supported: ember serves text models; send text parts only",
                    "messages",
                )
            texts.append(part.text)
        d["content"] = "\n".join(texts)
    elif content is None:
        d["content"] = ""  # assistant turns with only tool calls; templates concatenate content
    if m.tool_calls:
        calls = []
        for call in m.tool_calls:
            call = dict(call)
            fn = dict(call.get("function") or {})
            args = fn.get("arguments")
            if isinstance(args, str):  # OpenAI sends JSON text; templates want the object
                try:
                    fn["arguments"] = json.loads(args)
                except json.JSONDecodeError:
                    pass
            call["function"] = fn
            calls.append(call)
        d["tool_calls"] = calls
    return d


class ChatHandler:
    def __init__(self, serving: Serving):
        self.s = serving

    def _tool_constraint(self, req: ChatCompletionRequest, tools: list[dict] | None) -> dict | None:
        """tool_choice "required" / named: the structural tag that holds the answer to tool calls."""
        choice = req.tool_choice
        if choice is None or choice in ("auto", "none"):
            return None
        if not tools:
            raise ParamError(
                f"tool_choice {choice!r} needs tools; give tools or leave tool_choice unset", "tool_choice"
            )
        from ember.structured.tool_calls import tool_call_structural_tag

        try:
            tag = tool_call_structural_tag(
                tools,
                choice,
                req.parallel_tool_calls is not False,
                model_format=self.s.tool_parser.parser.XGRAMMAR_FORMAT,
            )
            return {"structural_tag": tag}
        except InvalidRequestError as e:
            raise ParamError(str(e), "tool_choice") from None

    def _prompt(self, req: ChatCompletionRequest) -> tuple[list[int], list[dict] | None, dict | None]:
        """(prompt token ids, the tools whose calls are parsed from the output (None: no parsing), the
        tool-call constraint)."""
        use_tools = bool(req.tools) and req.tool_choice != "none"
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if use_tools else None
        constraint = self._tool_constraint(req, tools)
        messages = [_message_dict(m) for m in req.messages]
        ids = self.s.tokenizer.apply_chat_template(
            messages,
            add_generation_prompt=req.add_generation_prompt,
            tokenize=True,
            tools=tools,
            chat_template=self.s.config.chat_template,
            continue_final_message=req.continue_final_message,
            **self.s.template_kwargs(req.chat_template_kwargs, req.reasoning_effort),
        )
        if tools and not self.s.template_shows_tools:
            self.s.tools_unseen()
        return ids, tools, constraint

    async def create(self, req: ChatCompletionRequest, receive):
        streams, ctx = await self.submit(req)
        if req.stream:
            return self._stream(streams, ctx)
        return await unless_disconnected(self.whole(streams, ctx), receive)

    async def create_batch(self, req: BatchChatCompletionRequest, receive) -> dict:
        """vLLM's /v1/chat/completions/batch: one whole answer for several conversations, choice i (with n > 1:
        i*n + j) answering conversation i; usage summed. A bad conversation fails the batch and aborts the rest."""
        if req.stream:
            raise ParamError(
                "the batch endpoint answers whole; stream each conversation from /v1/chat/completions", "stream"
            )
        shared = req.model_dump(exclude={"messages"}, exclude_unset=True)
        subs = [ChatCompletionRequest.model_validate({**shared, "messages": conv}) for conv in req.messages]

        async def answer(sub: ChatCompletionRequest) -> dict:
            return await self.whole(*await self.submit(sub))

        answers = await unless_disconnected(all_or_none([answer(sub) for sub in subs]), receive)
        merged_answer = dict(answers[0])
        merged_answer["choices"] = [
            {**c, "index": i * req.n + c["index"]} for i, a in enumerate(answers) for c in a["choices"]
        ]
        merged_answer["usage"] = self.s.usage(
            sum(a["usage"]["prompt_tokens"] for a in answers),
            sum(a["usage"]["completion_tokens"] for a in answers),
            sum((a["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0) for a in answers),
        )
        for key in ("prompt_token_ids", "prompt_logprobs"):  # one per conversation
            merged_answer[key] = [a[key] for a in answers] if answers[0][key] is not None else None
        return merged_answer

    async def submit(
        self, req: ChatCompletionRequest, fit_max_tokens: bool = False
    ) -> tuple[list[RequestStream], _Ctx]:
        """Start the engine work of req: (its streams, the context the answer is written from), for
        whole() or a stream (SSE here, chunk_dicts for the API translations). With fit_max_tokens a
        max_tokens beyond what the context holds after the prompt means "to the context's end" instead of
        a 400 (Anthropic clients send their Claude model's output limit: Claude Code 32000 and more)."""
        model = self.s.check_model(req.model)
        self.s.check_unsupported(req)
        if req.top_logprobs is not None and not req.logprobs:
            raise ParamError("top_logprobs needs logprobs to be true", "top_logprobs")
        ids, tools, tool_constraint = self._prompt(req)
        ids = self.s.truncate(ids, req)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        if fit_max_tokens and max_tokens is not None and len(ids) + max_tokens > self.s.max_model_len:
            logger.info(
                "max_tokens %d does not fit in the context after the %d-token prompt; generating up to the "
                "context's end",
                max_tokens,
                len(ids),
            )
            max_tokens = None
        top_n = self.s.top_n(req.top_logprobs or 0) if req.logprobs else None
        structured = structured_params(req, tool_constraint, self.s.engine.structured.holds)
        params = self.s.sampling_params(req, len(ids), max_tokens, top_n, structured)
        rid = request_id("chatcmpl")
        arrival = time.monotonic()
        streams = await self.s.submit(rid, [(None, ids)], params)
        parser = self.s.reasoning_parser
        tail = self.s.tokenizer.decode(ids[-PROMPT_TAIL_TOKENS:], skip_special_tokens=False) if parser else ""
        ctx = _Ctx(rid, model, now(), req, len(ids), tools, top_n, arrival, tail, _echo_text(req))
        ctx.prompt_ids = ids
        return streams, ctx

    # -- whole answer -------------------------------------------------------------------------
    async def whole(self, streams, ctx: _Ctx) -> dict:
        got = await _gather(streams, ctx.req.n)
        ctx.cached = got.cached
        choices = [self._whole_choice(ctx, i, got) for i in range(ctx.req.n)]
        completion = sum(len(t) for t in got.tokens)
        self._log(ctx, completion, got.finish)
        prompt_lps = vllm_prompt_logprobs(got.prompt_lps) if ctx.req.prompt_logprobs is not None else None
        return {
            "id": ctx.rid,
            "object": "chat.completion",
            "created": ctx.created,
            "model": ctx.model,
            "choices": choices,
            "usage": self.s.usage(ctx.prompt_len, completion, got.cached),
            "system_fingerprint": None,
            "service_tier": None,
            "metadata": None,
            "moderation": None,
            "prompt_token_ids": ctx.prompt_ids if ctx.req.return_token_ids else None,
            "prompt_logprobs": prompt_lps,
        }

    def _whole_choice(self, ctx: _Ctx, i: int, got: _Gathered) -> dict:
        message, reason = self._whole_message(ctx, "".join(got.texts[i]), got.finish[i])
        choice = {
            "index": i,
            "message": message,
            "logprobs": None,
            "finish_reason": reason,
            "stop_reason": got.stop_reason[i],
            "token_ids": got.tokens[i] if ctx.req.return_token_ids else None,
        }
        if ctx.top_n is not None:
            names = self.s.token_text_for(ctx.req)
            choice["logprobs"] = {"content": chat_logprobs(got.tokens[i], got.lps[i], ctx.top_n, names)}
        return choice

    def _whole_message(self, ctx: _Ctx, text: str, reason: str | None) -> tuple[dict[str, Any], str | None]:
        """(the assistant message for one sequence's whole text, its finish reason): reasoning split off,
        tool calls parsed (a stop after calls finishes as tool_calls), the echo in front."""
        # every field of OpenAI's message, as vLLM answers (clients compare whole dumps); tool_calls [] when none
        message: dict[str, Any] = {
            "role": "assistant",
            "content": text,
            "refusal": None,
            "annotations": None,
            "audio": None,
            "function_call": None,
            "tool_calls": [],
        }
        splitter = self._splitter(ctx)
        if splitter is not None:
            splitter.feed(text)
            splitter.finish()
            text = splitter.content
            message["content"] = text or None
            if ctx.req.include_reasoning:
                message.update(reasoning_fields(splitter.reasoning or None))
        if ctx.use_tools:
            reason = _take_tool_calls(message, text, reason, self._tool_parser(ctx))
        if ctx.echo:
            message["content"] = ctx.echo + (message["content"] or "")
        return message, reason

    # -- streaming ----------------------------------------------------------------------------
    async def _stream(self, streams, ctx: _Ctx) -> AsyncIterator[str]:
        include_usage, continuous = self.s.usage_options(ctx.req)
        chunk, usage_chunk = sse_writers(self._chunk_head(ctx), include_usage)
        try:
            async for line in self._chunks(streams, ctx, chunk, usage_chunk, include_usage, continuous):
                yield line
        except Exception:  # noqa: BLE001 -- headers are sent: report in-band, never a traceback
            logger.exception("chat stream %s failed", ctx.rid)
            yield STREAM_ERROR
        yield "data: [DONE]\n\n"

    def chunk_dicts(self, streams, ctx: _Ctx) -> AsyncIterator[dict]:
        """The streamed answer's chunks as dicts, the last one carrying the usage, for the API
        translations over this path (ember.server.anthropic, ember.server.responses); a failure is
        raised to the caller, which reports it in its own protocol. ctx.cached holds the prefix-cache
        hit once the second chunk has been read (the first, the role, goes out before the engine is read)."""
        head = self._chunk_head(ctx)

        def chunk(choices: list, usage_now: dict | None = None, extra: dict | None = None) -> dict:
            return {**head, **(extra or {}), "choices": choices, "usage": usage_now}

        def usage_chunk(u: dict) -> dict:
            return {**head, "choices": [], "usage": u}

        return self._chunks(streams, ctx, chunk, usage_chunk, True, False)

    @staticmethod
    def _chunk_head(ctx: _Ctx) -> dict:
        return {"id": ctx.rid, "object": "chat.completion.chunk", "created": ctx.created, "model": ctx.model}

    async def _chunks(self, streams, ctx: _Ctx, chunk, usage_chunk, include_usage: bool, continuous: bool):
        """The answer's chunks, each written by chunk(choices, usage so far, extra top-level fields),
        the final usage by usage_chunk; the engine work is aborted however this ends."""
        req = ctx.req
        choices = [
            _StreamedChoice(
                self._splitter(ctx), self._tool_parser(ctx) if ctx.use_tools else None, req.include_reasoning
            )
            for _ in range(req.n)
        ]
        completion = 0

        def so_far() -> dict | None:
            return self.s.usage(ctx.prompt_len, completion, ctx.cached) if continuous else None

        try:
            for i in range(req.n):  # one choice per chunk, as OpenAI streams n > 1 (clients read choices[0])
                first = {"prompt_token_ids": ctx.prompt_ids} if req.return_token_ids and i == 0 else None
                yield chunk(
                    [
                        {
                            "index": i,
                            "delta": {"role": "assistant", "content": ctx.echo},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                    ],
                    so_far(),
                    first,
                )
            async for _, delta in merged(streams):
                ctx.cached = delta.num_cached_tokens
                completion += sum(len(sd.token_ids) for sd in delta.seqs)
                # the whole delta is counted before its chunks go out: each carries the usage after it
                out = [self._stream_choice(ctx, choices[sd.index], sd) for sd in delta.seqs]
                for choice in out:
                    if choice is not None:
                        yield chunk([choice], so_far())
            if include_usage:
                yield usage_chunk(self.s.usage(ctx.prompt_len, completion, ctx.cached))
            self._log(ctx, completion, [c.finish for c in choices])
        finally:
            for s in streams:
                s.abort()

    def _stream_choice(self, ctx: _Ctx, streamed: _StreamedChoice, sd) -> dict | None:
        """The chunk choice for one sequence's new output, or None when there is nothing to send yet."""
        req = ctx.req
        d, reason = streamed.delta(sd.text, sd.finish_reason)
        lp = None
        if ctx.top_n is not None and sd.token_ids:
            names = self.s.token_text_for(req)
            lp = {"content": chat_logprobs(sd.token_ids, sd.logprobs, ctx.top_n, names)}
        # a token whose text is held back (part of a character) still goes out when ids are asked for
        if not d and lp is None and reason is None and not (req.return_token_ids and sd.token_ids):
            return None
        choice = {"index": sd.index, "delta": d, "logprobs": lp, "finish_reason": reason}
        if req.return_token_ids:
            choice["token_ids"] = sd.token_ids
        if reason is not None:
            streamed.finish = reason
            choice["stop_reason"] = sd.stop_reason
        return choice

    def _splitter(self, ctx: _Ctx) -> ReasoningSplitter | None:
        parser = self.s.reasoning_parser
        if not parser:
            return None
        # with tools, a call the model opens before </think> ends its reasoning (Qwen3.5 does that)
        ends = self.s.tool_parser.parser.ENDS_REASONING if ctx.use_tools else ()
        return ReasoningSplitter(parser, ctx.prompt_tail, ends)

    def _tool_parser(self, ctx: _Ctx) -> TaggedToolParser:
        """A fresh parser of the server's tool-call format for one sequence of this request."""
        return self.s.tool_parser.parser(ctx.tools)

    def _log(self, ctx: _Ctx, completion: int, finish) -> None:
        if self.s.config.log_requests:
            logger.info(
                "%s: %d prompt + %d completion tokens in %.2fs, finish %s",
                ctx.rid,
                ctx.prompt_len,
                completion,
                time.monotonic() - ctx.arrival,
                ",".join(str(f) for f in finish),
            )


class _Gathered:
    """A whole answer's n sequences as the engine streamed them, joined up."""

    def __init__(self, n: int):
        self.texts: list[list[str]] = [[] for _ in range(n)]
        self.tokens: list[list[int]] = [[] for _ in range(n)]
        self.lps: list[list] = [[] for _ in range(n)]
        self.finish: list[str | None] = [None] * n
        self.stop_reason: list[Any] = [None] * n
        self.cached = 0
        self.prompt_lps = None

    def add(self, delta) -> None:
        self.cached = delta.num_cached_tokens
        if delta.prompt_logprobs is not None:
            self.prompt_lps = delta.prompt_logprobs
        for sd in delta.seqs:
            self.texts[sd.index].append(sd.text)
            self.tokens[sd.index].extend(sd.token_ids)
            if sd.logprobs is not None:
                self.lps[sd.index].extend(sd.logprobs)
            if sd.finish_reason is not None:
                self.finish[sd.index], self.stop_reason[sd.index] = sd.finish_reason, sd.stop_reason


async def _gather(streams: list[RequestStream], n: int) -> _Gathered:
    """Every delta of the request's streams; the engine work is aborted however this ends (a client gone,
    an error), a no-op once it has finished."""
    got = _Gathered(n)
    try:
        async for _, delta in merged(streams):
            got.add(delta)
    finally:
        for s in streams:
            s.abort()
    return got


def reasoning_fields(text: str | None) -> dict[str, str | None]:
    """The reasoning under both names clients read: reasoning_content (DeepSeek's, vLLM's first) and
    reasoning (vLLM's newer one)."""
    return {"reasoning_content": text, "reasoning": text}


def _take_tool_calls(message: dict[str, Any], text: str, reason: str | None, parser: TaggedToolParser) -> str | None:
    """Move the tool calls written in a whole answer's text into message (content: the text around them,
    None when blank); returns the finish reason, tool_calls for a stop that ended on calls. parser: a
    fresh one, fed the whole text as a stream's would be fed in pieces, so both answers agree."""
    parser.feed(text)
    parser.finish()
    if not parser.calls:
        return reason
    message["content"] = parser.content if parser.content.strip() else None
    message["tool_calls"] = [
        {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in parser.calls
    ]
    return "tool_calls" if reason == "stop" else reason


class _StreamedChoice:
    """One choice of a streamed answer. Its reasoning splitter and tool-call parser (either may be None)
    hold back text across deltas, since a tag can arrive in pieces; finish: the reason it ended with."""

    def __init__(self, splitter: ReasoningSplitter | None, parser: TaggedToolParser | None, include_reasoning: bool):
        self.splitter = splitter
        self.parser = parser
        self.include_reasoning = include_reasoning
        self.finish: str | None = None

    def delta(self, text: str, reason: str | None) -> tuple[dict[str, Any], str | None]:
        """(the delta fields for this piece of output, the finish reason). A reason marks the last piece:
        what the splitter and parser still hold goes out with it."""
        d: dict[str, Any] = {}
        if self.splitter is not None:
            thought, text = self.splitter.feed(text)
            if reason is not None:
                more_thought, more_text = self.splitter.finish()
                thought, text = thought + more_thought, text + more_text
            if thought and self.include_reasoning:
                d.update(reasoning_fields(thought))
        if self.parser is None:
            if text:
                d["content"] = text
            return d, reason
        return d, self._tool_call_delta(d, text, reason)

    def _tool_call_delta(self, d: dict[str, Any], text: str, reason: str | None) -> str | None:
        """Content and tool-call pieces parsed from text into d; the finish reason, tool_calls for a stop
        that ended on calls."""
        parsed = self.parser.feed(text)
        if reason is not None:
            parsed.extend(self.parser.finish())
            if self.parser.calls and reason == "stop":
                reason = "tool_calls"
        if parsed.content:
            d["content"] = parsed.content
        if parsed.tool_calls:
            d["tool_calls"] = parsed.tool_calls
        return reason


def _echo_text(req: ChatCompletionRequest) -> str:
    """vLLM's chat echo: the last message's text leads the answer when it has the answer's role."""
    last = req.messages[-1]
    if not req.echo or last.role != "assistant":
        return ""
    if isinstance(last.content, list):
        return "".join(p.text or "" for p in last.content)
    return last.content or ""


class _Ctx:
    __slots__ = (
        "rid",
        "model",
        "created",
        "req",
        "prompt_len",
        "tools",
        "top_n",
        "arrival",
        "prompt_tail",
        "echo",
        "prompt_ids",
        "cached",
    )

    def __init__(self, rid, model, created, req, prompt_len, tools, top_n, arrival, prompt_tail="", echo=""):
        self.rid, self.model, self.created, self.req = rid, model, created, req
        self.prompt_len, self.tools, self.top_n, self.arrival = prompt_len, tools, top_n, arrival
        self.prompt_tail = prompt_tail  # the prompt's last tokens as text: did the template open <think>?
        self.echo = echo  # text the answer starts with (echo of the last assistant message)
        self.prompt_ids: list[int] = []
        self.cached = 0  # prompt tokens the prefix cache held (known once the answer has begun)

    @property
    def use_tools(self) -> bool:
        """Whether tool calls are parsed from the output (the request has tools, tool_choice is not none)."""
        return self.tools is not None
