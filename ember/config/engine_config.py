"""EngineConfig: every engine flag flat, as the user gives it, and the sub-configs built from it.

Field names are vLLM's flag names in snake_case, so `LLM(max_num_batched_tokens=...)` and
`ember serve --max-num-batched-tokens ...` are the same knob; the CLI is generated from the
fields (ember.config.engine_args), grouped in `--help` by the sub-config each one feeds. Construction
validates every flag and groups them (vLLM's EngineArgs -> VllmConfig in one step):

    load_config       model, tokenizer, dtype, device, quantization, seed
    cache_config      block_size, kv_cache_dtype, kv_cache_memory, gpu_memory_utilization,
                      enable_prefix_caching
    scheduler_config  max_model_len, max_num_batched_tokens, max_num_seqs, enable_chunked_prefill
    executor_config   executor (enforce_eager folded in), cuda_graph_max_batch_size, compilation_config
    kernel_config     attention_backend, num_threads, the --cpu-* switches, int8_decode, int4_dense_copy
    parallel_config   tensor_parallel_size
    placement_config  cpu_moe, n_cpu_moe, moe_hot_cache_memory, ple_offload
    speculative       SpeculativeConfig, or None: six spellings of "speculate" folded into one
    structured        reasoning_parser, structured_outputs_config (read as they are)

The engine reads the sub-configs only. What each default was measured to buy is in docs/tuning.md.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field, fields
from typing import Any

from ember.config.aliases import ATTENTION_BACKEND_ALIASES, DTYPE_ALIASES, QUANTIZATION_ALIASES, SPEC_MODEL_MTP
from ember.config.groups import (
    ATTENTION_BACKENDS,
    CPU_KV_CAP_GIB,
    CPU_KV_FRACTION,
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_MAX_NUM_SEQS,
    DEVICES,
    EXECUTORS,
    KV_CACHE_DTYPES,
    QUANTIZATION_CHOICES,
    CacheConfig,
    ExecutorConfig,
    KernelConfig,
    LoadConfig,
    ParallelConfig,
    PlacementConfig,
    SchedulerConfig,
    check_reasoning_parser,
    need,
)
from ember.config.speculative import SpeculativeConfig, resolve_speculative_config
from ember.errors import ConfigError
from ember.platform import DTYPES

logger = logging.getLogger("ember")


def flag(default: Any, group: str, help: str, **more: Any):
    return field(default=default, metadata={"help": help, "group": group, **more})


def _derived():
    return field(default=None, init=False, repr=False, compare=False)


@dataclass
class EngineConfig:
    # -- load
    model: str | None = flag(None, "load", "HF model folder or .gguf file; default: the embedded SmolLM2-135M-Instruct")
    tokenizer: str | None = flag(None, "load", "tokenizer folder (default: the model's own)")
    dtype: str = flag(
        "auto",
        "load",
        "activation and weight dtype; auto = bfloat16 on CUDA or a CPU with "
        "AVX512-BF16, else float32 (vLLM's half / float are taken)",
        choices=DTYPES + tuple(DTYPE_ALIASES),
    )
    device: str = flag("auto", "load", "auto = cuda when available, else cpu", choices=DEVICES)
    quantization: str = flag(
        "auto",
        "load",
        "weight format: auto = what the checkpoint holds (awq for an AWQ folder, "
        "gguf = packed blocks for a .gguf file, else none); none on a .gguf "
        "dequantizes it to --dtype",
        choices=QUANTIZATION_CHOICES + tuple(QUANTIZATION_ALIASES),
    )
    seed: int = flag(0, "load", "global seed for unseeded sampling")
    # -- cache
    block_size: int = flag(16, "cache", "tokens per KV cache block")
    kv_cache_dtype: str = flag("auto", "cache", "KV cache element type (auto = --dtype)", choices=KV_CACHE_DTYPES)
    kv_cache_memory: float | None = flag(
        None,
        "cache",
        f"GiB for the KV cache on CPU (default: {CPU_KV_FRACTION:.0%} of "
        f"available RAM, at most {CPU_KV_CAP_GIB:g} GiB)",
    )
    gpu_memory_utilization: float = flag(0.9, "cache", "fraction of GPU memory ember may use (CUDA)")
    enable_prefix_caching: bool = flag(True, "cache", "reuse KV blocks of shared prompt prefixes")
    max_state_snapshots: int | None = flag(
        None,
        "cache",
        "hybrid models (Qwen3-Next, Qwen3.5): recurrent-state "
        "snapshots kept for prefix caching, from the KV budget "
        "(default: 2 x max_num_seqs; 0 = prefix hits off)",
    )
    # -- scheduler
    max_model_len: int | None = flag(
        None, "scheduler", "longest sequence (prompt + output); default: the model's context length"
    )
    max_num_batched_tokens: int | None = flag(
        None,
        "scheduler",
        "token budget of one step (decodes + prefill chunks); default "
        + ", ".join(
            f"{n} on {d.upper().replace('-AMX', ' with AMX')}" for d, n in DEFAULT_MAX_NUM_BATCHED_TOKENS.items()
        ),
    )
    max_num_seqs: int | None = flag(
        None,
        "scheduler",
        "most sequences in one step (default "
        + ", ".join(f"{n} on {d.upper()}" for d, n in DEFAULT_MAX_NUM_SEQS.items())
        + ")",
    )
    enable_chunked_prefill: bool = flag(True, "scheduler", "split long prompts over several steps")
    # -- executor
    enforce_eager: bool = flag(False, "executor", "never use CUDA graphs or torch.compile (= --executor eager)")
    executor: str = flag(
        "auto",
        "executor",
        "how a step's forward runs: eager; compiled = torch.compile of decode "
        "steps on CPU, at --compilation-config compile_sizes, compiled at start "
        "and cached by inductor; cuda-graph = captured CUDA graphs of decode "
        "steps. auto = on CPU compiled in the background (served eagerly until each "
        "graph is ready), on CUDA cuda-graph; eager with the torch backend, an "
        "fp8 KV cache or TP",
        choices=EXECUTORS,
    )
    cuda_graph_max_batch_size: int = flag(
        16,
        "executor",
        "largest decode batch captured as a CUDA graph (a batch is "
        "padded to the next captured size; larger ones run eagerly)",
    )
    compilation_config: dict[str, Any] | None = flag(
        None,
        "executor",
        "options of --executor compiled (JSON), after "
        'vLLM\'s: {"compile_sizes": [1, 2, 4], "mode": '
        '"max-autotune-no-cudagraphs", "freezing": null, "cpp_wrapper": '
        "true}; compile_sizes are decode batch sizes; freezing null = "
        "on for dense linear weights, off for quantized ones",
    )
    # -- kernels
    attention_backend: str = flag(
        "auto",
        "kernels",
        "attention kernels: torch = the reference, cpu = the reference "
        "with ember's C++ kernels, triton = GPU kernels; auto = triton on "
        "CUDA, cpu on CPU (other engines' names, e.g. flash2 or "
        "flashinfer, are taken with a note)",
        choices=ATTENTION_BACKENDS + tuple(ATTENTION_BACKEND_ALIASES),
    )
    num_threads: int | None = flag(None, "kernels", "CPU threads for torch (default: all cores)")
    cpu_paged_attention: bool = flag(
        True,
        "kernels",
        "CPU: fused C++ paged attention for decode and verify steps; off = the torch reference (gather + SDPA)",
    )
    cpu_flash_attention: bool = flag(
        True,
        "kernels",
        "CPU: prefill attention in a flash-style C++ kernel (bf16: AVX512-BF16; float32: AVX2 + FMA); off = blocked "
        "GEMMs for bf16, else SDPA",
    )
    cpu_tiled_gemv: bool = flag(
        True,
        "kernels",
        "CPU: GGUF 4- and 8-bit weights (and Q6_K in bf16) in row tiles for a C++ GEMV kernel; off = torch's int4 kernel",
    )
    cpu_half_weights: bool = flag(
        True,
        "kernels",
        "CPU, float32 (AVX2 + FMA + F16C): a GGUF file's BF16 / F16 matrices stay 16-bit for a C++ GEMV that "
        "widens them in registers (half the bytes in RAM and per decode step); off = widened to float32 at load",
    )
    cpu_int8_activations: bool = flag(
        True,
        "kernels",
        "CPU, bf16, AVX-512 VNNI: steps of many rows multiply packed "
        "GGUF weights by activations rounded to int8 per group of 32 "
        "(as llama.cpp); off = bf16 activations everywhere",
    )
    cpu_fused_elementwise: bool = flag(
        True, "kernels", "CPU, bf16: RMSNorm (+ residual), SiLU*up and RoPE in one pass each; off = the torch ops"
    )
    cpu_gated_delta_net: bool = flag(
        True,
        "kernels",
        "CPU, hybrid models (Qwen3.5, Qwen3-Next): Gated DeltaNet decode and verify steps in two fused C++ "
        "kernels (conv + SiLU, then the gated delta rule in place in the state's slot); off = the torch ops",
    )
    cpu_fp8_gemv: bool = flag(
        True,
        "kernels",
        "CPU (AVX2 + FMA + F16C): an FP8 checkpoint's block-scaled e4m3 weights decoded a tile at a time in a C++ "
        "GEMV (1 byte a weight per decode step); off = the torch reference, which dequantizes a layer per call",
    )
    cpu_block_gemv: bool = flag(
        True,
        "kernels",
        "CPU: a GGUF file's Q2_K, Q3_K and IQ matrices (and its MoE experts of those types) stay the file's own "
        "blocks for a C++ GEMV that rounds x to int8 per block as llama.cpp does; off = dequantized to dense at load",
    )
    int8_decode: bool | None = flag(
        None,
        "kernels",
        "CPU: an int8 weight-only copy of dense linears for decode-sized "
        "steps; default: on for a dequantized .gguf in bfloat16/float16",
    )
    int4_dense_copy: bool | None = flag(
        None,
        "kernels",
        "CPU: a dense copy of packed int4 weights (GGUF, AWQ) for "
        "steps of many rows; default: on where a layer needs it and it "
        "fits a tenth of free RAM",
    )
    # -- parallel
    tensor_parallel_size: int = flag(1, "parallel", "number of devices to shard the model over")
    # -- placement
    cpu_moe: bool = flag(
        False,
        "placement",
        "keep every MoE layer's routed experts in host memory, mapped from the file (read only where a step "
        "chooses them) and run on the CPU kernels (llama.cpp's --cpu-moe)",
    )
    n_cpu_moe: int | None = flag(
        None,
        "placement",
        "keep the routed experts of the first N MoE layers in host memory (as --cpu-moe), the rest on the device "
        "(llama.cpp's --n-cpu-moe)",
    )
    moe_hot_cache_memory: float | None = flag(
        None,
        "placement",
        "GiB of the device for copies of the most used experts of the layers kept in host memory (an LRU per "
        "layer and expert); default: what the KV cache leaves on CUDA, none on CPU; 0 = none",
    )
    ple_offload: bool | None = flag(
        None,
        "placement",
        "qwen4_exp: keep the n-gram table in host memory (the file) and copy each step's rows into its input; "
        "default: on where the table does not fit the device (on CPU: always)",
    )
    # -- speculative
    speculative_config: dict[str, Any] | None = flag(
        None,
        "speculative",
        "speculative decoding (JSON), as vLLM: "
        '{"method": "ngram", "num_speculative_tokens": 3, '
        '"prompt_lookup_min": 2, "prompt_lookup_max": 5}; methods ngram | '
        'mtp | draft; "disable_by_batch_size": N drafts nothing in steps '
        "of N or more running requests",
    )
    speculative_model: str | None = flag(
        None, "speculative", "draft for speculative decoding: 'ngram' (prompt lookup) or a model folder"
    )
    num_speculative_tokens: int | None = flag(
        None, "speculative", "draft tokens per step (1..8; the most, when adaptive)"
    )
    enable_mtp: bool | None = flag(
        None,
        "speculative",
        "speculate with MTP layers: the model's own, or "
        "--speculative-model DIR's; on by default for the default "
        "model's trained head (--no-enable-mtp turns it off)",
    )
    speculative_draft_tensor_parallel_size: int | None = flag(
        None, "speculative", "tensor parallel size of the draft model (1 or --tensor-parallel-size)"
    )
    adaptive_spec: bool = flag(
        True,
        "speculative",
        "per request, draft fewer tokens when few are accepted and more when most are (--no-adaptive-spec pins k)",
    )
    max_logprobs: int = flag(
        20,
        "scheduler",
        "most top logprobs a request may ask for (per token; -1 = no cap, so a "
        "request's -1, the whole vocabulary, is allowed)",
    )
    # -- structured outputs
    reasoning_parser: str | None = flag(
        None,
        "structured",
        "split <think>...</think> from the answer "
        "(reasoning_content) and start a structured-output "
        "constraint where the answer begins: qwen3 | deepseek_r1",
        choices=("qwen3", "deepseek_r1"),
    )
    structured_outputs_config: dict[str, Any] | None = flag(
        None,
        "structured",
        'vLLM\'s structured-output options (JSON): {"backend": "xgrammar"} (the one ember has; "auto" means it too)',
    )

    # -- the sub-configs, built from the flags above (read these, not the flags)
    load_config: LoadConfig = _derived()
    cache_config: CacheConfig = _derived()
    scheduler_config: SchedulerConfig = _derived()
    executor_config: ExecutorConfig = _derived()
    kernel_config: KernelConfig = _derived()
    parallel_config: ParallelConfig = _derived()
    placement_config: PlacementConfig = _derived()
    speculative: SpeculativeConfig | None = _derived()

    def __post_init__(self) -> None:
        for name in ("speculative_config", "compilation_config", "structured_outputs_config"):
            if isinstance(getattr(self, name), str):
                try:
                    setattr(self, name, json.loads(getattr(self, name)))
                except json.JSONDecodeError as e:
                    raise ConfigError(f"--{name.replace('_', '-')} is not valid JSON: {e}") from None
        if self.quantization is None:
            self.quantization = "auto"
        self._canonical_spellings()
        self.validate()

    def _canonical_spellings(self) -> None:
        """Values other engines (and older vLLM) spell differently, as ember's, each with a one-line note."""
        if isinstance(self.speculative_model, str) and self.speculative_model.strip().lower() in SPEC_MODEL_MTP:
            if self.enable_mtp is False:
                raise ConfigError(
                    f"--speculative-model {self.speculative_model} asks for MTP and --no-enable-mtp "
                    "turns it off; drop one of them"
                )
            logger.info(
                "ember: --speculative-model %s means --enable-mtp (the model's own MTP layers)", self.speculative_model
            )
            self.speculative_model, self.enable_mtp = None, True
        if self.dtype in DTYPE_ALIASES:
            self.dtype = DTYPE_ALIASES[self.dtype]
        if self.quantization in QUANTIZATION_ALIASES:
            logger.info(
                "ember: --quantization %s is vLLM's kernel choice for %s weights; ember runs them as --quantization %s",
                self.quantization,
                QUANTIZATION_ALIASES[self.quantization],
                QUANTIZATION_ALIASES[self.quantization],
            )
            self.quantization = QUANTIZATION_ALIASES[self.quantization]

    def validate(self) -> None:
        """Build the sub-configs from the flags (each checks its own), then the rules across them."""
        self.load_config = LoadConfig(
            model=self.model,
            tokenizer=self.tokenizer,
            dtype=self.dtype,
            device=self.device,
            quantization=self.quantization,
            seed=self.seed,
        )
        self.kernel_config = KernelConfig(
            attention_backend=self.attention_backend,
            num_threads=self.num_threads,
            paged_attention=self.cpu_paged_attention,
            flash_attention=self.cpu_flash_attention,
            tiled_gemv=self.cpu_tiled_gemv,
            half_weights=self.cpu_half_weights,
            int8_activations=self.cpu_int8_activations,
            fused_elementwise=self.cpu_fused_elementwise,
            gated_delta_net=self.cpu_gated_delta_net,
            fp8_gemv=self.cpu_fp8_gemv,
            block_gemv=self.cpu_block_gemv,
            int8_decode=self.int8_decode,
            int4_dense_copy=self.int4_dense_copy,
        )
        if self.attention_backend == "triton" and self.device == "cpu":
            from ember.config.attention import resolve_attention_backend

            resolve_attention_backend("triton", "cpu")  # refuses unless TRITON_INTERPRET=1, saying what to change
        self.cache_config = CacheConfig(
            block_size=self.block_size,
            kv_cache_dtype=self.kv_cache_dtype,
            kv_cache_memory=self.kv_cache_memory,
            gpu_memory_utilization=self.gpu_memory_utilization,
            enable_prefix_caching=self.enable_prefix_caching,
            max_state_snapshots=self.max_state_snapshots,
        )
        need(
            self.kv_cache_memory is None or self.device != "cuda",
            "--kv-cache-memory sizes the CPU KV cache; on CUDA use --gpu-memory-utilization",
        )
        self.scheduler_config = SchedulerConfig(
            max_model_len=self.max_model_len,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_num_seqs=self.max_num_seqs,
            enable_chunked_prefill=self.enable_chunked_prefill,
        )
        self.parallel_config = ParallelConfig(tensor_parallel_size=self.tensor_parallel_size)
        self._build_placement()
        self.speculative = resolve_speculative_config(self)  # None = no speculation
        self._check_structured()
        need(
            isinstance(self.max_logprobs, int) and self.max_logprobs >= -1,
            f"--max-logprobs must be an integer >= -1 (-1 = no cap), not {self.max_logprobs!r}",
        )
        if not isinstance(self.compilation_config, (dict, type(None))):
            raise ConfigError('--compilation-config must be a JSON object, e.g. {"compile_sizes": [1, 4]}')
        need(
            not (self.enforce_eager and self.executor not in ("auto", "eager")),
            f"--enforce-eager contradicts --executor {self.executor}; drop one of them",
        )
        self.executor_config = ExecutorConfig(
            executor="eager" if self.enforce_eager else self.executor,
            cuda_graph_max_batch_size=self.cuda_graph_max_batch_size,
            compilation=dict(self.compilation_config or {}),
        )
        if self.compilation_config is not None and not self.compilation_config:
            need(
                self.executor_config.executor in ("compiled", "auto"),
                "--compilation-config configures --executor compiled (and auto, which compiles on CPU in the "
                f"background); it contradicts --executor {self.executor_config.executor}: drop one of them",
            )

    def _build_placement(self) -> None:
        self.placement_config = PlacementConfig(
            cpu_moe=self.cpu_moe,
            n_cpu_moe=self.n_cpu_moe,
            moe_hot_cache_memory=self.moe_hot_cache_memory,
            ple_offload=self.ple_offload,
        )
        need(
            not (self.placement_config.keeps_experts_on_host and self.tensor_parallel_size > 1),
            "--cpu-moe / --n-cpu-moe keep experts in one host's memory; they do not combine with "
            "--tensor-parallel-size > 1: drop one of them",
        )

    def _check_structured(self) -> None:
        check_reasoning_parser(self.reasoning_parser)
        so = self.structured_outputs_config
        need(
            isinstance(so, (dict, type(None))),
            '--structured-outputs-config must be a JSON object, e.g. {"backend": "xgrammar"}',
        )
        unknown = sorted(set(so or {}) - {"backend", "reasoning_parser"})
        need(
            not unknown,
            f"--structured-outputs-config has {unknown}, which ember does not take; it takes backend "
            "and reasoning_parser",
        )
        backend = (so or {}).get("backend", "auto")
        need(
            backend in ("auto", "xgrammar"),
            f"--structured-outputs-config backend {backend!r}: ember's grammars "
            'are compiled by xgrammar; use "xgrammar" or "auto"',
        )
        nested = (so or {}).get("reasoning_parser")
        if nested is not None:
            need(
                self.reasoning_parser in (None, nested),
                f"--reasoning-parser {self.reasoning_parser} and "
                f"--structured-outputs-config reasoning_parser {nested} disagree; give one",
            )
            check_reasoning_parser(nested)
            self.reasoning_parser = nested

    @classmethod
    def field_names(cls) -> list[str]:
        """The flags (not the sub-configs built from them)."""
        return [f.name for f in fields(cls) if f.init]

    def flags(self) -> dict[str, Any]:
        """The flags as keyword arguments: EngineConfig(**config.flags()) rebuilds this config."""
        return {name: getattr(self, name) for name in self.field_names()}
