"""LLMEngine: add_request -> step -> RequestOutputs. Keeps the requests and runs the step loop.

Everything it drives (device, model, KV pool, scheduler, runner, executor, speculator, the
tensor-parallel workers) is built once by ember.engine.startup.start_engine into engine.parts (an
EngineParts), which is the one name of each: engine.parts.runner, engine.parts.limits.max_model_len,
engine.parts.loaded.tokenizer; the engine itself keeps only the requests. A step is
schedule -> runner.execute -> (speculation: verified) -> scheduler.update_after_step ->
detokenize and stop checks -> (speculation: propose the next drafts).
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field

from ember.config import EngineConfig
from ember.engine.admission import check_request
from ember.engine.detokenizer import IncrementalDetokenizer
from ember.engine.startup.start import start_engine
from ember.errors import InvalidRequestError
from ember.outputs import CompletionOutput, RequestOutput
from ember.request import Request, RequestStatus
from ember.sampling import SamplingParams
from ember.structured.manager import StructuredOutputManager

logger = logging.getLogger("ember")

# What add_request takes: text, token ids, or vLLM's dict form ({"prompt": ...} / {"prompt_token_ids": ...})
PromptType = str | list[int] | dict


def prompt_text_and_ids(prompt: PromptType, tokenizer) -> tuple[str | None, list[int]]:
    """The prompt's text (None when only ids were given) and its token ids."""
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        if "prompt" in prompt:
            prompt = prompt["prompt"]
        else:
            raise InvalidRequestError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
    if isinstance(prompt, str):
        return prompt, tokenizer.encode(prompt)
    if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
        return None, list(prompt)
    raise InvalidRequestError(f"a prompt must be a string, a list of token ids or a dict, not {type(prompt).__name__}")


@dataclass
class ParentRequest:
    """One user request: its n >= 1 sampled sequences share the prompt (and its KV blocks)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[Request] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return all(c.is_finished for c in self.children)

    def output(self) -> RequestOutput:
        """What the caller sees of this request now: every sequence's text and tokens so far."""
        completions = [
            CompletionOutput(
                index=r.index,
                text=r.detokenizer.output_text,
                token_ids=r.output_token_ids,
                logprobs=r.logprobs,
                finish_reason=r.finish_reason,
                stop_reason=r.stop_reason,
            )
            for r in self.children
        ]
        first = self.children[0]
        cached = max(0, first.num_cached_tokens)
        return RequestOutput(
            self.request_id,
            self.prompt,
            self.prompt_token_ids,
            completions,
            finished=self.finished,
            num_cached_tokens=cached,
            prompt_logprobs=first.decoded_prompt_logprobs(),
        )


class LLMEngine:
    def __init__(self, config: EngineConfig, defer_compile: bool = False):
        """defer_compile: a background compile (--executor auto on CPU) starts at start_compile(), not
        now (the server warms up first, so that its first steps do not share the cores with it)."""
        self.config = config
        # everything the step loop drives, built once; read as engine.parts.runner, engine.parts.limits, ...
        self.parts = start_engine(config, defer_compile)
        if self.parts.compiler is not None:  # its larger batch sizes wait until as many requests run (or none)
            # lens of plain containers: safe to read from the compile thread
            self.parts.compiler.demand = lambda: self.parts.scheduler.num_unfinished
        loaded = self.parts.loaded
        self.structured = StructuredOutputManager(
            loaded.tokenizer, loaded.model_config.vocab_size, self.parts.eos_token_ids, config.reasoning_parser
        )
        self.parents: dict[str, ParentRequest] = {}
        self._ids = itertools.count()

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers and a background compile (nothing to do without either).
        Also runs at exit."""
        if self.parts.compiler is not None:
            self.parts.compiler.close()
        self.structured.shutdown()
        if self.parts.tp is not None:
            self.parts.tp.shutdown()

    def start_compile(self) -> None:
        """Start a deferred background compile (nothing to do without one), and load the grammar
        library so that the first structured request does not wait for it."""
        self.structured.preload()
        if self.parts.compiler is not None:
            self.parts.compiler.resume()

    def wait_for_compile(self, timeout: float | None = None) -> bool:
        """Block until a background compile (--executor auto on CPU) has finished, so that what runs
        next is the compiled path (benchmarks); True at once when nothing compiles in the background."""
        return self.parts.compiler is None or self.parts.compiler.wait(timeout)

    @property
    def executor_state(self) -> str:
        """What runs decode steps now: eager, compiled, cuda-graph, 'compiling (eager meanwhile)' before
        the first graph is ready, or 'compiled (N shapes so far; ...)' while larger sizes remain."""
        compiler = self.parts.compiler
        if compiler is not None and not compiler.done:
            ready = compiler.ready_shapes
            return (
                f"compiled ({ready} shapes so far; the rest compile in the background as they are needed)"
                if ready
                else "compiling (eager meanwhile)"
            )
        return self.parts.limits.executor

    @property
    def compiled_shapes(self) -> int:
        """Decode step shapes (batch size x query length, the MTP fill's included) that run compiled now."""
        if self.parts.compiler is not None:
            return self.parts.compiler.ready_shapes
        return len(getattr(self.parts.runner.executor, "ready", ()))

    @property
    def tp_comm_seconds(self) -> float:
        """Seconds rank 0 spent in all_reduce / all_gather during the last step (0 without TP)."""
        return self.parts.tp.last_step_comm_seconds if self.parts.tp is not None else 0.0

    # -- requests ----------------------------------------------------------------------------
    def add_request(self, request_id: str | None, prompt: PromptType, params: SamplingParams | None = None) -> str:
        params = params or SamplingParams()
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self.parents:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        loaded = self.parts.loaded
        text, ids = prompt_text_and_ids(prompt, loaded.tokenizer)
        if not ids:
            raise InvalidRequestError("the prompt is empty; give at least one token")
        params = check_request(
            ids,
            params,
            self.config,
            loaded.model_config.vocab_size,
            self.parts.limits.max_model_len,
            self.parts.limits.max_num_batched_tokens,
        )
        group = ParentRequest(request_id, text, ids)
        for i in range(params.n):
            child_params = (
                params if params.n == 1 else params.replace(n=1, seed=None if params.seed is None else params.seed + i)
            )
            rid = request_id if params.n == 1 else f"{request_id}#{i}"
            req = Request(rid, ids, child_params, prompt=text)
            req.parent_id, req.index = request_id, i
            req.detokenizer = IncrementalDetokenizer(loaded.tokenizer, child_params)
            req.logprobs = [] if child_params.logprobs is not None else None
            if child_params.prompt_logprobs is not None and i == 0:  # the sequences share one prompt
                req.prompt_logprobs = [None]
            group.children.append(req)
        self.structured.add_request(group.children, ids)  # a grammar that cannot be built raises here
        for req in group.children:
            self.parts.scheduler.add_request(req)
        self.parents[request_id] = group
        return request_id

    def abort_request(self, request_id: str) -> bool:
        group = self.parents.pop(request_id, None)
        if group is None:
            return False
        for req in group.children:
            self.parts.scheduler.finish_request(req, RequestStatus.FINISHED_ABORTED)
            self.parts.runner.release(req.request_id)
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self.parents)

    # -- the step ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        if self.parts.compiler is not None:
            self.parts.compiler.fit_step_threads()
        if self.parts.tp is None:
            return self._step()
        with self.parts.tp.step():  # a dead worker or a failed collective raises DistributedError here
            return self._step()

    def _step(self) -> list[RequestOutput]:
        parts = self.parts
        out = parts.scheduler.schedule()
        if out.is_empty:
            return []
        banned = self._banned_tokens(out)
        t0 = time.perf_counter()
        masks = self.structured.step_masks(out)
        sampled = parts.runner.execute(out, banned, masks)
        self.structured.step_done(masks)
        rejected = parts.spec.verified(out, sampled, time.perf_counter() - t0) if out.drafts else None
        parts.scheduler.update_after_step(out, rejected)
        touched: dict[str, ParentRequest] = {}
        for req, _ in out.scheduled:
            group = self.parents.get(req.parent_id)
            toks = sampled.get(req.request_id)
            if group is None or not toks:
                continue
            touched[group.request_id] = group
            for tok in toks:  # token by token: a stop among accepted drafts discards the rest
                self._append(req, tok)
                if req.is_finished:
                    break
        outputs = [g.output() for g in touched.values()]
        for g in touched.values():
            if g.finished:
                del self.parents[g.request_id]
        if parts.spec is not None:
            parts.spec.propose(parts.scheduler.running, parts.runner.take_last_step())
        return outputs

    def _banned_tokens(self, out) -> dict[str, list[int]] | None:
        banned = None
        for req, _ in out.scheduled:
            p = req.sampling_params
            if p.min_tokens and req.num_output_tokens < p.min_tokens:
                banned = banned or {}
                # the sampler adds stop_token_ids
                banned[req.request_id] = [] if p.ignore_eos else self.parts.eos_token_ids
        return banned

    def _append(self, req: Request, tok) -> None:
        p = req.sampling_params
        req.append_token(tok.token_id)
        if req.logprobs is not None:
            for tid, lp in tok.logprobs.items():
                lp.decoded_token = req.detokenizer.decoded_token(tid)
            req.logprobs.append(tok.logprobs)
        status = None
        if not p.ignore_eos and tok.token_id in self.parts.eos_token_ids:
            status = RequestStatus.FINISHED_STOPPED
        elif p.stop_token_ids and tok.token_id in p.stop_token_ids:
            status, req.stop_reason = RequestStatus.FINISHED_STOPPED, tok.token_id
        stop_str = req.detokenizer.update([tok.token_id])
        if status is None and stop_str is not None:
            status, req.stop_reason = RequestStatus.FINISHED_STOPPED, stop_str
        if req.grammar is not None and status is None:
            status = self._grammar_step(req, tok.token_id)
        if status is None:
            max_model_len = self.parts.limits.max_model_len
            max_tokens = p.max_tokens if p.max_tokens is not None else max_model_len
            if req.num_output_tokens >= max_tokens or req.num_tokens >= max_model_len:
                status = RequestStatus.FINISHED_LENGTH
        if status is not None:
            req.detokenizer.finish()
            self.parts.scheduler.finish_request(req, status)
            self.parts.runner.release(req.request_id)

    def _grammar_step(self, req: Request, token_id: int) -> RequestStatus | None:
        accepted, complete = self.structured.accept(req, token_id)
        if complete:  # the grammar took its stop token (EOS under ignore_eos): nothing more may follow
            return RequestStatus.FINISHED_STOPPED
        if not accepted:  # sampled before the constraint could apply (see ember.structured.manager)
            logger.warning("request %s: token %d does not fit its grammar; stopping it", req.request_id, token_id)
            return RequestStatus.FINISHED_STOPPED
        return None

    # -- introspection -----------------------------------------------------------------------
    def stats(self) -> dict:
        kv, scheduler, spec, tp = self.parts.kv, self.parts.scheduler, self.parts.spec, self.parts.tp
        stats = {
            "kv_blocks_total": kv.num_blocks,
            "kv_blocks_free": kv.num_free_blocks,
            "prefix_cache_queries": kv.stats.queries,
            "prefix_cache_hits": kv.stats.hits,
            "num_preemptions": scheduler.num_preemptions,
            "waiting": len(scheduler.waiting),
            "running": len(scheduler.running),
        }
        if spec is not None:
            stats.update(spec.stats.as_dict())
        if tp is not None:
            stats.update(
                tp_comm_seconds_last_step=tp.last_step_comm_seconds,
                tp_broadcast_seconds_last_step=tp.last_step_broadcast_seconds,
                tp_comm_seconds_total=tp.total_comm_seconds,
            )
        return stats
