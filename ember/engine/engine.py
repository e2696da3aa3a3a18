"""LLMEngine: add_request -> step -> RequestOutputs. Keeps the requests and runs the step loop.

Everything it drives (device, model, KV pool, scheduler, runner, executor, speculator, the
tensor-parallel workers) is built once by ember.engine.startup.start_engine; a step is
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


class LLMEngine:
    def __init__(self, config: EngineConfig, defer_compile: bool = False):
        """defer_compile: a background compile (--executor auto on CPU) starts at start_compile(), not
        now (the server warms up first, so that its first steps do not share the cores with it)."""
        self.config = config
        core = self.core = start_engine(config, defer_compile)
        self.device, self.dtype, self.tp = core.setup.device, core.setup.dtype, core.tp
        self.loaded, self.model_config, self.tokenizer = core.loaded, core.loaded.model_config, core.loaded.tokenizer
        self.int8_decode_bytes, self.dense_copy_bytes = core.copies.int8_decode_bytes, core.copies.dense_copy_bytes
        limits = core.limits
        self.max_model_len, self.max_num_seqs, self.kv_dtype = limits.max_model_len, limits.max_num_seqs, limits.kv_dtype
        self.executor_name = limits.executor
        self.compiler = core.compiler  # the BackgroundCompiler of --executor auto on CPU (None: none)
        if self.compiler is not None:  # its larger batch sizes wait until as many requests run (or none)
            self.compiler.demand = lambda: self.scheduler.num_unfinished  # lens of plain containers: thread-safe
        self.kv, self.scheduler, self.runner, self.spec = core.kv, core.scheduler, core.runner, core.spec
        self.eos_token_ids = core.eos_token_ids
        self.structured = StructuredOutputManager(self.tokenizer, self.model_config.vocab_size, self.eos_token_ids,
                                                  config.reasoning_parser)
        self.parents: dict[str, ParentRequest] = {}
        self._ids = itertools.count()

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers and a background compile (nothing to do without either).
        Also runs at exit."""
        if self.compiler is not None:
            self.compiler.close()
        self.structured.shutdown()
        if self.tp is not None:
            self.tp.shutdown()

    def start_compile(self) -> None:
        """Start a deferred background compile (nothing to do without one), and load the grammar
        library so that the first structured request does not wait for it."""
        self.structured.preload()
        if self.compiler is not None:
            self.compiler.resume()

    def wait_for_compile(self, timeout: float | None = None) -> bool:
        """Block until a background compile (--executor auto on CPU) has finished, so that what runs
        next is the compiled path (benchmarks); True at once when nothing compiles in the background."""
        return self.compiler is None or self.compiler.wait(timeout)

    @property
    def executor_state(self) -> str:
        """What runs decode steps now: eager, compiled, cuda-graph, 'compiling (eager meanwhile)' before
        the first graph is ready, or 'compiled (N shapes so far; ...)' while larger sizes remain."""
        if self.compiler is not None and not self.compiler.done:
            ready = self.compiler.ready_shapes
            return (f"compiled ({ready} shapes so far; the rest compile in the background as they are needed)" if ready
                    else "compiling (eager meanwhile)")
        return self.executor_name

    @property
    def compiled_shapes(self) -> int:
        """Decode step shapes (batch size x query length, the MTP fill's included) that run compiled now."""
        if self.compiler is not None:
            return self.compiler.ready_shapes
        return len(getattr(self.runner.executor, "ready", ()))

    @property
    def tp_comm_seconds(self) -> float:
        """Seconds rank 0 spent in all_reduce / all_gather during the last step (0 without TP)."""
        return self.tp.last_step_comm_seconds if self.tp is not None else 0.0

    def copies_note(self) -> str:
        return self.core.copies.note()

    # -- requests ----------------------------------------------------------------------------
    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise InvalidRequestError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise InvalidRequestError(f"a prompt must be a string, a list of token ids or a dict, not {type(prompt).__name__}")

    def add_request(self, request_id: str | None, prompt: PromptType, params: SamplingParams | None = None) -> str:
        params = params or SamplingParams()
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self.parents:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        text, ids = self._tokenize(prompt)
        if not ids:
            raise InvalidRequestError("the prompt is empty; give at least one token")
        params = check_request(ids, params, self.config, self.model_config.vocab_size, self.max_model_len)
        group = ParentRequest(request_id, text, ids)
        for i in range(params.n):
            child_params = params if params.n == 1 else params.replace(
                n=1, seed=None if params.seed is None else params.seed + i)
            rid = request_id if params.n == 1 else f"{request_id}#{i}"
            req = Request(rid, ids, child_params, prompt=text)
            req.parent_id, req.index = request_id, i
            req.detokenizer = IncrementalDetokenizer(self.tokenizer, child_params)
            req.logprobs = [] if child_params.logprobs is not None else None
            if child_params.prompt_logprobs is not None and i == 0:  # the sequences share one prompt
                req.prompt_logprobs = [None]
            group.children.append(req)
        self.structured.add_request(group.children, ids)  # a grammar that cannot be built raises here
        for req in group.children:
            self.scheduler.add_request(req)
        self.parents[request_id] = group
        return request_id

    def abort_request(self, request_id: str) -> bool:
        group = self.parents.pop(request_id, None)
        if group is None:
            return False
        for req in group.children:
            self.scheduler.finish_request(req, RequestStatus.FINISHED_ABORTED)
            self.runner.release(req.request_id)
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self.parents)

    # -- the step ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        if self.compiler is not None:
            self.compiler.fit_step_threads()
        if self.tp is None:
            return self._step()
        with self.tp.step():  # a dead worker or a failed collective raises DistributedError here
            return self._step()

    def _step(self) -> list[RequestOutput]:
        out = self.scheduler.schedule()
        if out.is_empty:
            return []
        banned = self._banned_tokens(out)
        t0 = time.perf_counter()
        masks = self.structured.step_masks(out)
        sampled = self.runner.execute(out, banned, masks)
        self.structured.step_done(masks)
        rejected = self.spec.verified(out, sampled, time.perf_counter() - t0) if out.drafts else None
        self.scheduler.update_after_step(out, rejected)
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
        outputs = [self._output(g) for g in touched.values()]
        for g in touched.values():
            if g.finished:
                del self.parents[g.request_id]
        if self.spec is not None:
            self.spec.propose(self.scheduler.running, self.runner.take_last_step())
        return outputs

    def _banned_tokens(self, out) -> dict[str, list[int]] | None:
        banned = None
        for req, _ in out.scheduled:
            p = req.sampling_params
            if p.min_tokens and req.num_output_tokens < p.min_tokens:
                banned = banned or {}
                banned[req.request_id] = [] if p.ignore_eos else self.eos_token_ids  # the sampler adds stop_token_ids
        return banned

    def _append(self, req: Request, tok) -> None:
        p = req.sampling_params
        req.append_token(tok.token_id)
        if req.logprobs is not None:
            for tid, lp in tok.logprobs.items():
                lp.decoded_token = req.detokenizer.decoded_token(tid)
            req.logprobs.append(tok.logprobs)
        status = None
        if not p.ignore_eos and tok.token_id in self.eos_token_ids:
            status = RequestStatus.FINISHED_STOPPED
        elif p.stop_token_ids and tok.token_id in p.stop_token_ids:
            status, req.stop_reason = RequestStatus.FINISHED_STOPPED, tok.token_id
        stop_str = req.detokenizer.update([tok.token_id])
        if status is None and stop_str is not None:
            status, req.stop_reason = RequestStatus.FINISHED_STOPPED, stop_str
        if req.grammar is not None and status is None:
            status = self._grammar_step(req, tok.token_id)
        if status is None:
            max_tokens = p.max_tokens if p.max_tokens is not None else self.max_model_len
            if req.num_output_tokens >= max_tokens or req.num_tokens >= self.max_model_len:
                status = RequestStatus.FINISHED_LENGTH
        if status is not None:
            req.detokenizer.finish()
            self.scheduler.finish_request(req, status)
            self.runner.release(req.request_id)

    def _grammar_step(self, req: Request, token_id: int) -> RequestStatus | None:
        accepted, complete = self.structured.accept(req, token_id)
        if complete:  # the grammar took its stop token (EOS under ignore_eos): nothing more may follow
            return RequestStatus.FINISHED_STOPPED
        if not accepted:  # sampled before the constraint could apply (see ember.structured.manager)
            logger.warning("request %s: token %d does not fit its grammar; stopping it", req.request_id, token_id)
            return RequestStatus.FINISHED_STOPPED
        return None

    def _output(self, group: ParentRequest) -> RequestOutput:
        completions = [
            CompletionOutput(index=r.index, text=r.detokenizer.output_text, token_ids=r.output_token_ids,
                             logprobs=r.logprobs, finish_reason=r.finish_reason, stop_reason=r.stop_reason)
            for r in group.children
        ]
        first = group.children[0]
        cached = max(0, first.num_cached_tokens)
        return RequestOutput(group.request_id, group.prompt, group.prompt_token_ids, completions,
                             finished=group.finished, num_cached_tokens=cached,
                             prompt_logprobs=first.decoded_prompt_logprobs())

    # -- introspection -----------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.kv.num_free_blocks

    def stats(self) -> dict:
        stats = {
            "kv_blocks_total": self.kv.num_blocks,
            "kv_blocks_free": self.kv.num_free_blocks,
            "prefix_cache_queries": self.kv.stats.queries,
            "prefix_cache_hits": self.kv.stats.hits,
            "num_preemptions": self.scheduler.num_preemptions,
            "waiting": len(self.scheduler.waiting),
            "running": len(self.scheduler.running),
        }
        if self.spec is not None:
            stats.update(self.spec.stats.as_dict())
        if self.tp is not None:
            stats.update(tp_comm_seconds_last_step=self.tp.last_step_comm_seconds,
                         tp_broadcast_seconds_last_step=self.tp.last_step_broadcast_seconds,
                         tp_comm_seconds_total=self.tp.total_comm_seconds)
        return stats
