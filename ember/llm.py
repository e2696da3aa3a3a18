"""Offline API shaped like vLLM's: LLM(model, **knobs).generate(prompts, params) / .chat(messages)."""

from __future__ import annotations

import weakref
from typing import Any, Sequence

from tqdm import tqdm

from ember.config import EngineConfig
from ember.engine.engine import LLMEngine
from ember.errors import InvalidRequestError
from ember.outputs import RequestOutput
from ember.sampling import SamplingParams


class LLM:
    """`LLM()` runs the embedded default model; every CLI knob is a snake_case keyword."""

    def __init__(self, model: str | None = None, **knobs: Any):
        self.engine = LLMEngine(EngineConfig(model=model, **knobs))
        self.tokenizer = self.engine.parts.loaded.tokenizer
        # close() runs when this object is collected or, at the latest, at interpreter exit (before
        # threads are torn down): a background compile or a tensor-parallel worker never outlives it
        self._finalizer = weakref.finalize(self, self.engine.shutdown)

    def close(self) -> None:
        """Stop what the engine runs beside requests (a background compile, its package worker and
        compilers, tensor-parallel workers) and wait for them; idempotent. Also `with LLM() as llm:`,
        and at exit."""
        self._finalizer()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def wait_for_compile(self, timeout: float | None = None) -> bool:
        """On CPU the default executor compiles decode graphs in the background while generate runs
        eagerly; this blocks until they are ready (False if `timeout` seconds passed first)."""
        return self.engine.wait_for_compile(timeout)

    def get_tokenizer(self):
        return self.tokenizer

    def generate(
        self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, use_tqdm: bool = True
    ) -> list[RequestOutput]:
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise InvalidRequestError(
                    f"{len(params)} sampling params for {len(prompts)} prompts; give one, or one per prompt"
                )
        return self._run([(p, sp) for p, sp in zip(prompts, params)], use_tqdm)

    def chat(
        self,
        messages,
        sampling_params: SamplingParams | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict | None = None,
        reasoning_effort: str | None = None,
    ) -> list[RequestOutput]:
        """reasoning_effort: OpenAI's value, fitted to the chat template's as the server fits it
        (ember.server.reasoning_effort; a reasoning_effort in chat_template_kwargs wins, verbatim)."""
        from ember.server.reasoning_effort import template_kwargs

        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        kwargs = template_kwargs(self.tokenizer.chat_template, chat_template_kwargs, reasoning_effort)
        prompts = [
            {
                "prompt_token_ids": self.tokenizer.apply_chat_template(
                    conv, add_generation_prompt=add_generation_prompt, tokenize=True, **kwargs
                )
            }
            for conv in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _run(self, items: list[tuple[Any, SamplingParams]], use_tqdm: bool) -> list[RequestOutput]:
        ids = []
        try:
            for prompt, sp in items:
                ids.append(self.engine.add_request(None, prompt, sp))
        except Exception:
            for rid in ids:  # a bad prompt in the list loses nothing already queued
                self.engine.abort_request(rid)
            raise
        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="generate", unit="req", disable=not use_tqdm, dynamic_ncols=True)
        generated = 0
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        results[out.request_id] = out
                        generated += sum(len(c.token_ids) for c in out.outputs)
                        bar.update(1)
                        bar.set_postfix(out_tok_s=f"{generated / max(bar.format_dict['elapsed'], 1e-9):.1f}")
        except BaseException:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        finally:
            bar.close()
        return [results[rid] for rid in ids]
