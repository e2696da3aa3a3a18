"""StepExecutor: how the runner's forward of one step runs. Same inputs, same outputs.

    hidden = executor.run(input_ids, positions, meta, select)

  eager       the model called directly (every step shape; the reference);
  compiled    CPU: torch.compile (inductor) of pure-decode steps at a few padded batch sizes
              (ember.engine.compiled_executor); every other step eager;
  cuda-graph  CUDA: captured graphs of decode-shaped steps, each request 1 + k query tokens,
              batch padded to the next captured size (ember.engine.cuda_graph_executor).

An executor only ever changes how the forward is run, never what it computes: the padding
and fixed-shape metadata live in ember.engine.decode_batch, the runner's sampling is untouched.

auto: cuda-graph on CUDA with a GPU attention backend, else eager (compiling costs minutes
cold, so CPU users opt in). Flags (vLLM's where it has one): --enforce-eager (= --executor eager), --executor,
--cuda-graph-max-batch-size, --compilation-config. vLLM's -O0 is eager; its default CUDA mode
(inductor + piecewise CUDA graphs) is closest to cuda-graph; it has no CPU compile of whole steps.
"""
from __future__ import annotations

from typing import Protocol

import torch

from ember.errors import ConfigError
from ember.kernels.metadata import AttentionMetadata, RowSelection

# cpp_wrapper: inductor calls its kernels from generated C++ instead of Python. Measured on the
# default model (compile_sizes [1], 256 greedy tokens after a 32-token prompt, 2 cores, two
# engines in one process, alternating, 6 prompts): batch-1 decode 214.7 -> 229.1 tok/s (median
# ratio 1.061); the cold compile takes ~1m45s instead of ~30 s per size, once (inductor caches it).
# Whoever opts into the compiled executor wants the speed, so it is on by default.
COMPILE_DEFAULTS = {"compile_sizes": [1, 2, 4], "mode": "max-autotune-no-cudagraphs", "freezing": True,
                    "cpp_wrapper": True}


class StepExecutor(Protocol):
    name: str

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
            select: RowSelection | None = None) -> torch.Tensor:
        """input_ids, positions [T] -> final-normed hidden [T, H] (or [R, H] for select.rows)."""
        ...


class EagerExecutor:
    name = "eager"

    def __init__(self, model: torch.nn.Module, kv_caches: list[torch.Tensor]):
        self.model, self.kv_caches = model, kv_caches

    def run(self, input_ids, positions, meta, select=None):
        return self.model(input_ids, positions, self.kv_caches, meta, select)


def validate_executor_config(config) -> None:
    """Checks that need no device (EngineConfig.validate calls this); resolve_executor does the rest."""
    from ember.config import EXECUTORS

    if config.executor not in EXECUTORS:
        raise ConfigError(f"--executor {config.executor!r} is not one of {', '.join(EXECUTORS)}")
    if config.enforce_eager and config.executor not in ("auto", "eager"):
        raise ConfigError(f"--enforce-eager contradicts --executor {config.executor}; drop one of them")
    if config.cuda_graph_max_batch_size < 1:
        raise ConfigError(f"--cuda-graph-max-batch-size must be >= 1 (got {config.cuda_graph_max_batch_size})")
    cc = config.compilation_config
    if cc is not None:
        if not isinstance(cc, dict):
            raise ConfigError('--compilation-config must be a JSON object, e.g. {"compile_sizes": [1, 4]}')
        unknown = set(cc) - set(COMPILE_DEFAULTS)
        if unknown:
            raise ConfigError(f"--compilation-config has unknown keys {sorted(unknown)}; known: {', '.join(COMPILE_DEFAULTS)}")
        sizes = cc.get("compile_sizes", COMPILE_DEFAULTS["compile_sizes"])
        if not (isinstance(sizes, list) and sizes and all(isinstance(s, int) and s >= 1 for s in sizes)):
            raise ConfigError(f"--compilation-config compile_sizes must be a non-empty list of batch sizes >= 1 (got {sizes!r})")
        for flag in ("freezing", "cpp_wrapper"):
            if flag in cc and not isinstance(cc[flag], bool):
                raise ConfigError(f"--compilation-config {flag} must be true or false (got {cc[flag]!r})")
        if config.executor != "compiled":
            raise ConfigError("--compilation-config configures --executor compiled; add --executor compiled or drop it")


def resolve_executor(config, device: torch.device, kv_dtype: torch.dtype | None = None,
                     backend_name: str | None = None) -> str:
    """The executor name for this device, or a ConfigError for a combination that cannot work.
    backend_name: the attention backend the model was built with (default: the config's)."""
    name = config.executor
    if config.enforce_eager or name == "eager":
        return "eager"
    tp = getattr(config, "tensor_parallel_size", 1)
    if name == "auto":
        # Not with the torch reference backend: captured, its decode reads the fixed max_model_len
        # bound of keys for every sequence, each step (slower than eager for short sequences).
        # Not under tensor parallelism: the workers replay each forward eagerly.
        graphs = device.type == "cuda" and (backend_name or config.attention_backend) != "torch" and tp == 1
        return "cuda-graph" if graphs else "eager"
    if tp > 1:
        raise ConfigError(f"--executor {name} does not run under --tensor-parallel-size {tp} yet (the workers replay "
                          "every forward eagerly); use --executor eager (or auto)")
    if name == "cuda-graph" and device.type != "cuda":
        raise ConfigError(f"--executor cuda-graph needs a CUDA device, and this engine runs on {device.type}; "
                          "on CPU use --executor compiled (torch.compile) or eager")
    if name == "compiled":
        if device.type != "cpu":
            raise ConfigError("--executor compiled is the CPU path (torch.compile of decode steps); "
                              "on CUDA use --executor cuda-graph (the default) or eager")
        if kv_dtype is not None and kv_dtype.itemsize == 1:
            raise ConfigError("--executor compiled supports --kv-cache-dtype auto only (an fp8 cache calibrates its "
                              "scales on the first step, which a compiled graph would freeze); drop one of them")
    return name


def compile_options(config, max_num_seqs: int) -> dict:
    """--compilation-config with defaults; sizes above max_num_seqs are dropped (never used)."""
    cc = dict(COMPILE_DEFAULTS) | dict(config.compilation_config or {})
    sizes = sorted({min(s, max_num_seqs) for s in cc["compile_sizes"]})
    return cc | {"compile_sizes": sizes}


def build_executor(name: str, engine, runner) -> StepExecutor:
    """The runner's executor; compiled and cuda-graph compile or capture here, at startup."""
    if name == "eager":
        return EagerExecutor(runner.model, runner.kv_caches)
    if name == "compiled":
        from ember.engine.compiled_executor import CompiledExecutor

        cc = compile_options(engine.config, engine.max_num_seqs)
        k_max = engine.spec.k_max if engine.spec is not None else 0
        adaptive = engine.spec is not None and engine.spec.config.adaptive
        return CompiledExecutor(runner.model, runner.kv_caches, runner.block_size, engine.max_model_len,
                                cc["compile_sizes"], cc["mode"], cc["freezing"], cc["cpp_wrapper"],
                                compiled_query_lens(k_max, attention_backend_of(runner.model), adaptive))
    from ember.engine.cuda_graph_executor import CUDAGraphExecutor

    return CUDAGraphExecutor(runner.model, runner.kv_caches, runner.block_size, engine.max_model_len,
                             engine.cuda_graph_max_batch, engine.graph_query_lens(), runner.device)


def graph_query_lens(k_max: int, backend) -> list[int]:
    """Query lengths to capture: 1 (plain decode), and 1 + k when speculating with k drafts and
    the attention backend runs that from fixed-shape metadata (fixed_shape_max_query_len)."""
    if k_max >= 1 and getattr(backend, "fixed_shape_max_query_len", 1) >= 1 + k_max:
        return [1, 1 + k_max]
    return [1]


def compiled_query_lens(k_max: int, backend, adaptive: bool = False) -> list[int]:
    """Query lengths the CPU compiled executor builds graphs for: 1, and 1 + k when speculating
    with k drafts and the backend's fused CPU kernel runs that from fixed-shape metadata; with
    adaptive k, every 1 + k for k in 1..k_max (a request's k moves with its acceptance)."""
    from ember.kernels.cpu_paged_attention import paged_attention_op

    fused = getattr(backend, "fused_decode", False) and paged_attention_op() is not None
    if k_max >= 1 and fused and getattr(backend, "fused_fixed_shape_max_query_len", 1) >= 1 + k_max:
        return list(range(1, k_max + 2)) if adaptive else [1, 1 + k_max]
    return [1]


def attention_backend_of(model: torch.nn.Module):
    from ember.layers.attention import Attention

    return next((m.backend for m in model.modules() if isinstance(m, Attention)), None)
