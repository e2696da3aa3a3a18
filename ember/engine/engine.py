"""LLMEngine: add_request -> step -> RequestOutputs. Owns tokenizer, scheduler and runner."""
from __future__ import annotations

import itertools
import logging
import os
import time
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch

from ember import planner
from ember.config import CPU_DENSE_COPY_FRACTION, CPU_KV_CAP_GIB, CPU_KV_FRACTION, EngineConfig, available_ram_bytes, cpu_has_avx512_bf16
from ember.engine.cpu_malloc import keep_freed_memory_in_heap
from ember.engine.detokenizer import IncrementalDetokenizer
from ember.engine.kv_cache import KVCacheManager
from ember.engine.request import Request, RequestStatus
from ember.engine.runner import ModelRunner
from ember.engine.scheduler import Scheduler
from ember.engine.step_executor import attention_backend_of, build_executor, resolve_executor
from ember.errors import ConfigError, InvalidRequestError, PromptTooLongError
from ember.kernels import cpu_causal_attention as causal_attention
from ember.kernels import cpu_fused_elementwise as fused_elementwise
from ember.kernels import cpu_row_top
from ember.kernels import cpu_tiled_gemv as tiled_gemv
from ember.kernels.cpu_paged_attention import paged_attention_op
from ember.layers.attention import resolve_kv_cache_dtype
from ember.loader.model_loader import load_model
from ember.outputs import CompletionOutput, RequestOutput
from ember.sampling import SamplingParams

logger = logging.getLogger("ember")
GiB = 1 << 30


@dataclass
class _Group:
    """One user request: its n >= 1 sampled sequences share the prompt (and its KV blocks)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[Request] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return all(c.is_finished for c in self.children)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda was asked for but torch sees no CUDA device; use --device cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        fast_bf16 = device.type == "cuda" or cpu_has_avx512_bf16()
        return torch.bfloat16 if fast_bf16 else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        tp = config.tensor_parallel_size
        if self.device.type == "cpu":
            torch.set_num_threads(config.num_threads or max(1, (os.cpu_count() or 1) // tp))
            keep_freed_memory_in_heap()
            if config.cpu_paged_attention:
                paged_attention_op()  # built (once per machine, ~45 s) or loaded now, not in the first request
            cpu_row_top.available()  # the sampler's argmax, likewise (~5 s once)
        tiled_gemv.set_enabled(config.cpu_tiled_gemv, config.cpu_int8_activations)  # read as GGUF weights are packed at load
        fused_elementwise.set_enabled(config.cpu_fused_elementwise)
        causal_attention.set_enabled(config.cpu_flash_attention)
        if self.device.type == "cpu" and self.dtype == torch.bfloat16:
            # built (once per machine) or loaded now, not in the first request
            if config.cpu_fused_elementwise:
                fused_elementwise.available()
            if config.cpu_flash_attention:
                causal_attention.flash_available()
        torch.manual_seed(config.seed)
        # Tensor parallelism: workers start (and load their shards) alongside rank 0's own load.
        self.tp = None
        if tp > 1:
            from ember.distributed.group import start_tensor_parallel

            self.tp = start_tensor_parallel(config, self.device)
        with self._sharding():
            loaded = load_model(config.model, config.tokenizer, self.dtype, self.device, config.attention_backend,
                                self.tp.quantization if self.tp else config.quantization)
        self.loaded = loaded
        self.model_config = mc = loaded.model_config
        self.tokenizer = loaded.tokenizer
        self.int8_decode_bytes = self._maybe_int8_decode(loaded)
        self.dense_copy_bytes = self._maybe_dense_copy(loaded)
        self.max_model_len = self._resolve_max_model_len()
        self.max_num_seqs = config.max_num_seqs or (64 if self.device.type == "cuda" else 16)
        if self.max_num_seqs > config.max_num_batched_tokens:
            raise ConfigError(f"max_num_seqs {self.max_num_seqs} exceeds --max-num-batched-tokens "
                              f"{config.max_num_batched_tokens}; raise the budget or lower --max-num-seqs")
        if not config.enable_chunked_prefill and config.max_num_batched_tokens < self.max_model_len:
            logger.info("chunked prefill is off: prompts longer than %d tokens will be refused", config.max_num_batched_tokens)

        self.kv_dtype = kv_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, self.dtype, self.device)
        backend = attention_backend_of(loaded.model)
        self.executor_name = resolve_executor(config, self.device, kv_dtype, getattr(backend, "name", None))
        self.cuda_graph_max_batch = min(config.cuda_graph_max_batch_size, self.max_num_seqs)
        # The speculator comes first: a drafter with KV layers of its own (MTP) needs its share of the pool.
        self.spec = None
        if config.speculative is not None:
            from ember.spec.speculator import Speculator

            with self._sharding():
                self.spec = Speculator(config.speculative, self)
        # --no-cpu-paged-attention reaches every model the engine runs: the target (and its MTP
        # layers, which share its backend) and a draft model, which has a backend of its own.
        draft = getattr(getattr(self.spec, "proposer", None), "model", None)
        for m in (loaded.model, draft):
            b = attention_backend_of(m) if m is not None else None
            if hasattr(b, "fused_decode"):
                b.fused_decode = config.cpu_paged_attention
        per_token = planner.kv_bytes_per_token(mc, kv_dtype.itemsize, tp)  # this device's kv heads
        if self.spec is not None:
            per_token += self.spec.kv_bytes_per_token(kv_dtype.itemsize)
        block_bytes = per_token * config.block_size
        pool = planner.kv_pool(self._kv_budget_bytes(loaded.model, block_bytes), block_bytes, config.block_size)
        planner.check_fits(pool, self.max_model_len,
                           "--kv-cache-memory" if self.device.type == "cpu" else "--gpu-memory-utilization")
        num_blocks = pool.num_blocks
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.kv, config.max_num_batched_tokens, self.max_num_seqs, self.max_model_len,
                                   config.enable_chunked_prefill)
        model = loaded.model
        if self.tp is not None:
            from ember.distributed.mirror import MirroredModel

            model = MirroredModel(model)
        self.runner = ModelRunner(model, mc, num_blocks, config.block_size, kv_dtype, self.device,
                                  num_kv_heads=planner.kv_heads_per_device(mc, tp))
        if self.spec is not None:
            self.spec.attach(self.runner)
        if self.tp is not None:
            self._start_workers_stepping()
        # After every KV layer exists: compiled graphs and captured graphs address the caches.
        self.runner.executor = build_executor(self.executor_name, self, self.runner)
        if self.spec is not None:
            self.spec.prepare(self)
        self.groups: dict[str, _Group] = {}
        self._ids = itertools.count()
        eos = list(self.tokenizer.eos_token_ids)
        if isinstance(mc.eos_token_id, int):
            eos.append(mc.eos_token_id)
        elif isinstance(mc.eos_token_id, list):
            eos.extend(mc.eos_token_id)
        self.eos_token_ids = list(dict.fromkeys(eos))
        logger.info(
            "ember: %s, %.1fM parameters, %.1f MB weights%s, %s on %s, KV cache %s, %d blocks x %d = %d tokens (%.1f MB), "
            "max_model_len %d, %s executor, loaded from %s in %.1fs",
            mc.architecture, loaded.num_parameters / 1e6, loaded.weight_bytes / 1e6,
            self.copies_note(), str(self.dtype).removeprefix("torch."),
            self.device, str(kv_dtype).removeprefix("torch."), num_blocks, config.block_size, num_blocks * config.block_size, num_blocks * block_bytes / 1e6,
            self.max_model_len, self.executor_name, loaded.path, loaded.load_seconds)

    def _sharding(self):
        """Inside: layers are built as this rank's shard (a no-op without TP)."""
        if self.tp is None:
            return nullcontext()
        from ember.distributed.parallel_state import sharding

        return sharding(0, self.tp.world_size)

    def _start_workers_stepping(self) -> None:
        proposer = getattr(self.spec, "proposer", None)
        if getattr(proposer, "mtp", None) is not None:  # its MTP forwards are replayed on the workers too
            from ember.distributed.mirror import MirroredMTP

            proposer.mtp = MirroredMTP(proposer.mtp)
        self.tp.setup_workers(self.runner, bool(self.int8_decode_bytes))

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers (nothing to do without TP). Also runs at exit."""
        if self.tp is not None:
            self.tp.shutdown()

    @property
    def tp_comm_seconds(self) -> float:
        """Seconds rank 0 spent in all_reduce / all_gather during the last step (0 without TP)."""
        return self.tp.last_step_comm_seconds if self.tp is not None else 0.0

    def _maybe_int8_decode(self, loaded) -> int:
        on = self.config.int8_decode
        if on is None:  # a dequantized GGUF: the int8 copy buys back the decode speed of packed weights
            on = (loaded.format == "gguf" and loaded.quantization == "none" and self.device.type == "cpu"
                  and self.dtype != torch.float32)
        if not on:
            return 0
        if loaded.quantization != "none":
            raise ConfigError(f"--int8-decode adds an int8 copy of dense weights; these are already {loaded.quantization} "
                              "packed. Drop --int8-decode, or pass --quantization none")
        if self.device.type != "cpu":
            raise ConfigError("--int8-decode is a CPU path; drop it on CUDA")
        if self.dtype == torch.float32:
            raise ConfigError("--int8-decode needs --dtype bfloat16 or float16 (torch's int8 kernel takes those activations)")
        from ember.quant.int8_decode import enable_int8_decode

        return enable_int8_decode(loaded.model)

    def _maybe_dense_copy(self, loaded) -> int:
        from ember.quant.dense_copy import dense_copy_bytes, enable_dense_copy, packed_layers
        from ember.quant.gguf_quant import TiledPart

        on = self.config.int4_dense_copy
        if on is False:
            return 0
        need = dense_copy_bytes(loaded.model, self.dtype)
        if on is None:
            # float32 packed weights exist where the tiled GEMV's AVX2 build runs them (else the loader
            # dequantizes them), and only layers with another part (a Q6_K shard) count in `need`; AWQ in
            # float32 runs torch's slow fp32 int4 kernel, a copy or not
            packed_fp32 = TiledPart.usable(torch.float32, self.device)
            on = (self.device.type == "cpu" and (self.dtype != torch.float32 or packed_fp32) and self.tp is None
                  and need > 0 and need <= CPU_DENSE_COPY_FRACTION * available_ram_bytes())
            if not on:
                return 0
        if self.device.type != "cpu":
            raise ConfigError("--int4-dense-copy is a CPU path (CUDA runs AWQ through its own kernels); drop it")
        if need == 0:
            if packed_layers(loaded.model, helped=False):
                raise ConfigError("--int4-dense-copy: every packed layer here runs its kernel at any batch size (the tiled "
                                  "GEMV's AVX2 build beats a float32 dense GEMM; its int8-activation path, "
                                  "--cpu-int8-activations, beats a bf16 one), so a copy would only cost memory. Drop the "
                                  "flag, or add --no-cpu-int8-activations for bf16 activations over a dense copy")
            raise ConfigError(f"--int4-dense-copy needs packed int4 weights (a .gguf file or an AWQ folder); this model "
                              f"is {loaded.quantization}. Drop the flag")
        if self.tp is not None:
            raise ConfigError("--int4-dense-copy is not supported with --tensor-parallel-size > 1; drop one of them")
        return enable_dense_copy(loaded.model, self.dtype)

    def copies_note(self) -> str:
        if self.int8_decode_bytes:
            return f" (+{self.int8_decode_bytes / 1e6:.1f} MB int8 decode copy)"
        if self.dense_copy_bytes:
            return f" (+{self.dense_copy_bytes / 1e6:.1f} MB dense copy for batches)"
        return ""

    # -- sizing -----------------------------------------------------------------------------
    def _resolve_max_model_len(self) -> int:
        model_max = self.model_config.max_position_embeddings
        if self.config.max_model_len is None:
            return model_max
        if self.config.max_model_len > model_max:
            raise ConfigError(f"--max-model-len {self.config.max_model_len} exceeds the model's context length "
                              f"{model_max}; pass --max-model-len {model_max} or less")
        return self.config.max_model_len

    def _kv_budget_bytes(self, model: torch.nn.Module, block_bytes: int) -> float:
        if self.device.type == "cpu":
            if self.config.kv_cache_memory is not None:
                return self.config.kv_cache_memory * GiB
            return min(CPU_KV_FRACTION * available_ram_bytes(), CPU_KV_CAP_GIB * GiB)
        return self._profile_cuda_kv_budget(model)

    def _profile_cuda_kv_budget(self, model: torch.nn.Module) -> float:
        """Run one forward at the full token budget (no KV) and give the KV cache what is left."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        n = min(self.config.max_num_batched_tokens, self.max_model_len)
        dev = self.device
        kv_heads = planner.kv_heads_per_device(self.model_config, self.config.tensor_parallel_size)
        if self.tp is not None:  # the workers run the same profile step (its collectives need them)
            from ember.distributed.comm import send_call

            send_call("profile", n, self.max_num_seqs, kv_heads, self.dtype)
        profile_forward(model, n, self.max_num_seqs, kv_heads, self.dtype, dev)
        torch.cuda.synchronize(dev)
        peak = torch.cuda.max_memory_allocated(dev)
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(dev)
        used_by_others = total - free - torch.cuda.memory_allocated(dev)
        graphs = 0
        if self.executor_name == "cuda-graph":  # the graphs' pool is memory the KV cache cannot have
            from ember.engine.cuda_graph_executor import graph_pool_estimate

            graphs = graph_pool_estimate(model, self.model_config, self.cuda_graph_max_batch, max(self.graph_query_lens()),
                                         self.max_model_len, self.config.block_size, self.dtype, dev)
            self.cuda_graph_reserved_bytes = graphs
        return max(0.0, total * self.config.gpu_memory_utilization - used_by_others - peak - graphs)

    def graph_query_lens(self) -> list[int]:
        """Query lengths the CUDA graphs are captured for (ember.engine.step_executor.graph_query_lens)."""
        from ember.engine.step_executor import attention_backend_of, graph_query_lens

        return graph_query_lens(self.spec.k_max if self.spec is not None else 0, attention_backend_of(self.loaded.model))

    # -- requests ----------------------------------------------------------------------------
    def _tokenize(self, prompt) -> tuple[str | None, list[int]]:
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

    def add_request(self, request_id: str | None, prompt, params: SamplingParams | None = None) -> str:
        params = params or SamplingParams()
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self.groups:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        text, ids = self._tokenize(prompt)
        if not ids:
            raise InvalidRequestError("the prompt is empty; give at least one token")
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        if len(ids) >= self.max_model_len:
            raise PromptTooLongError(
                f"the prompt has {len(ids)} tokens but max_model_len is {self.max_model_len} (prompt plus at least one "
                f"generated token must fit); shorten the prompt or raise --max-model-len")
        if not self.config.enable_chunked_prefill and len(ids) > self.config.max_num_batched_tokens:
            raise PromptTooLongError(
                f"the prompt has {len(ids)} tokens, more than --max-num-batched-tokens {self.config.max_num_batched_tokens}, "
                "and chunked prefill is off; enable chunked prefill or raise --max-num-batched-tokens")
        group = _Group(request_id, text, ids)
        for i in range(params.n):
            child_params = params if params.n == 1 else params.replace(
                n=1, seed=None if params.seed is None else params.seed + i)
            rid = request_id if params.n == 1 else f"{request_id}#{i}"
            req = Request(rid, ids, child_params, prompt=text)
            req.parent_id, req.index = request_id, i
            req.detokenizer = IncrementalDetokenizer(self.tokenizer, child_params)
            req.logprobs = [] if child_params.logprobs is not None else None
            group.children.append(req)
            self.scheduler.add_request(req)
        self.groups[request_id] = group
        return request_id

    def abort_request(self, request_id: str) -> bool:
        group = self.groups.pop(request_id, None)
        if group is None:
            return False
        for req in group.children:
            self.scheduler.finish_request(req, RequestStatus.FINISHED_ABORTED)
            self.runner.release(req.request_id)
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self.groups)

    # -- the step ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
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
        sampled = self.runner.execute(out, banned)
        rejected = self._verified(out, sampled, time.perf_counter() - t0) if out.drafts else None
        self.scheduler.update_after_step(out, rejected)
        touched: dict[str, _Group] = {}
        for req, _ in out.scheduled:
            group = self.groups.get(req.parent_id)
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
                del self.groups[g.request_id]
        if self.spec is not None:
            self.spec.propose(self.scheduler.running, out)
        return outputs

    def _verified(self, out, sampled, seconds: float) -> dict[str, int]:
        """Record what the verify accepted; returns the rejected draft count per request."""
        self.spec.stats.verify_seconds += seconds
        rejected = {}
        for req, _ in out.scheduled:
            draft = out.drafts.get(req.request_id)
            if draft is not None:
                accepted = len(sampled[req.request_id]) - 1
                rejected[req.request_id] = len(draft) - accepted
                self.spec.observe(req, len(draft), accepted)
        return rejected

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
        if status is None:
            max_tokens = p.max_tokens if p.max_tokens is not None else self.max_model_len
            if req.num_output_tokens >= max_tokens or req.num_tokens >= self.max_model_len:
                status = RequestStatus.FINISHED_LENGTH
        if status is not None:
            self.scheduler.finish_request(req, status)
            self.runner.release(req.request_id)

    def _output(self, group: _Group) -> RequestOutput:
        completions = [
            CompletionOutput(index=r.index, text=r.detokenizer.output_text, token_ids=r.output_token_ids,
                             logprobs=r.logprobs, finish_reason=r.finish_reason, stop_reason=r.stop_reason)
            for r in group.children
        ]
        cached = max(0, group.children[0].num_cached_tokens)
        return RequestOutput(group.request_id, group.prompt, group.prompt_token_ids, completions,
                             finished=group.finished, num_cached_tokens=cached)

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


def profile_forward(model, n: int, num_seqs: int, kv_heads: int, dtype: torch.dtype, dev: torch.device) -> None:
    """One forward of n tokens (no KV kept) and the logits of num_seqs rows: the activation peak."""
    from ember.kernels.metadata import AttentionMetadata

    mc = model.cfg
    caches = [torch.empty(2, 1, n, kv_heads, mc.head_dim, dtype=dtype, device=dev) for _ in range(mc.num_layers)]
    meta = AttentionMetadata(
        slot_mapping=torch.arange(n, device=dev), query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=dev),
        seq_lens=torch.tensor([n], dtype=torch.int32, device=dev), block_tables=torch.zeros(1, 1, dtype=torch.int32, device=dev),
        block_size=n, query_lens_cpu=[n], seq_lens_cpu=[n], max_query_len=n, max_seq_len=n)
    with torch.inference_mode():
        hidden = model(torch.zeros(n, dtype=torch.long, device=dev), torch.arange(n, device=dev), caches, meta)
        model.compute_logits(hidden[-num_seqs:])
