"""POST /v1/completions: a prompt as a string, a list of strings, token ids or lists of token ids;
each prompt is one engine request with n sequences (choice index = prompt index * n + i)."""

from __future__ import annotations

import logging
import time
from typing import Any, AsyncIterator

from ember.errors import ParamError
from ember.server.logprobs import CompletionLogprobs
from ember.server.protocol import CompletionRequest, now, request_id
from ember.server.serving import STREAM_ERROR, Serving, merged, sse_writers, unless_disconnected
from ember.server.structured import structured_params

logger = logging.getLogger("ember.server")


def _joined(a: dict, b: dict) -> dict:
    return {key: a[key] + b[key] for key in a}


def vllm_prompt_logprobs(positions: list | None) -> list | None:
    """vLLM's prompt_logprobs field: None for the first token, then {token id: {logprob, rank, decoded_token}}."""
    if positions is None:
        return None
    return [
        None
        if pos is None
        else {
            str(tid): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
            for tid, lp in pos.items()
        }
        for pos in positions
    ]


class CompletionHandler:
    def __init__(self, serving: Serving):
        self.s = serving

    def _prompts(self, req: CompletionRequest) -> list[tuple[str | None, list[int]]]:
        p = req.prompt
        if isinstance(p, str):
            items: list = [p]
        elif p and all(isinstance(t, int) for t in p):
            items = [p]
        else:
            items = list(p)
        if not items:
            raise ParamError("prompt is empty; give a string, a list of strings or token ids", "prompt")
        out = []
        for item in items:
            if isinstance(item, str):
                ids = self.s.tokenizer.encode(item)
                if not ids:
                    raise ParamError("a prompt encodes to no tokens; give a non-empty prompt", "prompt")
                out.append((item, ids))
            else:
                ids = list(item)
                self.s.check_token_ids(ids, "prompt")
                out.append((None, ids))
        if req.truncate_prompt_tokens is not None:
            cut = [(text, self.s.truncate(ids, req), ids) for text, ids in out]
            # a cut prompt has no text of its own: echo decodes the tokens it kept
            out = [(text if len(kept) == len(ids) else None, kept) for text, kept, ids in cut]
        return out

    async def create(self, req: CompletionRequest, receive):
        model = self.s.check_model(req.model)
        self.s.check_unsupported(req)
        if req.suffix is not None:
            raise ParamError("suffix (fill-in-the-middle) is not supported by ember; leave it unset", "suffix")
        prompts = self._prompts(req)
        structured = structured_params(req, built=self.s.engine.structured.holds)
        if req.logprobs is not None:
            req.logprobs = self.s.top_n(req.logprobs)
        params = [self.s.sampling_params(req, len(ids), req.max_tokens, req.logprobs, structured) for _, ids in prompts]
        # every prompt gets the same knobs; max_tokens None means "the rest of the context" per prompt
        rid = request_id("cmpl")
        arrival = time.monotonic()
        streams = []
        try:
            for i, ((text, ids), p) in enumerate(zip(prompts, params)):
                streams += await self.s.submit(rid if len(prompts) == 1 else f"{rid}-{i}", [(text, ids)], p)
        except BaseException:
            for s in streams:
                s.abort()
            raise
        ctx = dict(rid=rid, model=model, created=now(), req=req, prompts=prompts, arrival=arrival)
        if req.stream:
            return self._stream(streams, ctx)
        return await unless_disconnected(self._whole(streams, ctx), receive)

    def _echo(self, text: str | None, ids: list[int]) -> str:
        return text if text is not None else self.s.tokenizer.decode(ids, skip_special_tokens=False)

    async def _whole(self, streams, ctx) -> dict:
        req, prompts, n = ctx["req"], ctx["prompts"], ctx["req"].n
        total = len(prompts) * n
        texts = [[] for _ in range(total)]
        tokens = [[] for _ in range(total)]
        lps: list[list] = [[] for _ in range(total)]
        finish: list[str | None] = [None] * total
        stop_reason: list[Any] = [None] * total
        cached = [0] * len(prompts)
        prompt_lps: list = [None] * len(prompts)
        try:
            async for pi, delta in merged(streams):
                cached[pi] = delta.num_cached_tokens
                if delta.prompt_logprobs is not None:
                    prompt_lps[pi] = delta.prompt_logprobs
                for sd in delta.seqs:
                    k = pi * n + sd.index
                    texts[k].append(sd.text)
                    tokens[k].extend(sd.token_ids)
                    if sd.logprobs is not None:
                        lps[k].extend(sd.logprobs)
                    if sd.finish_reason is not None:
                        finish[k], stop_reason[k] = sd.finish_reason, sd.stop_reason
        finally:
            for s in streams:
                s.abort()
        choices = []
        for k in range(total):
            text = "".join(texts[k])
            prefix = self._echo(*prompts[k // n]) if req.echo else ""
            lp = None
            if req.logprobs is not None:
                names = self.s.token_text_for(req)
                lp = CompletionLogprobs(req.logprobs, names, len(prefix)).build(tokens[k], lps[k])
                if req.echo:  # the echoed prompt's tokens first (the first has no logprob)
                    lp = _joined(
                        CompletionLogprobs(req.logprobs, names).build(prompts[k // n][1], prompt_lps[k // n]), lp
                    )
            choices.append(
                {
                    "index": k,
                    "text": prefix + text,
                    "logprobs": lp,
                    "finish_reason": finish[k],
                    "stop_reason": stop_reason[k],
                    "prompt_token_ids": prompts[k // n][1] if req.return_token_ids else None,
                    "token_ids": tokens[k] if req.return_token_ids else None,
                    "prompt_logprobs": vllm_prompt_logprobs(prompt_lps[k // n])
                    if req.prompt_logprobs is not None
                    else None,
                }
            )
        prompt_tokens = sum(len(ids) for _, ids in prompts)
        completion = sum(len(t) for t in tokens)
        self._log(ctx, prompt_tokens, completion)
        return {
            "id": ctx["rid"],
            "object": "text_completion",
            "created": ctx["created"],
            "model": ctx["model"],
            "choices": choices,
            "usage": self.s.usage(prompt_tokens, completion, sum(cached)),
            "system_fingerprint": None,
        }

    async def _stream(self, streams, ctx) -> AsyncIterator[str]:
        req, prompts, n = ctx["req"], ctx["prompts"], ctx["req"].n
        include_usage, continuous = self.s.usage_options(req)
        head = {"id": ctx["rid"], "object": "text_completion", "created": ctx["created"], "model": ctx["model"]}
        chunk, usage_chunk = sse_writers(head, include_usage)
        choices = [
            _StreamedChoice(
                k,
                prompts[k // n],
                CompletionLogprobs(req.logprobs, self.s.token_text_for(req)) if req.logprobs is not None else None,
            )
            for k in range(len(prompts) * n)
        ]
        completion = 0
        cached = [0] * len(prompts)
        prompt_tokens = sum(len(ids) for _, ids in prompts)

        def so_far() -> dict | None:
            return self.s.usage(prompt_tokens, completion, sum(cached)) if continuous else None

        try:
            if req.echo and req.logprobs is None:  # one choice per chunk, as OpenAI streams n > 1
                for c in choices:
                    yield chunk(
                        [{"index": c.index, "text": self._echo(*c.prompt), "logprobs": None, "finish_reason": None}],
                        so_far(),
                    )
            async for pi, delta in merged(streams):
                cached[pi] = delta.num_cached_tokens
                if delta.prompt_logprobs is not None:  # the prompt is computed: echo it with its logprobs
                    for c in choices[pi * n : pi * n + n]:
                        yield chunk([self._prompt_choice(req, c, delta.prompt_logprobs)], so_far())
                completion += sum(len(sd.token_ids) for sd in delta.seqs)
                # the whole delta is counted before its chunks go out: each carries the usage after it
                out = [choices[pi * n + sd.index].output_choice(sd, req.return_token_ids) for sd in delta.seqs]
                for choice in out:
                    if choice is not None:
                        yield chunk([choice], so_far())
            if include_usage:
                yield usage_chunk(self.s.usage(prompt_tokens, completion, sum(cached)))
            self._log(ctx, prompt_tokens, completion)
        except Exception:  # noqa: BLE001 -- headers are sent: report in-band, never a traceback
            logger.exception("completion stream %s failed", ctx["rid"])
            yield STREAM_ERROR
        finally:
            for s in streams:
                s.abort()
        yield "data: [DONE]\n\n"

    def _prompt_choice(self, req: CompletionRequest, c: _StreamedChoice, prompt_logprobs: list) -> dict:
        """The choice that streams a computed prompt: its echo (with the prompt's logprobs when asked for)
        and vLLM's prompt_logprobs."""
        text, ids = c.prompt
        choice = {
            "index": c.index,
            "text": self._echo(text, ids) if req.echo else "",
            "logprobs": None,
            "finish_reason": None,
            "prompt_logprobs": vllm_prompt_logprobs(prompt_logprobs) if req.prompt_logprobs is not None else None,
        }
        if req.echo and c.logprobs is not None:
            choice["logprobs"] = c.logprobs.build(ids, prompt_logprobs)
        return choice

    def _log(self, ctx, prompt_tokens: int, completion: int) -> None:
        if self.s.config.log_requests:
            logger.info(
                "%s: %d prompt + %d completion tokens in %.2fs",
                ctx["rid"],
                prompt_tokens,
                completion,
                time.monotonic() - ctx["arrival"],
            )


class _StreamedChoice:
    """One choice (prompt index * n + sequence) of a streamed completion: its prompt (text or None, ids),
    its logprobs builder (None without logprobs; text offsets run on from chunk to chunk) and whether its
    prompt_token_ids went out yet (with return_token_ids: on its first output chunk)."""

    def __init__(self, index: int, prompt: tuple[str | None, list[int]], logprobs: CompletionLogprobs | None):
        self.index = index
        self.prompt = prompt
        self.logprobs = logprobs
        self.prompt_ids_sent = False

    def output_choice(self, sd, return_token_ids: bool) -> dict | None:
        """The chunk choice for this sequence's new output, or None when there is nothing to send yet."""
        lp = None
        if self.logprobs is not None and sd.token_ids:
            lp = self.logprobs.build(sd.token_ids, sd.logprobs)
        # a token whose text is held back (part of a character) still goes out when ids are asked for
        if not sd.text and lp is None and sd.finish_reason is None and not (return_token_ids and sd.token_ids):
            return None
        choice = {"index": self.index, "text": sd.text, "logprobs": lp, "finish_reason": sd.finish_reason}
        if return_token_ids:
            choice["token_ids"] = sd.token_ids
            if not self.prompt_ids_sent:
                choice["prompt_token_ids"] = self.prompt[1]
                self.prompt_ids_sent = True
        if sd.finish_reason is not None:
            choice["stop_reason"] = sd.stop_reason
        return choice
