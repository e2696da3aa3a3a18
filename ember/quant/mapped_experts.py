"""Routed MoE experts left in the checkpoint file's mapping: never read, copied or repacked whole.

Layout. A GGUF file holds a layer's experts as three 3-D tensors, blk.N.ffn_{gate,up,down}_exps, each
[E, rows, row_bytes] of raw blocks, one expert after the other. The loader hands them out as per-expert
slices of the file's map (ember.loader.gguf), which this storage keeps as they are, and from which the
layer's whole tensor is one view again (ExpertMatrices.stacked: what a kernel that takes every expert of a
layer at once reads). A safetensors checkpoint's experts (per-expert gate / up / down, or transformers 5's
fused gate_up_proj [E, 2I, H] and down_proj [E, H, I]) come as views of MappedSafetensors' mapping in the
checkpoint's dtype, and a BF16 / F16 / F32 GGUF's as float views of its map (the loader's `mapped`).

Memory. Nothing is read at load: the views cost no resident memory until a step chooses an expert; then
the pages of its rows come in, and stay as file pages (shared with the page cache, reclaimable under
pressure, never anonymous copies). So the resident set grows with the experts a workload touches; a decode
over a long prompt touches nearly all of them (ember plan counts them whole, and says so).

Compute (on the host, x on the CPU), chosen once per storage: the C++ block kernels over the raw blocks
(ember.kernels.cpu_block_gemv: block_moe over the layer's three stacked views, reading only the chosen
experts, grouped by expert across the batch; x rounded to int8 per block as llama.cpp does) where the storage's
CpuKernels allow them (--cpu-block-gemv) and they take its types; else the reference this file carries: each
chosen expert dequantized alone, DEQUANT_ROWS rows at a time (gguf_blocks.dequantize: gguf-py's values
exactly), and multiplied in x's dtype, slow but exact. Float views are multiplied as they lie (a BF16 / F16
view under float32 x by the C++ half GEMV, ember.kernels.cpu_half_gemv, which widens in registers). The storage offers what a device-side cache needs too: one expert as dense matrices
(dense_expert), and its bytes in the file.
"""

from __future__ import annotations

import re
import warnings

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as T
from torch import nn

from ember.errors import ModelLoadError
from ember.kernels import cpu_block_gemv, cpu_half_gemv
from ember.kernels.cpu_kernels import CpuKernels
from ember.layers.activation import silu_and_mul
from ember.layers.linear import new_param
from ember.layers.moe_compute import grouped_experts
from ember.quant import gemm_dispatch
from ember.quant.gguf_blocks import GGUFTensor, dequantize

KINDS = ("gate", "up", "down")
# the reference's working set: rows of one expert matrix dequantized at a time
DEQUANT_ROWS = 256


def map_view(data: np.ndarray) -> torch.Tensor:
    """A torch tensor over a numpy view of a read-only file map (no copy). torch warns that it cannot
    write such memory: nothing here writes it (the experts are only read)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(data)


class ExpertMatrices:
    """One of gate, up, down for E experts: expert e's [rows, cols] matrix as the file holds it (views).
    qtype: the ggml block type (views uint8 [rows, row_bytes]), or None for float views [rows, cols]."""

    def __init__(self, views: list[torch.Tensor], qtype: T | None, rows: int, cols: int, stacked=None):
        self.views, self.qtype, self.rows, self.cols = views, qtype, rows, cols
        self._stacked = stacked

    @classmethod
    def from_loaded(cls, tensors: list) -> "ExpertMatrices":
        """Per-expert tensors as the loader hands them (GGUFTensor slices of the map, or torch views)."""
        first = tensors[0]
        rows, cols = first.shape
        if isinstance(first, GGUFTensor):
            if any(t.input_order is not None or t.qtype != first.qtype for t in tensors):
                raise ModelLoadError("mapped experts of one layer must share one ggml type and column order")
            arrays = [t.data for t in tensors]
            stacked = _stacked_array(arrays)
            views = [map_view(a) for a in arrays] if stacked is None else list(map_view(stacked))
            return cls(views, first.qtype, rows, cols, None if stacked is None else map_view(stacked))
        if any(t.dtype != first.dtype for t in tensors):
            raise ModelLoadError("mapped experts of one layer must share one dtype")
        return cls(list(tensors), None, rows, cols, _stacked_tensor(tensors))

    @property
    def num_experts(self) -> int:
        return len(self.views)

    @property
    def expert_bytes(self) -> int:
        v = self.views[0]
        return v.numel() * v.element_size()

    @property
    def nbytes(self) -> int:
        return self.expert_bytes * self.num_experts

    def stacked(self) -> torch.Tensor | None:
        """The layer's E matrices as one view [E, rows, row_bytes] (or [E, rows, cols] for floats), where the
        file holds them back to back (a GGUF's 3-D tensor always does); None otherwise."""
        return self._stacked

    def dense(self, e: int, dtype: torch.dtype) -> torch.Tensor:
        """Expert e's matrix [rows, cols] in dtype: dequantized alone (gguf-py's values), or the float view cast."""
        if self.qtype is None:
            return self.views[e].to(dtype)
        return dequantize(self.views[e], self.qtype, self.cols).to(dtype)

    def linear(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """x [n, cols] @ expert e's matrix^T in x's dtype, dequantized DEQUANT_ROWS rows at a time (the working
        set stays a few MB whatever the expert's size)."""
        if self.qtype is None:
            return F.linear(x, self.views[e].to(x.dtype))
        out = x.new_empty(x.shape[0], self.rows)
        view = self.views[e]
        for r in range(0, self.rows, DEQUANT_ROWS):
            rows = view[r : r + DEQUANT_ROWS]
            out[:, r : r + rows.shape[0]] = F.linear(x, dequantize(rows, self.qtype, self.cols).to(x.dtype))
        return out


def _stacked_array(arrays: list[np.ndarray]) -> np.ndarray | None:
    """The arrays as one [E, rows, row_bytes] view where they lie back to back in memory, else None."""
    first = arrays[0]
    step = first.nbytes
    if not all(a.flags.c_contiguous for a in arrays):
        return None
    base = first.ctypes.data
    if any(a.ctypes.data != base + e * step for e, a in enumerate(arrays)):
        return None
    return np.lib.stride_tricks.as_strided(first, (len(arrays), *first.shape), (step, *first.strides), writeable=False)


def _stacked_tensor(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """The same for torch views that share a storage (a fused checkpoint tensor's per-expert slices)."""
    first = tensors[0]
    if not all(
        t.is_contiguous() and t.untyped_storage().data_ptr() == first.untyped_storage().data_ptr() for t in tensors
    ):
        return None
    step = first.numel()
    if any(t.storage_offset() != first.storage_offset() + e * step for e, t in enumerate(tensors)):
        return None
    return first.as_strided((len(tensors), *first.shape), (step, *first.stride()))


class _FinishHook:
    """ember.quant.process_weights_after_loading calls this once every tensor is in."""

    @staticmethod
    def process_weights_after_loading(experts: "MappedExperts") -> None:
        experts.finish()


class MappedExperts(nn.Module):
    """E routed SwiGLU experts kept as views of the checkpoint's mapping (the module docstring), computed
    on the host. Loads per-expert names ("{e}.gate_proj.weight", ...) and transformers 5's fused ones
    ("gate_up_proj" [E, 2I, H], "down_proj" [E, H, I]); w13 / w2 are empty placeholders the model's loader
    checks completeness against."""

    _PER_EXPERT = re.compile(r"^(\d+)\.(gate|up|down)_proj\.weight$")

    def __init__(
        self, num_experts: int, hidden_size: int, intermediate_size: int, dtype, kernels: CpuKernels | None = None
    ):
        super().__init__()
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden_size, intermediate_size
        self.dtype = dtype
        self.kernels = kernels or CpuKernels()
        self.w13, self.w2 = new_param((0,), dtype, "cpu"), new_param((0,), dtype, "cpu")
        self.pending: dict = {}
        self.matrices: dict[str, ExpertMatrices] = {}
        self.quant_method = _FinishHook()

    def expected_shards(self, param_name: str) -> set:
        E = range(self.num_experts)
        return {(e, s) for e in E for s in ("gate", "up")} if param_name == "w13" else set(E)

    def load_weight(self, name: str, tensor, shard_id=None):
        E, H, I = self.num_experts, self.hidden_size, self.intermediate_size
        if name in ("gate_up_proj", "down_proj"):  # fused [E, 2I, H] / [E, H, I]: views per expert
            want = (E, 2 * I, H) if name == "gate_up_proj" else (E, H, I)
            _check(tuple(tensor.shape), want, f"experts.{name}")
            for e in range(E):
                if name == "down_proj":
                    self.pending[(e, "down")] = tensor[e]
                else:
                    self.pending[(e, "gate")], self.pending[(e, "up")] = tensor[e, :I], tensor[e, I:]
            pname = "w13" if name == "gate_up_proj" else "w2"
            return pname, self.expected_shards(pname)
        m = self._PER_EXPERT.match(name)
        if m is None:
            raise ModelLoadError(f"unexpected expert weight name {name!r}")
        e, kind = int(m[1]), m[2]
        if e >= E:
            raise ModelLoadError(f"checkpoint has expert {e} but the config says num_experts={E}")
        _check(tuple(tensor.shape), (H, I) if kind == "down" else (I, H), f"experts.{e}.{kind}_proj")
        self.pending[(e, kind)] = tensor
        return ("w2", e) if kind == "down" else ("w13", (e, kind))

    def finish(self) -> None:
        """The loaded views as one ExpertMatrices per kind (nothing is read or copied)."""
        if not self.pending:
            return
        for kind in KINDS:
            self.matrices[kind] = ExpertMatrices.from_loaded(
                [self.pending.pop((e, kind)) for e in range(self.num_experts)]
            )
        kinds = self.matrices.values()
        self.half_gemv = all(m.qtype is None and m.views[0].dtype in cpu_half_gemv.DTYPES for m in kinds)
        self.block = self.kernels.block_gemv and all(
            m.qtype is not None and m.stacked() is not None and cpu_block_gemv.supports(m.qtype) for m in kinds
        )

    # ---- what is mapped ------------------------------------------------------------------------

    def mapped_expert_bytes(self) -> int:
        """The experts' bytes in the file (all of them mapped, none resident until touched)."""
        return sum(m.nbytes for m in self.matrices.values())

    @property
    def expert_bytes(self) -> int:
        """One expert's gate, up and down as the file holds them."""
        return sum(m.expert_bytes for m in self.matrices.values())

    def types(self) -> dict[str, str]:
        """Each kind's ggml type name (or torch dtype) as the file holds it."""
        return {k: m.qtype.name if m.qtype is not None else str(m.views[0].dtype) for k, m in self.matrices.items()}

    # ---- compute -------------------------------------------------------------------------------

    def dense_expert(self, e: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert e as (gate;up [2I, H], down [H, I]) in dtype, on the host: what a device cache holds."""
        return torch.cat([self._dense("gate", e, dtype), self._dense("up", e, dtype)]), self._dense("down", e, dtype)

    def _dense(self, kind: str, e: int, dtype: torch.dtype) -> torch.Tensor:
        m = self.matrices[kind]
        if self.block:  # the kernel's exact row dequantizer (every type it runs; gguf-py's values)
            return cpu_block_gemv.dequant_rows(m.views[e], m.qtype).to(dtype)
        return m.dense(e, dtype)

    def _matmul(self, kind: str, e: int, x: torch.Tensor) -> torch.Tensor:
        """x [n, cols] @ expert e's `kind`^T, the weight read where it lies."""
        m = self.matrices[kind]
        if self.block:  # the C++ block GEMV over the file's blocks
            return cpu_block_gemv.gemm(block_x(x), m.views[e], m.qtype).to(x.dtype)
        if m.qtype is None and self.half_gemv and x.dtype == torch.float32 and self.kernels.half_weights:
            if cpu_half_gemv.available():
                return cpu_half_gemv.linear(x.contiguous(), m.views[e], gemm_dispatch.HALF_GEMV_MAX_ROWS)
        return m.linear(e, x)

    def expert_forward(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert e's SwiGLU on its tokens x [n, H] (host) -> [n, H]."""
        h = torch.cat([self._matmul("gate", e, x), self._matmul("up", e, x)], dim=-1)
        return self._matmul("down", e, silu_and_mul(h, self.kernels.fused_elementwise))

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """sum_k topk_weights[t, k] * expert(topk_ids[t, k], x[t]) on the host, reading only the chosen experts."""
        if self.pending:  # a model built without the loader's post-load hook
            self.finish()
        if self.block:  # one call: the chosen experts read from the map, grouped by expert across the batch
            stacked = (self.matrices[k].stacked() for k in KINDS)
            types = tuple(self.matrices[k].qtype for k in KINDS)
            return cpu_block_gemv.moe(block_x(x), topk_ids, topk_weights, *stacked, types).to(x.dtype)
        return grouped_experts(x, topk_ids, topk_weights, self.num_experts, self.expert_forward)


def block_x(x: torch.Tensor) -> torch.Tensor:
    """x as the block kernels take it: float32 or bf16 rows, contiguous."""
    return (x if x.dtype in (torch.float32, torch.bfloat16) else x.float()).contiguous()


def _check(got: tuple, want: tuple, what: str) -> None:
    if got != want:
        raise ModelLoadError(
            f"{what} has shape {got} but the model expects {want}; the checkpoint does not match its config"
        )
