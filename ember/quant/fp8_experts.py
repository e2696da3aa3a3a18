"""E stacked SwiGLU experts kept in fp8 with their block scales (an FP8 checkpoint's MoE layers).

Stacked like ember's dense `Experts` (w13 = gate;up [E, 2I, H], w2 [E, H, I], float8_e4m3fn), loaded from
per-expert names ("{e}.gate_proj.weight", "{e}.gate_proj.weight_scale_inv", ...) or transformers-5's fused
ones ("gate_up_proj" [E, 2I, H] with "gate_up_proj_scale_inv", "down_proj" ...). Scales arrive one row per
weight row (ember.quant.fp8 expands them in the stream) and are folded back to each expert's block rows
after loading (ember.quant.fp8_blocks.fold_rows), padded to the largest expert's count. Each expert runs
through the same fp8 GEMV as a Linear (ember.quant.fp8_linear.fp8_matmul).
"""

from __future__ import annotations

import re

import torch
from torch import nn

from ember.errors import ModelLoadError
from ember.kernels.cpu_kernels import CpuKernels
from ember.layers.activation import silu_and_mul
from ember.layers.linear import copy_checked, new_param
from ember.layers.moe_compute import experts_forward, register_experts
from ember.quant import fp8_blocks
from ember.quant.fp8_linear import _check_loaded, _check_row_split, cpu_kernel_ready, fp8_matmul

_PER_EXPERT = re.compile(r"^(\d+)\.(gate|up|down)_proj\.(weight|weight_scale_inv)$")
_FUSED = {"gate_up_proj": "w13", "down_proj": "w2", "gate_up_proj_scale_inv": "w13", "down_proj_scale_inv": "w2"}


def _narrow(t: torch.Tensor, dim: int, rank: int, parts: int) -> torch.Tensor:
    if parts == 1:
        return t
    n = t.shape[dim] // parts
    return t.narrow(dim, rank * n, n)


class FP8Experts(nn.Module):
    def __init__(self, num_experts, hidden_size, intermediate_size, block, device="cpu", tp=(0, 1), kernels=None):
        """intermediate_size: this rank's slice; tp (rank, size): gate/up narrowed by rows, down by its
        inputs (which must fall on a scale block boundary)."""
        super().__init__()
        E, H, I = num_experts, hidden_size, intermediate_size
        self.num_experts, self.hidden_size, self.intermediate_size = E, H, I
        self.block_k, self.tp = block[1], tp
        _check_row_split("experts down_proj", I, self.block_k, tp[1])
        self.fused_act = (kernels or CpuKernels()).fused_elementwise
        kb = lambda n: fp8_blocks.blocks(n, self.block_k)  # noqa: E731
        self.w13 = new_param((E, 2 * I, H), fp8_blocks.FP8_DTYPE, device, output_dim=1, input_dim=2)
        self.w13_scale_inv = new_param((E, 2 * I, kb(H)), torch.float32, device, output_dim=1, input_dim=2)
        self.w2 = new_param((E, H, I), fp8_blocks.FP8_DTYPE, device, output_dim=1, input_dim=2)
        self.w2_scale_inv = new_param((E, H, kb(I)), torch.float32, device, output_dim=1, input_dim=2)
        self.cpu_kernel = False
        self.graph_key = register_experts(self)

    def expected_shards(self, param_name: str) -> set:
        E = range(self.num_experts)
        return {(e, s) for e in E for s in ("gate", "up")} if param_name.startswith("w13") else set(E)

    def load_weight(self, name: str, tensor: torch.Tensor, shard_id=None):
        r, n = self.tp
        if m := _PER_EXPERT.match(name):
            e, kind, leaf = int(m[1]), m[2], m[3]
            if e >= self.num_experts:
                raise ModelLoadError(f"checkpoint has expert {e} but config.json says num_experts={self.num_experts}")
            suffix = "_scale_inv" if leaf == "weight_scale_inv" else ""
            what = f"experts.{name}"
            _check_loaded(what, leaf, tensor)
            if kind == "down":
                copy_checked(getattr(self, "w2" + suffix)[e], _narrow(tensor, 1, r, n), what)
                return "w2" + suffix, e
            I = self.intermediate_size
            rows = slice(0, I) if kind == "gate" else slice(I, 2 * I)
            copy_checked(getattr(self, "w13" + suffix)[e, rows], _narrow(tensor, 0, r, n), what)
            return "w13" + suffix, (e, kind)
        if name in _FUSED:
            pname = _FUSED[name] + ("_scale_inv" if name.endswith("_scale_inv") else "")
            _check_loaded(f"experts.{name}", name, tensor)
            if n > 1 and pname.startswith("w13"):  # [E, 2I, .]: gate's slice then up's
                gate, up = tensor.chunk(2, dim=1)
                tensor = torch.cat([_narrow(gate, 1, r, n), _narrow(up, 1, r, n)], dim=1)
            elif n > 1:
                tensor = _narrow(tensor, 2, r, n)
            copy_checked(getattr(self, pname), tensor, f"experts.{name}")
            return pname, self.expected_shards(pname)
        raise ModelLoadError(
            f"unexpected fp8 expert tensor name {name!r} (expected '{{e}}.{{gate|up|down}}_proj.{{weight|"
            "weight_scale_inv}' or gate_up_proj / down_proj with their _scale_inv)"
        )

    def fold_scales(self, cpu_kernel: bool) -> None:
        """Per-row scales -> each expert's block rows (padded to the most any expert has) and row index."""
        for prefix in ("w13", "w2"):
            rows = getattr(self, f"{prefix}_scale_inv").data
            folded = [fp8_blocks.fold_rows(rows[e]) for e in range(self.num_experts)]
            B = max(s.shape[0] for s, _ in folded)
            scale = rows.new_zeros(self.num_experts, B, rows.shape[-1])
            for e, (s, _) in enumerate(folded):
                scale[e, : s.shape[0]] = s
            delattr(self, f"{prefix}_scale_inv")
            self.register_buffer(f"{prefix}_scale", scale)
            self.register_buffer(f"{prefix}_scale_row", torch.stack([i for _, i in folded]).to(rows.device))
        self.cpu_kernel = cpu_kernel

    def _linear(self, prefix: str, e: int, x: torch.Tensor) -> torch.Tensor:
        return fp8_matmul(
            x,
            getattr(self, prefix)[e],
            getattr(self, f"{prefix}_scale")[e],
            getattr(self, f"{prefix}_scale_row")[e],
            self.block_k,
            self.cpu_kernel,
        )

    def expert_forward(self, e: int, x: torch.Tensor) -> torch.Tensor:
        return self._linear("w2", e, silu_and_mul(self._linear("w13", e, x), self.fused_act))

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        return experts_forward(self, x, topk_ids, topk_weights)


class FP8ExpertsMethod:
    """Builds the fp8 experts module for a SparseMoeBlock."""

    def __init__(self, block: tuple[int, int], kernels: CpuKernels | None = None):
        self.block, self.kernels = block, kernels

    def create_experts(self, num_experts, hidden_size, intermediate_size, dtype, device, tp=(0, 1), kernels=None):
        experts = FP8Experts(num_experts, hidden_size, intermediate_size, self.block, device, tp, kernels)
        experts.quant_method = self  # so ember.quant.process_weights_after_loading calls the hook below
        return experts

    def process_weights_after_loading(self, experts) -> None:
        experts.fold_scales(cpu_kernel_ready(self.kernels, experts.w13.device))
