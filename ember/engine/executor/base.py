"""StepExecutor: how the runner's forward of one step runs. Same inputs, same outputs.

    hidden = executor.run(input_ids, positions, meta, select)

  eager       the model called directly (every step shape; the reference);
  compiled    CPU: torch.compile (inductor) of pure-decode steps at a few padded batch sizes
              (ember.engine.executor.compiled); every other step eager;
  cuda-graph  CUDA: captured graphs of decode-shaped steps, each request 1 + k query tokens,
              batch padded to the next captured size (ember.engine.executor.cuda_graph).

An executor only ever changes how the forward is run, never what it computes: the padding
and fixed-shape metadata live in ember.engine.executor.decode_batch, the runner's sampling is untouched.

auto: cuda-graph on CUDA with a GPU attention backend; on CPU with ember's C++ kernels (the cpu
attention backend) compiled, built in the background while the engine serves eagerly
(ember.engine.executor.background_compile: a cold compile costs minutes, and the engine answers at once);
else eager. EMBER_AUTO_COMPILE=0 makes auto eager on CPU (for scripts that start many short-lived
engines, such as the test suite). Flags (vLLM's where it has one; ember.config.ExecutorConfig):
--enforce-eager (= --executor eager), --executor, --cuda-graph-max-batch-size, --compilation-config.
vLLM's -O0 is eager; its default CUDA mode (inductor + piecewise CUDA graphs) is closest to
cuda-graph; it has no CPU compile of whole steps.
"""

from __future__ import annotations

import os
from typing import Protocol

import torch

from ember.errors import ConfigError
from ember.kernels.attention_backend import AttentionBackend, fixed_shape_query_lens
from ember.kernels.metadata import AttentionMetadata, RowSelection


class StepExecutor(Protocol):
    name: str

    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        select: RowSelection | None = None,
    ) -> torch.Tensor:
        """input_ids, positions [T] -> final-normed hidden [T, H] (or [R, H] for select.rows)."""
        ...

    def sibling(
        self, model: torch.nn.Module, kv_caches: list[torch.Tensor], row_inputs: tuple = (), what: str = ""
    ) -> "StepExecutor | None":
        """An executor of this kind, sizes and query lengths for another module in the model's call
        shape (the MTP fill), or None where it would run eagerly anyway."""
        ...


class EagerExecutor:
    name = "eager"

    def __init__(self, model: torch.nn.Module, kv_caches: list[torch.Tensor]):
        self.model, self.kv_caches = model, kv_caches

    def run(self, input_ids, positions, meta, select=None):
        return self.model(input_ids, positions, self.kv_caches, meta, select)

    def sibling(self, model, kv_caches, row_inputs=(), what: str = "") -> None:
        """An executor like this one for another module (a drafter's step): eager needs none."""
        return None


def resolve_executor(
    config,
    device: torch.device,
    kv_dtype: torch.dtype | None = None,
    backend: AttentionBackend | None = None,
    hybrid_blocker: str | None = None,
) -> str:
    """The executor name for this device (an EngineConfig's executor_config), or a ConfigError for a
    combination that cannot work. backend: the attention backend the model was built with, whose
    declared graph_devices say where auto builds graphs for it (None: the device's default, which does);
    hybrid_blocker: why a hybrid model's steps cannot run in graphs here (startup.limits.hybrid_blocker;
    None: they can, as a dense model's do, or the model is not a hybrid)."""
    name = config.executor_config.executor
    if name == "eager":
        return "eager"
    if hybrid_blocker is not None:
        if name != "auto":
            raise ConfigError(
                f"--executor {name} cannot run this model: {hybrid_blocker}; use --executor eager (or auto)"
            )
        return "eager"
    tp = config.parallel_config.tensor_parallel_size
    if name == "auto":
        # Graphs only where the backend declares its decode fit for them (graph_devices). Not under
        # tensor parallelism: the workers replay each forward eagerly. Not with an fp8 cache on CPU
        # (its scales calibrate on the first step).
        graphs = backend is None or device.type in backend.graph_devices
        if device.type == "cuda":
            return "cuda-graph" if graphs and tp == 1 else "eager"
        compiled = (
            device.type == "cpu"
            and graphs
            and tp == 1
            and (kv_dtype is None or kv_dtype.itemsize > 1)
            and os.environ.get("EMBER_AUTO_COMPILE", "1") != "0"
        )
        return "compiled" if compiled else "eager"
    if tp > 1:
        raise ConfigError(
            f"--executor {name} does not run under --tensor-parallel-size {tp} yet (the workers replay "
            "every forward eagerly); use --executor eager (or auto)"
        )
    if name == "cuda-graph" and device.type != "cuda":
        raise ConfigError(
            f"--executor cuda-graph needs a CUDA device, and this engine runs on {device.type}; "
            "on CPU use --executor compiled (torch.compile) or eager"
        )
    if name == "compiled":
        if device.type != "cpu":
            raise ConfigError(
                "--executor compiled is the CPU path (torch.compile of decode steps); "
                "on CUDA use --executor cuda-graph (the default) or eager"
            )
        if kv_dtype is not None and kv_dtype.itemsize == 1:
            raise ConfigError(
                "--executor compiled supports --kv-cache-dtype auto only (an fp8 cache calibrates its "
                "scales on the first step, which a compiled graph would freeze); drop one of them"
            )
    return name


def build_executor(
    name: str,
    runner,
    *,
    max_model_len: int,
    compile_options: dict,
    cuda_graph_max_batch: int,
    query_lens: list[int],
    compiler=None,
    graph_identity: str | None = None,
    package_workers=None,
) -> StepExecutor:
    """The runner's executor; compiled and cuda-graph compile or capture here, at startup, except
    compiled with a BackgroundCompiler (`compiler`), which compiles while the engine serves.
    query_lens: the uniform query lengths to build graphs for (graph_query_lens / compiled_query_lens).
    package_workers: where compiled's AOTInductor packages are built (None: in this process)."""
    if name == "eager":
        return EagerExecutor(runner.model, runner.kv_caches)
    if name == "compiled":
        from ember.engine.executor.compiled import CompiledExecutor, auto_freezing

        cc = compile_options
        freezing = auto_freezing(runner.model) if cc["freezing"] is None else cc["freezing"]
        return CompiledExecutor(
            runner.model,
            runner.kv_caches,
            runner.block_size,
            max_model_len,
            cc["compile_sizes"],
            cc["mode"],
            freezing,
            cc["cpp_wrapper"],
            query_lens,
            compiler=compiler,
            graph_identity=graph_identity,
            package_workers=package_workers,
        )
    from ember.engine.executor.cuda_graph import CUDAGraphExecutor

    return CUDAGraphExecutor(
        runner.model,
        runner.kv_caches,
        runner.block_size,
        max_model_len,
        cuda_graph_max_batch,
        query_lens,
        runner.device,
    )


def graph_query_lens(k_max: int, backend) -> list[int]:
    """Query lengths CUDA graphs are captured for: 1 (plain decode), and 1 + k when speculating with k
    drafts and the attention backend runs that from fixed-shape metadata."""
    return fixed_shape_query_lens(k_max, backend)


def compiled_query_lens(k_max: int, backend, adaptive: bool = False) -> list[int]:
    """Query lengths the CPU compiled executor builds graphs for: as graph_query_lens, and with
    adaptive k every 1 + k for k in 1..k_max (a request's k moves with its acceptance)."""
    return fixed_shape_query_lens(k_max, backend, every_k=adaptive)
