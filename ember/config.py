"""EngineConfig: every knob, its default, and validation with messages that say what to change.

Field names are vLLM's flag names in snake_case, so `LLM(max_num_batched_tokens=...)` and
`ember serve --max-num-batched-tokens ...` are the same knob; the CLI is generated from
this dataclass.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, fields
from typing import Any

from ember.errors import ConfigError
from ember.kernels import ATTENTION_BACKENDS
from ember.quant import QUANTIZATION_CHOICES

DTYPES = ("auto", "float32", "bfloat16", "float16")
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
DEVICES = ("auto", "cpu", "cuda")
EXECUTORS = ("auto", "eager", "compiled", "cuda-graph")
# Default CPU KV budget: this fraction of available RAM, capped (the pool is allocated up front).
CPU_KV_FRACTION = 0.2
CPU_DENSE_COPY_FRACTION = 0.1  # --int4-dense-copy auto: on when the copy takes at most this share of free RAM
CPU_KV_CAP_GIB = 2.0


@dataclass
class EngineConfig:
    model: str | None = field(default=None, metadata={"help": "HF model folder or .gguf file; default: the embedded SmolLM2-135M-Instruct"})
    tokenizer: str | None = field(default=None, metadata={"help": "tokenizer folder (default: the model's own)"})
    dtype: str = field(default="auto", metadata={"help": "auto = bfloat16 on CUDA or a CPU with AVX512-BF16, else float32", "choices": DTYPES})
    device: str = field(default="auto", metadata={"help": "auto = cuda when available, else cpu", "choices": DEVICES})
    max_model_len: int | None = field(default=None, metadata={"help": "longest sequence (prompt + output); default: the model's context length"})
    block_size: int = field(default=16, metadata={"help": "tokens per KV cache block"})
    kv_cache_memory: float | None = field(default=None, metadata={"help": f"GiB for the KV cache on CPU (default: {CPU_KV_FRACTION:.0%} of available RAM, at most {CPU_KV_CAP_GIB:g} GiB)"})
    gpu_memory_utilization: float = field(default=0.9, metadata={"help": "fraction of GPU memory ember may use (CUDA)"})
    kv_cache_dtype: str = field(default="auto", metadata={"help": "KV cache element type", "choices": KV_CACHE_DTYPES})
    max_num_batched_tokens: int = field(default=2048, metadata={"help": "token budget of one step (decodes + prefill chunks)"})
    max_num_seqs: int | None = field(default=None, metadata={"help": "most sequences in one step (default 16 on CPU, 64 on CUDA)"})
    enable_chunked_prefill: bool = field(default=True, metadata={"help": "split long prompts over several steps"})
    enable_prefix_caching: bool = field(default=True, metadata={"help": "reuse KV blocks of shared prompt prefixes"})
    enforce_eager: bool = field(default=False, metadata={"help": "never use CUDA graphs or torch.compile (= --executor eager; vLLM's flag)"})
    executor: str = field(default="auto", metadata={"help": "how a step's forward runs: eager; compiled = torch.compile (inductor) of pure-decode steps on CPU, batch sizes padded to --compilation-config compile_sizes, each size compiled at startup (about 1-1.5 min cold on the default model, seconds from the inductor cache, which is torch's default cache dir: /tmp/torchinductor_$USER or $TORCHINDUCTOR_CACHE_DIR, kept across runs); cuda-graph = CUDA graphs of decode-shaped steps up to --cuda-graph-max-batch-size. auto = cuda-graph on CUDA with a GPU attention backend (not the torch reference, whose captured decode reads max_model_len keys per sequence), else eager. vLLM: --enforce-eager / -O0 = eager; its default CUDA mode (compile + CUDA graphs) is closest to cuda-graph", "choices": EXECUTORS})
    cuda_graph_max_batch_size: int = field(default=16, metadata={"help": "largest decode batch captured as a CUDA graph (sizes 1, 2, 4, 8, 16, 24, ... up to it; a batch is padded to the next one, larger batches run eagerly). Graph memory comes out of --gpu-memory-utilization"})
    compilation_config: dict[str, Any] | None = field(default=None, metadata={"help": 'options of --executor compiled (JSON), after vLLM\'s --compilation-config: {"compile_sizes": [1, 2, 4], "mode": "max-autotune-no-cudagraphs", "freezing": true, "cpp_wrapper": true}; cpp_wrapper = inductor generates a C++ wrapper (about +6% batch-1 decode on the default model; ~1m45s cold compile per size instead of ~30 s, then cached); compile_sizes are decode batch sizes (a batch is padded to the next one, larger batches run eagerly), mode an inductor mode of torch.compile'})
    int8_decode: bool | None = field(default=None, metadata={"help": "CPU: keep an int8 weight-only copy of each linear for decode-sized batches (bf16 GEMV is slow on CPU); default: on for .gguf models in bfloat16/float16"})
    int4_dense_copy: bool | None = field(default=None, metadata={"help": f"CPU: keep a dense copy of packed int4 weights (GGUF, AWQ) for steps of 9 or more rows (prefill, batched decode), where the int4 kernel loses to a dense GEMM; few-row steps (batch-1 decode, verify) stay on the packed weights. Layers on the tiled GEMV's AVX2 float32 build get no copy: it beats a float32 GEMM at every row count. Costs the dense weight's memory again; default: on (for the layers it serves) in bfloat16/float16, and in float32 where packed weights run there, when the copy takes at most {CPU_DENSE_COPY_FRACTION:.0%} of available RAM"})
    cpu_paged_attention: bool = field(default=True, metadata={"help": "CPU: fused C++ paged attention for decode and verify steps (built once per machine on first use, ~45 s on 2 cores, then cached); off = the torch reference path (gather + SDPA)"})
    cpu_flash_attention: bool = field(default=True, metadata={"help": "CPU, bf16: prefill and prefill-chunk attention in a flash-style C++ kernel with AVX512-BF16 dot products (built once per machine, ~12 s; needs avx512_bf16); off = blocked GEMMs from 128 queries on, else SDPA"})
    cpu_tiled_gemv: bool = field(default=True, metadata={"help": "CPU: GGUF 4- and 8-bit weights (Q4_0/Q4_1/Q4_K/Q5_x/Q8_0) in row tiles for a C++ GEMV kernel at decode-sized batches (built once per machine, ~10 s): bf16 with AVX-512 BF16, float32 with AVX2+FMA+F16C; off = torch's int4 kernel"})
    cpu_int8_activations: bool = field(default=True, metadata={"help": "CPU, bf16, AVX-512 VNNI: steps of 5 or more rows (prefill, batched decode) multiply packed GGUF weights in the tiled GEMV's layout by activations rounded to int8 per group of 32 inputs (step = the group's largest |x| / 127, as llama.cpp's and vLLM's GGUF kernels do), with exact int32 code sums: ~1.1-1.3x oneDNN's bf16 GEMM at prefill sizes, ~1.5x at 64 rows, and no dense bf16 copy of the weights. Perplexity on held-out text +0.15%; off = bf16 x everywhere (dense copy for many rows)"})
    cpu_fused_elementwise: bool = field(default=True, metadata={"help": "CPU, bf16: RMSNorm (+ residual add), SiLU*up and the rotary embedding in one AVX-512 pass each instead of torch's 6 / 3 / 7 kernels, outside torch.compile (built once per machine, ~8 s); off = the torch ops"})
    attention_backend: str = field(default="auto", metadata={"help": "attention kernels: auto = triton on CUDA, torch on CPU (triton on CPU only under TRITON_INTERPRET=1)", "choices": ATTENTION_BACKENDS})
    quantization: str = field(default="auto", metadata={"help": "weight format: auto = what the checkpoint holds (awq for an AWQ folder, gguf = packed blocks for a .gguf file, else none); none on a .gguf dequantizes it to --dtype", "choices": QUANTIZATION_CHOICES})
    tensor_parallel_size: int = field(default=1, metadata={"help": "number of devices to shard the model over"})
    speculative_config: dict[str, Any] | None = field(default=None, metadata={"help": 'speculative decoding config (JSON), as vLLM: {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 5}; methods ngram | mtp | draft; "disable_by_batch_size": N drafts nothing in steps with N or more running requests (the default model\'s MTP: 2, measured: drafting loses from batch 2 on CPU)'})
    speculative_model: str | None = field(default=None, metadata={"help": "draft for speculative decoding: 'ngram' (prompt lookup) or a model folder"})
    num_speculative_tokens: int | None = field(default=None, metadata={"help": "draft tokens per step (1..8; the most, when adaptive)"})
    enable_mtp: bool | None = field(default=None, metadata={"help": "speculate with MTP layers: the model's own, or --speculative-model DIR's; with no model given, the default model's trained head (ember/assets/smollm2-mtp), on by default for it (k = 1, adaptive; --no-enable-mtp turns it off)"})
    speculative_draft_tensor_parallel_size: int | None = field(default=None, metadata={"help": "tensor parallel size of the draft model (1 or --tensor-parallel-size)"})
    adaptive_spec: bool = field(default=True, metadata={"help": "per request, draft fewer tokens when few are accepted and more when most are (--no-adaptive-spec pins k)"})
    seed: int = field(default=0, metadata={"help": "global seed for unseeded sampling"})
    num_threads: int | None = field(default=None, metadata={"help": "CPU threads for torch (default: all cores)"})

    def __post_init__(self) -> None:
        for name in ("speculative_config", "compilation_config"):
            if isinstance(getattr(self, name), str):
                try:
                    setattr(self, name, json.loads(getattr(self, name)))
                except json.JSONDecodeError as e:
                    raise ConfigError(f"--{name.replace('_', '-')} is not valid JSON: {e}") from None
        self.validate()

    def validate(self) -> None:
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ConfigError(msg)

        need(self.dtype in DTYPES, f"--dtype {self.dtype!r} is not one of {', '.join(DTYPES)}")
        need(self.device in DEVICES, f"--device {self.device!r} is not one of {', '.join(DEVICES)}")
        need(self.attention_backend in ATTENTION_BACKENDS,
             f"--attention-backend {self.attention_backend!r} is not one of {', '.join(ATTENTION_BACKENDS)}")
        if self.attention_backend == "triton" and self.device == "cpu":
            from ember.kernels import resolve_attention_backend

            resolve_attention_backend("triton", "cpu")  # refuses unless TRITON_INTERPRET=1, saying what to change
        need(self.kv_cache_dtype in KV_CACHE_DTYPES, f"--kv-cache-dtype {self.kv_cache_dtype!r} is not one of {', '.join(KV_CACHE_DTYPES)}")
        need(self.block_size >= 1 and self.block_size & (self.block_size - 1) == 0,
             f"--block-size must be a power of two (got {self.block_size}); 16 is the default")
        need(self.max_num_batched_tokens >= 1, f"--max-num-batched-tokens must be >= 1 (got {self.max_num_batched_tokens})")
        if self.max_num_seqs is not None:
            need(self.max_num_seqs >= 1, f"--max-num-seqs must be >= 1 (got {self.max_num_seqs})")
            need(self.max_num_seqs <= self.max_num_batched_tokens,
                 f"--max-num-seqs {self.max_num_seqs} exceeds --max-num-batched-tokens {self.max_num_batched_tokens}: "
                 "every running sequence needs at least one token of the step budget; raise the budget or lower --max-num-seqs")
        if self.max_model_len is not None:
            need(self.max_model_len >= 2, f"--max-model-len must be >= 2 (got {self.max_model_len})")
            if not self.enable_chunked_prefill:
                need(self.max_num_batched_tokens >= self.max_model_len,
                     f"with chunked prefill off, --max-num-batched-tokens ({self.max_num_batched_tokens}) must be >= "
                     f"--max-model-len ({self.max_model_len}) so any prompt fits one step; raise the budget, lower "
                     "--max-model-len, or drop --no-enable-chunked-prefill")
        if self.kv_cache_memory is not None:
            need(self.kv_cache_memory > 0, f"--kv-cache-memory must be > 0 GiB (got {self.kv_cache_memory})")
            need(self.device != "cuda", "--kv-cache-memory sizes the CPU KV cache; on CUDA use --gpu-memory-utilization")
        need(0 < self.gpu_memory_utilization <= 1, f"--gpu-memory-utilization must be in (0, 1] (got {self.gpu_memory_utilization})")
        # >= 1 here; whether the model's heads split that way is checked at start (ember.distributed.tp_config).
        need(isinstance(self.tensor_parallel_size, int) and self.tensor_parallel_size >= 1,
             f"--tensor-parallel-size must be an integer >= 1 (got {self.tensor_parallel_size!r})")
        if self.quantization is None:
            self.quantization = "auto"
        need(self.quantization in QUANTIZATION_CHOICES,
             f"--quantization {self.quantization!r} is not one of {', '.join(QUANTIZATION_CHOICES)}")
        from ember.spec.config import resolve_speculative_config

        self.speculative = resolve_speculative_config(self)  # None = no speculation
        from ember.engine.step_executor import validate_executor_config

        validate_executor_config(self)
        if self.num_threads is not None:
            need(self.num_threads >= 1, f"--num-threads must be >= 1 (got {self.num_threads})")

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]


def cpu_has_avx512_bf16() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return "avx512_bf16" in line.split()
    except OSError:
        pass
    return False


def available_ram_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
