"""The engine's sub-configs: one frozen dataclass per concern, built from the flat flags.

EngineConfig (engine_config.py) holds the flags as the user gave them; `build_groups` turns
them into these, validated, and the engine reads only these (vLLM's VllmConfig shape). Each
group's defaults and limits live next to it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ember.config.aliases import ATTENTION_BACKEND_ALIASES
from ember.errors import ConfigError
from ember.platform import DTYPES, has_cpu_flags

# bfloat16: a 16-bit cache under float32 activations (half the bytes a token; the values round to bf16 as
# they are stored, attention widens them exactly), vLLM's name for it
KV_CACHE_DTYPES = ("auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2")
DEVICES = ("auto", "cpu", "cuda")
EXECUTORS = ("auto", "eager", "compiled", "cuda-graph")
# torch = the reference (SDPA over gathered blocks), cpu = the reference plus ember's C++ kernels,
# triton = the GPU kernels (on CPU only under TRITON_INTERPRET=1, which is how the tests run them)
ATTENTION_BACKENDS = ("auto", "torch", "cpu", "triton")
QUANTIZATION_CHOICES = ("auto", "none", "awq", "gguf", "fp8")
# Default CPU KV budget: this fraction of available RAM, capped (the pool is allocated up front).
CPU_KV_FRACTION = 0.2
CPU_KV_CAP_GIB = 2.0
CPU_DENSE_COPY_FRACTION = 0.1  # --int4-dense-copy auto: on when the copy takes at most this share of free RAM
# --executor compiled's options (--compilation-config overrides them); docs/tuning.md has the figures
# freezing None: auto, on for models with dense linears, off for quantized ones (ember.engine.executor.compiled.auto_freezing)
COMPILE_DEFAULTS = {
    "compile_sizes": [1, 2, 4],
    "mode": "max-autotune-no-cudagraphs",
    "freezing": None,
    "cpp_wrapper": True,
}


# --reasoning-parser values (ember.structured.reasoning splits their <think>...</think>)
REASONING_PARSERS = ("qwen3", "deepseek_r1")


def check_reasoning_parser(name: str | None) -> None:
    if name is not None and name not in REASONING_PARSERS:
        raise ConfigError(
            f"--reasoning-parser {name!r} is not one ember has; use one of {', '.join(REASONING_PARSERS)}"
        )


def need(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def one_of(value: object, choices: tuple, flag: str) -> None:
    need(value in choices, f"{flag} {value!r} is not one of {', '.join(choices)}")


@dataclass(frozen=True, kw_only=True)
class LoadConfig:
    """What to load and in which form."""

    model: str | None  # None: the embedded default model
    tokenizer: str | None
    dtype: str  # as given; `auto` is resolved on the device (ember.platform.resolve_dtype_name)
    device: str
    quantization: str
    seed: int

    def __post_init__(self) -> None:
        one_of(self.dtype, DTYPES, "--dtype")
        one_of(self.device, DEVICES, "--device")
        one_of(self.quantization, QUANTIZATION_CHOICES, "--quantization")


@dataclass(frozen=True, kw_only=True)
class CacheConfig:
    """The paged KV pool."""

    block_size: int
    kv_cache_dtype: str
    kv_cache_memory: float | None  # GiB on CPU; None: CPU_KV_FRACTION of free RAM, at most CPU_KV_CAP_GIB
    gpu_memory_utilization: float
    enable_prefix_caching: bool
    max_state_snapshots: int | None = None  # hybrid models; None: 2 x max_num_seqs

    def state_snapshots(self, max_num_seqs: int) -> int:
        """Snapshot slots beside the live ones. Default: two per sequence the engine runs at once. Each
        running request keeps its newest snapshot (its head) while it prefills and decodes, so max_num_seqs
        slots go to the requests in flight, and the other max_num_seqs keep finished conversations'
        deepest states. With one per sequence, a burst of 16 concurrent prompts evicts heads to take
        heads, GreedyDual's clock climbs by an interval snapshot's ~256 tokens each time, and a 4K-token
        conversation's end is gone within 32 requests (tests/engine/test_state_slots.py's simulation:
        0 tokens hit with 8, 12 or 16 slots, 4,111 with 32). Each slot is a whole fp32 state (18.6 MiB
        for Qwen3.5-0.8B), taken from the cache budget and resident from the start, like the KV pool."""
        if not self.enable_prefix_caching:
            return 0
        return 2 * max_num_seqs if self.max_state_snapshots is None else self.max_state_snapshots

    def __post_init__(self) -> None:
        one_of(self.kv_cache_dtype, KV_CACHE_DTYPES, "--kv-cache-dtype")
        if self.max_state_snapshots is not None:
            need(self.max_state_snapshots >= 0, f"--max-state-snapshots must be >= 0 (got {self.max_state_snapshots})")
        need(
            self.block_size >= 1 and self.block_size & (self.block_size - 1) == 0,
            f"--block-size must be a power of two (got {self.block_size}); 16 is the default",
        )
        if self.kv_cache_memory is not None:
            need(self.kv_cache_memory > 0, f"--kv-cache-memory must be > 0 GiB (got {self.kv_cache_memory})")
        need(
            0 < self.gpu_memory_utilization <= 1,
            f"--gpu-memory-utilization must be in (0, 1] (got {self.gpu_memory_utilization})",
        )


# --max-num-seqs when not given, per device type: CPU steps are bandwidth-bound from a few rows,
# a GPU's take many sequences before they cost more than one
DEFAULT_MAX_NUM_SEQS = {"cpu": 16, "cuda": 64}
# --max-num-batched-tokens when not given. A CPU process keeps what a step frees in its heap
# (engine/startup/cpu_malloc.py), so the largest prefill chunk's transients stay in its resident set: 512
# tokens (llama.cpp's n_ubatch) bound them, and on AVX2 prefill runs as fast in 512-token chunks as in
# one (its kernels are at full speed from a few hundred rows). CPUs with AMX keep 2048: their attention
# runs long chunks as AMX GEMMs, and 512-token chunks took a 2,000-token prompt 25% longer. Measured on
# 2 Xeon cores (docs/tuning.md, "The step budget on CPU").
DEFAULT_MAX_NUM_BATCHED_TOKENS = {"cpu": 512, "cpu-amx": 2048, "cuda": 2048}


def default_token_budget(device_type: str) -> int:
    """DEFAULT_MAX_NUM_BATCHED_TOKENS of this device type (and, on CPU, of its AMX flag)."""
    if device_type == "cpu" and has_cpu_flags("amx_bf16"):
        return DEFAULT_MAX_NUM_BATCHED_TOKENS["cpu-amx"]
    return DEFAULT_MAX_NUM_BATCHED_TOKENS[device_type]


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    """The step's token budget and who shares it."""

    max_model_len: int | None  # None: the model's context length
    max_num_batched_tokens: int | None  # None: default_token_budget of the device (see token_budget)
    max_num_seqs: int | None  # None: DEFAULT_MAX_NUM_SEQS of the device type
    enable_chunked_prefill: bool

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens is not None:
            need(
                self.max_num_batched_tokens >= 1,
                f"--max-num-batched-tokens must be >= 1 (got {self.max_num_batched_tokens})",
            )
        if self.max_num_seqs is not None:
            need(self.max_num_seqs >= 1, f"--max-num-seqs must be >= 1 (got {self.max_num_seqs})")
            if self.max_num_batched_tokens is not None:
                self._check_budget(self.max_num_seqs, self.max_num_batched_tokens)
        if self.max_model_len is not None:
            need(self.max_model_len >= 2, f"--max-model-len must be >= 2 (got {self.max_model_len})")
            if not self.enable_chunked_prefill and self.max_num_batched_tokens is not None:
                need(
                    self.max_num_batched_tokens >= self.max_model_len,
                    f"with chunked prefill off, --max-num-batched-tokens ({self.max_num_batched_tokens}) must be >= "
                    f"--max-model-len ({self.max_model_len}) so any prompt fits one step; raise the budget, lower "
                    "--max-model-len, or drop --no-enable-chunked-prefill",
                )

    def token_budget(self, device_type: str, max_model_len: int | None = None) -> int:
        """--max-num-batched-tokens, or its default on this device: at least --max-num-seqs (a token each)
        and, with chunked prefill off, max_model_len (any prompt fits one step), as vLLM raises it."""
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        n = max(default_token_budget(device_type), self.max_num_seqs or 0)
        if not self.enable_chunked_prefill:
            n = max(n, max_model_len or self.max_model_len or 0)
        return n

    def default_max_num_seqs(self, device_type: str) -> int:
        """--max-num-seqs, or its default on this device type; refused when the step budget cannot give
        each of them a token."""
        n = self.max_num_seqs or DEFAULT_MAX_NUM_SEQS[device_type]
        self._check_budget(n, self.token_budget(device_type))
        return n

    def _check_budget(self, max_num_seqs: int, budget: int) -> None:
        need(
            max_num_seqs <= budget,
            f"--max-num-seqs {max_num_seqs} exceeds --max-num-batched-tokens {budget}: "
            "every running sequence needs at least one token of the step budget; raise the budget or lower "
            "--max-num-seqs",
        )


@dataclass(frozen=True, kw_only=True)
class ExecutorConfig:
    """How a step's forward runs: eager, compiled (CPU torch.compile) or cuda-graph."""

    executor: str  # --enforce-eager folded in as "eager"
    cuda_graph_max_batch_size: int
    compilation: dict[str, Any] = field(default_factory=dict)  # --compilation-config as given

    def __post_init__(self) -> None:
        one_of(self.executor, EXECUTORS, "--executor")
        need(
            self.cuda_graph_max_batch_size >= 1,
            f"--cuda-graph-max-batch-size must be >= 1 (got {self.cuda_graph_max_batch_size})",
        )
        cc = self.compilation
        if not cc:
            return
        unknown = set(cc) - set(COMPILE_DEFAULTS)
        need(
            not unknown,
            f"--compilation-config has unknown keys {sorted(unknown)}; known: {', '.join(COMPILE_DEFAULTS)}",
        )
        sizes = cc.get("compile_sizes", COMPILE_DEFAULTS["compile_sizes"])
        need(
            isinstance(sizes, list) and sizes and all(isinstance(s, int) and s >= 1 for s in sizes),
            f"--compilation-config compile_sizes must be a non-empty list of batch sizes >= 1 (got {sizes!r})",
        )
        need(
            cc.get("freezing") is None or isinstance(cc["freezing"], bool),
            f"--compilation-config freezing must be true, false or null (auto) (got {cc.get('freezing')!r})",
        )
        for flag in ("cpp_wrapper",):
            need(
                flag not in cc or isinstance(cc[flag], bool),
                f"--compilation-config {flag} must be true or false (got {cc.get(flag)!r})",
            )
        need(
            self.executor in ("compiled", "auto"),
            "--compilation-config configures --executor compiled (and auto, which compiles on CPU in the "
            f"background); it contradicts --executor {self.executor}: drop one of them",
        )

    def compile_options(self, max_num_seqs: int) -> dict[str, Any]:
        """--compilation-config with defaults; sizes above max_num_seqs are dropped (never used)."""
        cc = dict(COMPILE_DEFAULTS) | dict(self.compilation)
        return cc | {"compile_sizes": sorted({min(s, max_num_seqs) for s in cc["compile_sizes"]})}


@dataclass(frozen=True, kw_only=True)
class KernelConfig:
    """Which kernels run: the attention backend, CPU threads, and the CPU fast paths (each on by
    default where the machine can run it; off = the torch ops, for measuring what each one buys)."""

    attention_backend: str
    num_threads: int | None
    paged_attention: bool  # fused C++ paged attention for decodes and verifies
    flash_attention: bool  # flash-style C++ causal attention for bf16 / float32 prefill
    tiled_gemv: bool  # GGUF 4/8-bit weights in the tiled GEMV's layout
    half_weights: bool  # GGUF BF16 / F16 matrices kept 16-bit under float32 activations
    int8_activations: bool  # its int8-x path for many-row steps (AVX-512 VNNI)
    fused_elementwise: bool  # RMSNorm, SiLU*up and RoPE in one pass each (bf16)
    gated_delta_net: bool  # Gated DeltaNet decode / verify steps in fused C++ kernels (hybrid models)
    fp8_gemv: bool  # an FP8 checkpoint's block-scaled e4m3 weights in a C++ GEMV (cpu_fp8_gemv)
    block_gemv: bool  # GGUF types with no tiled form (Q2_K, Q3_K, IQ*) and MoE experts on the file's blocks
    int8_decode: bool | None  # an int8 copy of dense weights for decode (None: auto)
    int4_dense_copy: bool | None  # a dense copy of packed weights for many-row steps (None: auto)

    def __post_init__(self) -> None:
        one_of(self.attention_backend, ATTENTION_BACKENDS + tuple(ATTENTION_BACKEND_ALIASES), "--attention-backend")
        if self.num_threads is not None:
            need(self.num_threads >= 1, f"--num-threads must be >= 1 (got {self.num_threads})")


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    tensor_parallel_size: int

    def __post_init__(self) -> None:
        # >= 1 here; whether the model's heads split that way is checked at start (ember.engine.tp.config)
        need(
            isinstance(self.tensor_parallel_size, int) and self.tensor_parallel_size >= 1,
            f"--tensor-parallel-size must be an integer >= 1 (got {self.tensor_parallel_size!r})",
        )


@dataclass(frozen=True, kw_only=True)
class PlacementConfig:
    """Where a MoE model's routed experts and qwen4_exp's n-gram table live (ember.layers.expert_placement):
    llama.cpp's --cpu-moe (every MoE layer's experts in host memory) and --n-cpu-moe N (the first N MoE
    layers'), the device's hot-expert cache, and --ple-offload. What depends on the model (does it have MoE
    layers, a table) is checked at start, once its config is read."""

    cpu_moe: bool
    n_cpu_moe: int | None
    moe_hot_cache_memory: float | None  # GiB; None: what the KV cache leaves on CUDA, none on CPU
    ple_offload: bool | None  # None: offload where the table does not fit the device

    def __post_init__(self) -> None:
        if self.n_cpu_moe is not None:
            need(
                isinstance(self.n_cpu_moe, int) and self.n_cpu_moe >= 0,
                f"--n-cpu-moe takes a number of MoE layers >= 0 (got {self.n_cpu_moe!r})",
            )
        need(
            not (self.cpu_moe and self.n_cpu_moe is not None),
            f"--cpu-moe keeps every MoE layer's experts in host memory and --n-cpu-moe {self.n_cpu_moe} the first "
            f"{self.n_cpu_moe}: give one of them",
        )
        if self.moe_hot_cache_memory is not None:
            need(
                self.moe_hot_cache_memory >= 0,
                f"--moe-hot-cache-memory must be >= 0 GiB (got {self.moe_hot_cache_memory})",
            )
            need(
                self.moe_hot_cache_memory == 0 or self.keeps_experts_on_host,
                "--moe-hot-cache-memory sizes the device's cache of experts kept in host memory; "
                "pass --cpu-moe or --n-cpu-moe N with it",
            )

    @property
    def keeps_experts_on_host(self) -> bool:
        return self.cpu_moe or bool(self.n_cpu_moe)

    def host_moe_layers(self, num_moe_layers: int) -> int:
        """How many of the model's MoE layers (the first ones) keep their experts in host memory."""
        if self.cpu_moe:
            return num_moe_layers
        return min(self.n_cpu_moe or 0, num_moe_layers)
