"""What the chat and completions endpoints share: server settings, errors with an HTTP status,
request -> SamplingParams (with vLLM's context-length check), submitting prompts to the async
engine, and noticing a client that went away."""

from __future__ import annotations

import asyncio
import json
import logging
import re
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from fastapi.responses import JSONResponse, Response, StreamingResponse

from ember.engine.admission import out_of_vocabulary
from ember.engine.async_engine import AsyncLLMEngine, RequestDelta, RequestStream
from ember.errors import InvalidRequestError, ModelNotFoundError, ParamError
from ember.sampling import SamplingParams
from ember.server.logprobs import TokenText
from ember.server.protocol import ChatCompletionRequest, CompletionRequest, usage
from ember.server.reasoning_choice import ReasoningParserChoice, resolve_reasoning_parser
from ember.server.reasoning_effort import template_kwargs
from ember.server.tool_parsers import AUTO, ToolParserChoice, resolve_tool_parser
from ember.structured_params import StructuredOutputsParams

logger = logging.getLogger("ember.server")


@dataclass
class ServerConfig:
    served_model_names: list[str]
    model_root: str = ""
    api_key: str | None = None
    chat_template: str | None = None  # a template string (the flag also takes a file; read by the launcher)
    log_requests: bool = True
    root_path: str = ""  # a proxy's path prefix (--root-path): routes answer with and without it
    enable_request_id_headers: bool = False  # vLLM's flag: X-Request-Id on every response
    return_tokens_as_token_ids: bool = False  # vLLM's flag: the default of the request field of that name
    enable_force_include_usage: bool = False  # vLLM's flag: every stream reports usage, on every chunk
    enable_tokenizer_info_endpoint: bool = False  # vLLM's flag: GET /tokenizer_info
    enable_prompt_tokens_details: bool = False  # vLLM's flag: usage.prompt_tokens_details (cached tokens)
    tool_call_parser: str = AUTO  # --tool-call-parser: a name in ember.server.tool_parsers, or auto (the template's)
    # CORS (vLLM's flags): no cross-origin access unless origins are given
    allowed_origins: list[str] = field(default_factory=list)
    allowed_methods: list[str] = field(default_factory=lambda: ["*"])
    allowed_headers: list[str] = field(default_factory=lambda: ["*"])
    allow_credentials: bool = False
    # defaults for the sampling fields a request leaves unset (--generation-config: ember.server.sampling_defaults)
    sampling_defaults: dict[str, Any] = field(default_factory=dict)


# vLLM request fields that would change the answer and ember does not implement: a 400 naming each
# (other unknown fields are ignored with a log line, as vLLM does)
REFUSED_FIELDS = {
    "use_beam_search": "ember samples (or decodes greedily); it has no beam search",
    "allowed_token_ids": "use logit_bias, or structured_outputs to hold the answer to a set of strings",
    "bad_words": "use logit_bias with -100 for the words' tokens",
    "prompt_embeds": "ember takes text or token ids, not embeddings",
    "logits_processors": "ember runs no custom logits processors",
    "priority": "ember schedules first come, first served",
}

_SAMPLING_PARAM = re.compile(r"^SamplingParams\.(\w+)=")


def sampling_error(e: InvalidRequestError) -> ParamError:
    """SamplingParams says `SamplingParams.top_p=2 is invalid: ...`; a client wants `top_p`."""
    msg = str(e)
    m = _SAMPLING_PARAM.match(msg)
    if m is None:
        return ParamError(msg)
    return ParamError(msg.removeprefix("SamplingParams."), m.group(1))


class Serving:
    """State shared by the endpoints of one app."""

    def __init__(self, engine: AsyncLLMEngine, config: ServerConfig):
        self.engine = engine
        self.config = config
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self.server_load = 0  # generation requests in flight, counted by the app's middleware (GET /load)
        self.draining = False  # a shutdown began (ember.entrypoints.serve.DrainingServer): refuse new work
        self.token_text = TokenText(self.tokenizer)
        self.token_ids_text = TokenText(self.tokenizer, as_ids=True)
        self.tool_parser: ToolParserChoice = resolve_tool_parser(
            config.tool_call_parser, config.chat_template or self.tokenizer.chat_template
        )
        logger.info("tool calls: %s parser (%s)", self.tool_parser.name, self.tool_parser.reason)
        self.reasoning: ReasoningParserChoice = resolve_reasoning_parser(
            engine.reasoning_parser, self.tokenizer, config.chat_template
        )
        if self.reasoning.name != engine.reasoning_parser:  # chosen here: the engine's grammars start where it says
            engine.structured.reasoning_parser = self.reasoning.name
        logger.info("reasoning: %s parser (%s)", self.reasoning.name or "no", self.reasoning.reason)
        # a template that never reads `tools` renders a request's tools nowhere: said once, at the first such request
        self.template_shows_tools = "tools" in (config.chat_template or self.tokenizer.chat_template or "")
        self._told_tools_unseen = False

    def tools_unseen(self) -> None:
        """A request came with tools the chat template does not show the model (the default model's has no
        place for them): agent clients send tools and get answers that ignore them, so the log says why once."""
        if not self._told_tools_unseen:
            self._told_tools_unseen = True
            logger.warning(
                "a request's tools are not in its prompt: the chat template has no place for tools, so the model "
                "does not see them (only a forced tool_choice makes it call one); serve a template that renders "
                "tools (--chat-template) to let the model choose them"
            )

    @property
    def reasoning_parser(self) -> str | None:
        return self.reasoning.name

    def chat_template_source(self, chat_template: str | None = None) -> str:
        """The source of the template a request renders with: chat_template (a template, or the name of one
        of the model's), else --chat-template, else the model's."""
        chosen = chat_template or self.config.chat_template
        if chosen is None:
            return self.tokenizer.chat_template or ""
        return self.tokenizer.chat_templates.get(chosen, chosen)

    def template_kwargs(
        self, chat_template_kwargs: dict | None, reasoning_effort: str | None, chat_template: str | None = None
    ) -> dict:
        """A request's template variables: its chat_template_kwargs and its top-level reasoning_effort fitted to
        the template (ember.server.reasoning_effort: explicit chat_template_kwargs win)."""
        return template_kwargs(self.chat_template_source(chat_template), chat_template_kwargs, reasoning_effort)

    @property
    def model_name(self) -> str:
        return self.config.served_model_names[0]

    def check_model(self, name: str | None) -> str:
        if name is None or name in self.config.served_model_names:
            return self.model_name if name is None else name
        raise ModelNotFoundError(
            f"The model `{name}` does not exist; this server serves "
            f"{', '.join(repr(n) for n in self.config.served_model_names)} (see /v1/models)"
        )

    def token_text_for(self, req) -> TokenText:
        """How logprobs name tokens: their text, or `token_id:N` (vLLM's return_tokens_as_token_ids)."""
        as_ids = req.return_tokens_as_token_ids
        if as_ids is None:
            as_ids = self.config.return_tokens_as_token_ids
        return self.token_ids_text if as_ids else self.token_text

    def usage_options(self, req) -> tuple[bool, bool]:
        """(a final usage chunk, usage on every chunk) for a streamed answer."""
        if self.config.enable_force_include_usage:
            return True, True
        opts = req.stream_options
        include = bool(opts and opts.include_usage)
        return include, include and bool(opts.continuous_usage_stats)

    def check_unsupported(self, req: ChatCompletionRequest | CompletionRequest) -> None:
        if req.best_of is not None and req.best_of != req.n:
            raise ParamError(f"best_of={req.best_of} is not supported (only best_of == n); leave it unset", "best_of")
        if req.stream_options is not None and not req.stream:
            raise ParamError("stream_options can only be given when stream is true", "stream_options")
        extra = req.model_extra or {}
        for name, instead in REFUSED_FIELDS.items():
            if extra.get(name) not in (None, False, 0, [], {}):
                raise ParamError(f"{name} is not supported by ember: {instead}", name)
        ignored = req.ignored_fields()
        if ignored:
            logger.warning("request fields ignored (not known to ember): %s", ", ".join(ignored))

    def sampling_params(
        self,
        req,
        prompt_len: int,
        max_tokens: int | None,
        logprobs: int | None,
        structured: StructuredOutputsParams | None = None,
    ) -> SamplingParams:
        """Validated SamplingParams; refuses a prompt (plus max_tokens) that does not fit max_model_len."""
        m = self.max_model_len
        if prompt_len >= m:
            raise ParamError(
                f"This model's maximum context length is {m} tokens, but the prompt has {prompt_len} "
                f"tokens (prompt plus at least one generated token must fit); shorten the prompt",
                "messages" if isinstance(req, ChatCompletionRequest) else "prompt",
            )
        if max_tokens is not None and prompt_len + max_tokens > m:
            raise ParamError(
                f"This model's maximum context length is {m} tokens. However, you requested {prompt_len + max_tokens} "
                f"tokens ({prompt_len} in the prompt, {max_tokens} in the completion). Please reduce the length of the "
                f"prompt or max_tokens.",
                "max_tokens",
            )
        defaults = self.config.sampling_defaults
        if max_tokens is None:
            max_tokens = min(defaults.get("max_new_tokens", m), m - prompt_len)
        kw: dict[str, Any] = dict(
            n=req.n,
            presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            seed=req.seed,
            stop=req.stop,
            max_tokens=max_tokens,
            min_tokens=req.min_tokens,
            ignore_eos=req.ignore_eos,
            stop_token_ids=req.stop_token_ids,
            include_stop_str_in_output=req.include_stop_str_in_output,
            skip_special_tokens=req.skip_special_tokens,
            logprobs=logprobs,
            structured_outputs=structured,
            logit_bias=self._logit_bias(req),
            prompt_logprobs=self._prompt_logprobs(req, logprobs),
        )
        for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
            v = getattr(req, name)
            if v is None:
                v = defaults.get(name)
            if v is not None:
                kw[name] = v
        if logprobs is not None:
            self._check_logprobs(logprobs, "top_logprobs" if isinstance(req, ChatCompletionRequest) else "logprobs")
        try:
            return SamplingParams(**kw)
        except InvalidRequestError as e:
            raise sampling_error(e) from None

    def top_n(self, n: int) -> int:
        """A request's top-logprobs count, -1 (the whole vocabulary) resolved."""
        return self.engine.vocab_size if n == -1 else n

    def _prompt_logprobs(self, req, logprobs: int | None) -> int | None:
        """vLLM's prompt_logprobs; a completion's echo with logprobs needs them for the echoed tokens."""
        n = req.prompt_logprobs
        if n is not None:
            self._check_logprobs(n, "prompt_logprobs")
            n = self.top_n(n)
        if getattr(req, "echo", False) and isinstance(req, CompletionRequest) and logprobs is not None:
            n = max(n or 0, logprobs)
        return n

    def _check_logprobs(self, n: int, param: str) -> None:
        vocab = self.engine.vocab_size
        cap = self.engine.max_logprobs
        asked = vocab if n == -1 else n
        if cap != -1 and asked > cap:
            raise ParamError(
                f"{param}={n} asks for {asked} logprobs per token, more than this server's --max-logprobs "
                f"{cap}; ask for at most {cap}",
                param,
            )

    def _logit_bias(self, req) -> dict[int, float] | None:
        if not req.logit_bias:
            return None
        vocab = self.engine.vocab_size
        bias = {}
        for key, value in req.logit_bias.items():
            try:
                tid = int(key)
            except ValueError:
                raise ParamError(f"logit_bias key {key!r} is not a token id", "logit_bias") from None
            if message := out_of_vocabulary("logit_bias token id", [tid], vocab):
                raise ParamError(message, "logit_bias")
            bias[tid] = value
        return bias

    def truncate(self, ids: list[int], req) -> list[int]:
        """vLLM's truncate_prompt_tokens: keep the prompt's last k tokens (-1: the model's length)."""
        k = req.truncate_prompt_tokens
        if k is None:
            return ids
        if k == -1:
            k = self.max_model_len
        if not 1 <= k <= self.max_model_len:
            raise ParamError(
                f"truncate_prompt_tokens must be -1 or 1..{self.max_model_len} (max_model_len); got {k}",
                "truncate_prompt_tokens",
            )
        return ids[-k:]

    def usage(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
        """An answer's usage; the prefix-cache hit as prompt_tokens_details.cached_tokens only under
        --enable-prompt-tokens-details (vLLM's rule: clients compare usage objects whole)."""
        return usage(
            prompt_tokens, completion_tokens, cached_tokens if self.config.enable_prompt_tokens_details else None
        )

    def check_token_ids(self, ids: list[int], param: str) -> None:
        vocab = self.engine.vocab_size
        if message := out_of_vocabulary("token id", ids, vocab):
            raise ParamError(message, param)
        if not ids:
            raise ParamError("the prompt is empty; give at least one token", param)

    async def submit(
        self, request_id: str, prompts: list[tuple[str | None, list[int]]], params: SamplingParams
    ) -> list[RequestStream]:
        """Add every prompt as an engine request (ids request_id-i); all or none."""
        streams: list[RequestStream] = []
        try:
            for i, (text, ids) in enumerate(prompts):
                rid = request_id if len(prompts) == 1 else f"{request_id}-{i}"
                prompt = {"prompt_token_ids": ids} if text is None else {"prompt_token_ids": ids, "prompt": text}
                streams.append(await self.engine.add_request(rid, prompt, params))
        except BaseException:
            for s in streams:
                s.abort()
            raise
        return streams


async def merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestDelta]]:
    """(prompt index, delta) from several streams, as they come."""
    if len(streams) == 1:
        async for d in streams[0]:
            yield 0, d
        return
    q: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, s: RequestStream) -> None:
        try:
            async for d in s:
                q.put_nowait((i, d))
        except BaseException as e:  # noqa: BLE001 -- re-raised by the consumer
            q.put_nowait((i, e))
        finally:
            q.put_nowait((i, done))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(tasks)
        while left:
            i, item = await q.get()
            if item is done:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


async def wait_for_disconnect(receive) -> None:
    """Returns when the client has gone (after the body was read, receive() only answers that)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


# What a stream says when it fails after its headers went out (status 200 sent): an error event, then
# [DONE]; the details go to the server log, never to the client.
STREAM_ERROR = (
    "data: "
    + json.dumps(
        {
            "error": {
                "message": "internal error while streaming; see the server log",
                "type": "server_error",
                "param": None,
                "code": 500,
            }
        }
    )
    + "\n\n"
)


def sse_writers(head: dict, include_usage: bool):
    """(chunk(choices) -> SSE line, usage_chunk(usage) -> SSE line) for one streamed response.

    The fixed head (id, object, created, model) is serialised once per response, not per chunk.
    """
    bare = json.dumps(head, separators=(",", ":"))[:-1] + ',"choices":'
    prefix = bare[: -len('"choices":')] + '"usage":null,"choices":' if include_usage else bare

    with_usage = bare[: -len('"choices":')]

    def chunk(choices: list, usage_now: dict | None = None, extra: dict | None = None) -> str:
        """usage_now: the usage so far, on every chunk (stream_options.continuous_usage_stats);
        extra: top-level fields of this chunk only (the first chunk's prompt_token_ids)."""
        if extra:
            body = {**head, **extra, "choices": choices}
            if include_usage:
                body["usage"] = usage_now
            return "data: " + json.dumps(body, separators=(",", ":")) + "\n\n"
        if usage_now is not None:
            return (
                "data: "
                + with_usage
                + '"usage":'
                + json.dumps(usage_now, separators=(",", ":"))
                + ',"choices":'
                + json.dumps(choices, separators=(",", ":"))
                + "}\n\n"
            )
        return "data: " + prefix + json.dumps(choices, separators=(",", ":")) + "}\n\n"

    def usage_chunk(u: dict) -> str:
        return "data: " + bare + '[],"usage":' + json.dumps(u, separators=(",", ":")) + "}\n\n"

    return chunk, usage_chunk


class ClientDisconnected(Exception):
    pass


async def http_answer(create):
    """A generation route's answer (OpenAI's, Anthropic's, the Responses API's): JSON for a whole
    answer, SSE for a stream; 499 when the client left first (its work is aborted)."""
    try:
        result = await create
    except ClientDisconnected:
        return Response(status_code=499)
    if isinstance(result, dict):
        return JSONResponse(result)
    return StreamingResponse(
        result, media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    )


async def all_or_none(coros: list) -> list:
    """Await coroutines together; the first failure cancels the others (their finally blocks abort their
    engine work) and is raised. (asyncio.gather would leave them running.)"""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for t in tasks:
            if t.done() and not t.cancelled() and t.exception() is not None:
                raise t.exception()
        return [t.result() for t in tasks]
    finally:
        for t in tasks:
            if not t.done():
                t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def unless_disconnected(coro, receive):
    """Run coro; if the client goes away first, cancel it (its finally blocks abort the engine work)."""
    task = asyncio.ensure_future(coro)
    watch = asyncio.ensure_future(wait_for_disconnect(receive))
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        task.cancel()
        try:
            await task
        except BaseException:  # noqa: BLE001 -- it is being cancelled on purpose
            pass
        raise ClientDisconnected()
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
