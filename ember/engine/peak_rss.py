"""The peak resident set of a CPU engine process, predicted from its flags (`ember plan`'s "peak RSS").

A CPU engine's memory is allocated up front and touched (zero-filled pools), and glibc keeps what a
step frees in the heap (engine/startup/cpu_malloc.py), so the peak is the sum of what start-up holds
and the largest step's transients:

  process       the interpreter, torch and ember imported (PROCESS_BYTES), plus the tokenizer
                (TOKENIZER_BYTES_PER_TOKEN a vocabulary entry)
  weights       as held, not as stored: a GGUF tensor costs HELD_BYTES_PER_WEIGHT of its type in
                the layout this machine's kernels take (the tiled GEMV, in either build, keeps Q4_K /
                Q5_K's two levels of scales and Q6_K's own bits: ~the file's bytes; torch's int4
                kernel holds Q6_K at 1.25 B a weight, 1.5 in float32);
                float and unpacked types hold the run dtype, but for BF16 / F16 matrices in a float32
                run with --cpu-half-weights on a CPU with AVX2 + FMA + F16C: 2 B (their own bits)
  dense copy    --int4-dense-copy auto (bf16 / fp16 runs only: engine/startup/weights.py): a
                run-dtype copy of every GGUF linear whose kernel loses at many rows (every packed
                type without the tiled GEMV's int8-x path, Q6_K included), the embedding and the
                head left out, when it fits CPU_DENSE_COPY_FRACTION of free RAM
  pools         the KV blocks and the recurrent-state slots, exactly as engine/startup/kv_pool.py
                sizes them (the planner's arithmetic)
  step          one step of max_num_batched_tokens tokens: the planner's activation reserve, plus
                for a hybrid its linear-attention layers' float32 prefill work
                (GDN_PREFILL_FLOATS_PER_CONV_CHANNEL floats a token and conv channel)
  compile       --executor auto / compiled: torch.compile's graphs (frozen: some linear keeps dense
                weights) cost inductor's machinery (COMPILE_BYTES) and each decode batch size's graph
                (COMPILE_BYTES_PER_SIZE; sizes 1, 2, 4, 8, 16, ... up to max_num_seqs, every one built
                in a server that has run that many requests); AOTInductor packages (every linear
                packed) cost PACKAGE_BYTES_PER_SIZE a size loaded, once built (the process that builds
                them holds inductor's compile for a while: a first start's peak, not a restart's)
  mapped experts  --cpu-moe / --n-cpu-moe: the host layers' experts stay in the file's mapping and their
                pages come in as steps choose them; a decode over a long prompt touches nearly all, so they
                count whole at the file's bytes (and leave the weights above)
  hot cache     --moe-hot-cache-memory on CPU: the cache's slots, allocated beside the pool

The constants were measured on the bench machine (2 Xeon cores, torch 2.13 CPU) with
/proc/self/status at each start-up stage; docs/tuning.md ("Peak RSS") has the figures. The test
(tests/engine/test_peak_rss.py) holds the prediction to 10% of a measured process.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

MiB = 1 << 20
PROCESS_BYTES = 270 * MiB
TOKENIZER_BYTES_PER_TOKEN = 240
COMPILE_BYTES = 230 * MiB  # inductor's machinery, imported and run once
COMPILE_BYTES_PER_SIZE = 70 * MiB  # each decode batch size's graph, loaded
# a loaded package (the Qwen3.5-0.8B-shaped Q8_0 hybrid: 2,143 MiB eager, 2,170 with sizes 1, 2, 4 loaded)
PACKAGE_BYTES_PER_SIZE = 9 * MiB
# a package worker beyond the parts an engine holds: export, lowering and its start-up (calibrated: the bf16 hybrid under
# EMBER_CPU_ISA=avx2, benchmarks/first_start.py, a worker a batch size: 2,414 MiB at its peak with its weights
# resident, 992 MiB once it loaded them for their shapes only, ember.loader.shapes_only)
PACKAGE_BUILD_BYTES = 290 * MiB
# its C++ compiler (g++ over inductor's generated step, a process of its own): the sum of its processes'
# RSS sampled every 0.25 s peaked at 511 MiB for the same build
PACKAGE_COMPILER_BYTES = 512 * MiB
COPY_CHUNK_BYTES = 64 * MiB  # ember.loader.gguf.COPY_CHUNK_BYTES: a 16-bit tensor's staging copy
GDN_PREFILL_FLOATS_PER_CONV_CHANNEL = 4
# bytes a weight as the GGUF methods hold it, in a run whose dtype the tiled GEMV takes (bf16 on
# AVX-512 BF16, float32 on AVX2) / in a bfloat16 run without it (torch's int4 kernel: codes 4 bits, a
# (scale, zero) pair in the run dtype per 32; 8-bit codes split into two nibbles; ember.quant.gguf_quant's
# docstring). The tiled layout keeps Q4_K / Q5_K's scales as the file has them: 6-bit sc and m per 32 (a
# byte each), float16 d and dmin per 256 -- where a fused run is all K-quants (a part mixing Q4_K with
# Q4_0 keeps flat float32 scales, 0.75 / 1.25 B; rare in files: counted at the two-level figure)
HELD_BYTES_PER_WEIGHT = {
    "tiled": {
        "Q4_0": 0.625,
        "Q4_1": 0.625,
        "Q4_K": 0.578125,
        "Q5_0": 1.125,
        "Q5_1": 1.125,
        "Q5_K": 1.078125,
        "Q8_0": 1.125,
    },
    "int4": {"Q4_0": 0.625, "Q4_1": 0.625, "Q4_K": 0.625, "Q5_0": 1.25, "Q5_1": 1.25, "Q5_K": 1.25, "Q8_0": 1.25},
}
Q6K_HELD_BYTES = {2: 1.25, 4: 1.5}  # Q6KPart, by the run dtype's bytes: codes 1 B + (s, z) per 16 weights
Q6K_FILE_BYTES = 210 / 256  # raw blocks (a lookup-only embedding) and the tiled GEMV's Q6_K tiles alike
FLOAT_TYPES = ("F32", "F16", "BF16")
# GGUF tensors one Linear of ember holds together (a dense copy is the whole Linear's)
FUSED = {
    "attn_q": "qkv",
    "attn_k": "qkv",
    "attn_v": "qkv",
    "ffn_gate": "gate_up",
    "ffn_up": "gate_up",
    "attn_qkv": "qkvz",
    "attn_gate": "qkvz",
    "ssm_alpha": "ba",
    "ssm_beta": "ba",
}


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    type_name: str
    elements: int
    dims: int


@dataclass
class PeakRss:
    process: int
    weights: int
    dense_copy: int
    kv_pool: int
    state_pool: int
    step: int
    compile: int
    mapped_experts: int = 0  # experts kept in host memory: the file's pages, counted whole (ember.engine.expert_plan)
    hot_cache: int = 0  # a hot-expert cache allocated beside the pool (--moe-hot-cache-memory on CPU)

    @property
    def total(self) -> int:
        return sum(v for _, v in self.parts())

    def parts(self) -> list[tuple[str, int]]:
        return [
            ("process", self.process),
            ("weights", self.weights),
            ("dense copy", self.dense_copy),
            ("KV pool", self.kv_pool),
            ("state pool", self.state_pool),
            ("step", self.step),
            ("compile", self.compile),
            ("mapped experts", self.mapped_experts),
            ("hot cache", self.hot_cache),
        ]


def layout(dtype_bytes: int) -> str:
    """Which packed layout a GGUF file's quantized matrices take on this machine."""
    from ember.kernels import cpu_tiled_gemv

    x = cpu_tiled_gemv.x_dtype()
    return "tiled" if x is not None and x.itemsize == dtype_bytes else "int4"


def half_weights_kept(dtype_bytes: int, half_weights: bool) -> bool:
    """Whether BF16 / F16 matrices stay 16-bit (gguf_quant.HalfPart): float32 run, the flag, the CPU's flags."""
    from ember.platform import has_cpu_flags

    return dtype_bytes == 4 and half_weights and has_cpu_flags("avx2", "fma", "f16c")


def held_bytes(t: GGUFTensorInfo, dtype_bytes: int, kind: str, lookup_only: bool, half_kept: bool = False) -> float:
    """Bytes tensor t takes as loaded. lookup_only: an untied embedding, kept raw when packed;
    half_kept: half_weights_kept()."""
    if half_kept and t.dims >= 2 and t.type_name in ("BF16", "F16"):
        return t.elements * 2
    if t.dims < 2 or t.type_name in FLOAT_TYPES:
        return t.elements * dtype_bytes
    if t.type_name == "Q6_K":
        native = lookup_only or kind == "tiled"  # the tiled GEMV's Q6_K tiles (both builds)
        return t.elements * (Q6K_FILE_BYTES if native else Q6K_HELD_BYTES[dtype_bytes])
    if t.type_name in block_file_bytes():  # a BlockPart: the file's own blocks (block kernel: any x86 CPU)
        return t.elements * block_file_bytes()[t.type_name]
    per = HELD_BYTES_PER_WEIGHT[kind].get(t.type_name)
    return t.elements * (per if per is not None else dtype_bytes)  # others are dequantized at load


@functools.cache
def block_file_bytes() -> dict[str, float]:
    """Bytes a weight of the types the GGUF methods keep as the file's blocks (gguf_block_part.BLOCK_TYPES)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    from ember.quant.gguf_block_part import BLOCK_TYPE_NAMES

    return {n: GGML_QUANT_SIZES[GGMLQuantizationType[n]][1] / GGML_QUANT_SIZES[GGMLQuantizationType[n]][0]
            for n in BLOCK_TYPE_NAMES}  # fmt: skip


def gguf_weight_bytes(tensors: list[GGUFTensorInfo], dtype_bytes: int, tied: bool, half_weights: bool = True) -> int:
    kind, half = layout(dtype_bytes), half_weights_kept(dtype_bytes, half_weights)
    return int(sum(held_bytes(t, dtype_bytes, kind, t.name == "token_embd.weight" and not tied, half) for t in tensors))


def needs_copy(type_name: str, kind: str, any_rows: bool) -> bool:
    """Whether a packed GGUF matrix of this type loses to a dense GEMM at many rows (so gets a copy).
    any_rows: the tiled layout's kernel serves every row count (its int8-x path, or the AVX2 build)."""
    if type_name in FLOAT_TYPES or not (type_name == "Q6_K" or type_name in HELD_BYTES_PER_WEIGHT[kind]):
        return False  # dense as loaded (floats, types dequantized at load), or a BlockPart (any row count)
    return not (kind == "tiled" and any_rows)  # torch's int4 kernel (Int4Part, Q6KPart) loses at many rows


def gguf_dense_copy_bytes(tensors: list[GGUFTensorInfo], dtype_bytes: int, int8_activations: bool) -> int:
    """The run-dtype copy --int4-dense-copy makes: whole Linears with a part that needs one (none where the
    tiled layout serves every row count: the AVX2 build in float32, the int8-x path in bf16)."""
    from ember.kernels import cpu_tiled_gemv

    kind = layout(dtype_bytes)
    any_rows = cpu_tiled_gemv.rounds_x() or (int8_activations and cpu_tiled_gemv.has_q8())
    groups: dict[str, list[GGUFTensorInfo]] = {}
    for t in tensors:
        if not t.name.startswith("blk.") or t.dims < 2:
            continue  # the embedding and the head keep their packed method alone
        block, part = t.name.split(".")[1:3]
        groups.setdefault(f"{block}.{FUSED.get(part, part)}", []).append(t)
    return sum(
        sum(t.elements for t in ts) * dtype_bytes
        for ts in groups.values()
        if any(needs_copy(t.type_name, kind, any_rows) for t in ts)
    )


def hybrid_step_bytes(mc, tokens: int) -> int:
    """A hybrid's linear-attention prefill work in float32 beyond the planner's activations."""
    if not mc.is_hybrid:
        return 0
    return tokens * mc.linear_conv_dim * GDN_PREFILL_FLOATS_PER_CONV_CHANNEL * 4


def packaged(tensors: list[GGUFTensorInfo] | None, half_kept: bool = False) -> bool:
    """Whether a CPU engine's decode graphs are AOTInductor packages: every linear of a GGUF file packed
    (none dense, so freezing is off: BF16 / F16 matrices count as packed where they stay 16-bit,
    half_kept = half_weights_kept()), and no MoE experts (their op keeps a graph torch.compile's)."""
    if tensors is None:
        return False
    linears = [t for t in tensors if t.name.startswith("blk.") and t.dims >= 2 and "ssm_conv1d" not in t.name]
    dense = ("F32",) if half_kept else FLOAT_TYPES
    return not any(t.type_name in dense or "_exps" in t.name for t in linears)


def package_worker_bytes(process: int, largest_weight: int, live_states: int, kv_one_sequence: int) -> int:
    """The peak of a first start's package build beside the engine (engine/startup/package_worker.py): a
    worker process that loads the weights for their shapes only (ember.loader.shapes_only: one tensor
    resident at a time, beside a chunk of the file's map), then holds its live state slots and one
    max_model_len sequence of KV (package_worker.worker_config) through export + AOTInductor's lowering
    (PACKAGE_BUILD_BYTES) and the C++ compiler it runs (PACKAGE_COMPILER_BYTES)."""
    load = largest_weight + COPY_CHUNK_BYTES
    return process + max(load, live_states + kv_one_sequence + PACKAGE_BUILD_BYTES + PACKAGE_COMPILER_BYTES)


def gguf_largest_weight_bytes(tensors: list[GGUFTensorInfo], dtype_bytes: int, tied: bool, half_weights: bool) -> int:
    """The bytes of the largest tensor as held (gguf_weight_bytes' terms)."""
    kind, half = layout(dtype_bytes), half_weights_kept(dtype_bytes, half_weights)
    return int(
        max(
            (held_bytes(t, dtype_bytes, kind, t.name == "token_embd.weight" and not tied, half) for t in tensors),
            default=0,
        )
    )


def compile_bytes(max_num_seqs: int, packages: bool = False) -> int:
    from ember.engine.executor.decode_batch import default_sizes

    sizes = len(default_sizes(max_num_seqs))
    return PACKAGE_BYTES_PER_SIZE * sizes if packages else COMPILE_BYTES + COMPILE_BYTES_PER_SIZE * sizes
