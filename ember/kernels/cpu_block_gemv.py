"""x @ W^T, row lookups and routed MoE experts over a GGUF file's own blocks (cpu_block_gemv.cpp, with the
grid-coded IQ types in cpu_block_gemv_iq.cpp; the interface: cpu_block_gemv.h).

Why: a GGUF weight kept as the file's bytes can stay a view of the file's mapping (a MoE's unchosen experts
and cold layers are never read), and every ggml type runs packed: Q2_K, Q3_K and the IQ types were
dequantized to dense float at load before (4-16x their bytes). One kernel serves every type through a
registry by ggml type id: each type gives a row dot against x quantized once per row (Q8K: int8 codes per 256
with 16 partial sums, for the K-quants and IQ types; Q8x: per 32, for Q4_0..Q8_0 and IQ4_NL: llama.cpp's
activation formats, so a file runs as its quantizer meant) and an exact row dequantizer (gguf-py's values bit
for bit). Integer sums inside (sub-)blocks, AVX2 vpmaddubsw / vpmaddwd (VNNI where built), a float32
multiply-add per block.

Ops (torch.ops.ember_cpu, each with a fake for torch.compile):
- `gemm(x, w, qtype, float_out)`: x float32 | bf16 [M, K], w uint8 [N, row_bytes] (any row stride: a view
  into a mapped file) -> [M, N] in x's dtype, or float32 with float_out (an LM head's logits). Threads over
  tiles of W's rows; many rows of x reuse each tile from L1 (cpu_block_gemv.cpp says how).
- `dequant_rows(w, qtype)`: [R, row_bytes] -> float32 [R, K] (an embedding lookup's rows, a dense copy).
- `moe(x, topk_ids, topk_weights, gate, up, down, types)`: one MoE layer's routed SwiGLU experts, reading
  only the experts chosen, token slots grouped by expert across the batch (gate / up [E, I, row_bytes],
  down [E, H, row_bytes]: a GGUF file's ffn_{gate,up,down}_exps as they lie in it).
Numerics: x is rounded to int8 per block (as llama.cpp rounds it), so products differ from an exact float32
GEMM by that rounding (within what llama.cpp itself computes on the same file); `quantize_act` gives x as the
kernel rounds it (the tests' reference).

The IQ grid types need their lookup tables, which are data: they are handed in from the installed gguf-py
(cpu_block_gemv_iq_tables) once, when the kernel loads. Built for any x86 CPU (scalar dots without AVX2).
Whether a model uses it: CpuKernels.block_gemv (--cpu-block-gemv); which parts: ember.quant.gguf_block_part.
"""

from __future__ import annotations

import functools

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from ember.kernels.cpp_build import build
from ember.platform import cpu_has_amx

# block_moe runs an expert with at least this many slots (a prefill chunk's) as bf16 GEMMs over its weights
# dequantized once (oneDNN on the AMX tile unit), the rest through the integer dots; 0: always the dots, as on
# CPUs without AMX, where oneDNN's bf16 GEMM does not beat them (docs/tuning.md, "block_moe: dense experts").
MOE_DENSE_ROWS = 32 if cpu_has_amx() else 0
# block_gemm from this many rows of x: the weight dequantized to bf16 once and one oneDNN GEMM (same reasons)
GEMM_DENSE_ROWS = 64 if cpu_has_amx() else 0


def available() -> bool:
    """True when the ops can run here (loaded, the IQ tables handed in; built once first where install did not)."""
    if build("cpu_block_gemv.cpp", fakes=_FAKES) is None:
        return False
    _hand_in_tables()
    return True


@functools.cache
def _hand_in_tables() -> None:
    from ember.kernels.cpu_block_gemv_iq_tables import iq_tables

    for name, data in iq_tables().items():
        if not torch.ops.ember_cpu.block_set_iq_table(name, torch.frombuffer(bytearray(data), dtype=torch.uint8)):
            raise RuntimeError(f"the block kernel refused gguf-py's IQ table {name!r} ({len(data)} bytes)")


@functools.cache
def types() -> frozenset[GGMLQuantizationType]:
    """The ggml types this build has a kernel for (empty where it cannot run)."""
    if not available():
        return frozenset()
    return frozenset(GGMLQuantizationType(t) for t in torch.ops.ember_cpu.block_types())


def supports(qtype) -> bool:
    return GGMLQuantizationType(qtype) in types()


def row_elems(qtype, row_bytes: int) -> int:
    """Weights in a row of row_bytes bytes of qtype."""
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
    return row_bytes // size * block


def gemm(
    x: torch.Tensor, w: torch.Tensor, qtype, float_out: bool = False, dense_rows: int | None = None
) -> torch.Tensor:
    """x [M, K] (float32 | bf16, rows contiguous) @ W^T for the raw blocks w uint8 [N, row_bytes] -> [M, N];
    from dense_rows rows of x (default GEMM_DENSE_ROWS; 0: never) a bf16 GEMM over the dequantized weight."""
    rows = GEMM_DENSE_ROWS if dense_rows is None else dense_rows
    return torch.ops.ember_cpu.block_gemm(x, w, int(qtype), float_out, rows)


def gemm_scalar(x: torch.Tensor, w: torch.Tensor, qtype, float_out: bool = False) -> torch.Tensor:
    """gemm through the scalar reference dots (what a CPU without AVX2 runs; the tests' check of the SIMD ones)."""
    return torch.ops.ember_cpu.block_gemm_scalar(x, w, int(qtype), float_out)


def dequant_rows(w: torch.Tensor, qtype) -> torch.Tensor:
    """Raw blocks [R, row_bytes] -> float32 [R, K], gguf-py's values bit for bit."""
    return torch.ops.ember_cpu.block_dequant_rows(w, int(qtype))


def quantize_act(x: torch.Tensor, qtype) -> torch.Tensor:
    """x [M, K] as the kernel rounds it before dotting it with qtype's rows (float32)."""
    return torch.ops.ember_cpu.block_quantize_act(x, int(qtype))


def moe(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    down: torch.Tensor,
    qtypes: tuple,
    dense_rows: int | None = None,
) -> torch.Tensor:
    """sum_j topk_weights[t, j] * down_e(silu(gate_e x_t) * up_e x_t), e = topk_ids[t, j], over raw blocks:
    x [T, H], gate / up uint8 [E, I, row_bytes], down uint8 [E, H, row_bytes]; qtypes = (gate, up, down).
    An expert with at least dense_rows slots (default MOE_DENSE_ROWS; 0: none) runs as bf16 GEMMs."""
    tg, tu, td = (int(t) for t in qtypes)
    rows = MOE_DENSE_ROWS if dense_rows is None else dense_rows
    return torch.ops.ember_cpu.block_moe(x, topk_ids, topk_weights, gate, up, down, tg, tu, td, rows)


def _fake_gemm(x, w, ggml_type, float_out, dense_rows=0):
    """Shapes for torch.compile's tracing: the ops are opaque calls in a compiled graph."""
    return x.new_empty((x.shape[0], w.shape[0]), dtype=torch.float32 if float_out else x.dtype)


def _fake_dequant(w, ggml_type):
    return w.new_empty((w.shape[0], row_elems(ggml_type, w.shape[1])), dtype=torch.float32)


def _fake_quantize(x, ggml_type):
    return x.new_empty(x.shape, dtype=torch.float32)


def _fake_moe(x, topk_ids, topk_weights, gate, up, down, type_gate, type_up, type_down, dense_rows=0):
    return torch.empty_like(x)


_FAKES = {
    "ember_cpu::block_gemm": _fake_gemm,
    "ember_cpu::block_gemm_scalar": _fake_gemm,
    "ember_cpu::block_dequant_rows": _fake_dequant,
    "ember_cpu::block_quantize_act": _fake_quantize,
    "ember_cpu::block_moe": _fake_moe,
}
