"""Qwen3-MoE sparse MLP: a softmax top-k router over E SwiGLU experts, no shared expert.

Experts are stored stacked (w13 [E, 2I, H] = gate;up, w2 [E, H, I]) so a later fused kernel
can take them as is. Compute (ember/layers/moe_compute.py) groups token slots by expert eagerly: one sort,
then one GEMM pair per expert that has tokens, and one index_add back -- no loop over tokens; a graph runs
a sync-free form of it.

Tensor parallelism: every rank holds every expert, each with a 1/tp slice of its intermediate
dim (gate/up rows, down columns), like a dense MLP's column/row split. Routing is replicated
(the router is tiny), every rank runs the same experts on the same tokens, and the block's
partial outputs are all-reduced. Chosen over whole experts per rank because it balances load
whatever the routing does and needs no token exchange; the cost is more, smaller GEMMs.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from ember.errors import ModelLoadError
from ember.kernels.cpu_kernels import CpuKernels
from ember.layers.activation import silu_and_mul
from ember.layers.expert_placement import current_placement, layer_index
from ember.layers.linear import ReplicatedLinear, copy_checked, dense_linear, get_tp_rank_size
from ember.layers.moe_compute import experts_forward, gathered_experts, register_experts


def tp_slice(tensor: torch.Tensor, dim: int, rank: int, size: int) -> torch.Tensor:
    """Shard ``rank`` of ``size`` equal parts of tensor along dim (the identity for size 1)."""
    if size == 1:
        return tensor
    n = tensor.shape[dim] // size
    return tensor.narrow(dim, rank * n, n)


class Experts(nn.Module):
    """E stacked SwiGLU experts. Loads per-expert HF names ("{e}.gate_proj.weight", ...) or the
    transformers-5 fused ones ("gate_up_proj" [E, 2I, H], "down_proj" [E, H, I])."""

    _PER_EXPERT = re.compile(r"^(\d+)\.(gate|up|down)_proj\.weight$")

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        tp: tuple[int, int] = (0, 1),
        kernels: CpuKernels | None = None,
    ):
        """intermediate_size: this rank's slice (the full size / tp); tp: (rank, size) to narrow checkpoints by."""
        super().__init__()
        self.fused_act = (kernels or CpuKernels()).fused_elementwise
        self.num_experts, self.intermediate_size = num_experts, intermediate_size
        self.tp = tp
        E, H, I = num_experts, hidden_size, intermediate_size
        self.w13 = nn.Parameter(torch.empty(E, 2 * I, H, dtype=dtype, device=device), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(E, H, I, dtype=dtype, device=device), requires_grad=False)
        self.graph_key = register_experts(self)

    def expected_shards(self, param_name: str) -> set:
        E = range(self.num_experts)
        return {(e, s) for e in E for s in ("gate", "up")} if param_name == "w13" else set(E)

    def load_weight(self, name: str, tensor: torch.Tensor, shard_id=None):
        I = self.intermediate_size
        r, n = self.tp
        m = self._PER_EXPERT.match(name)
        if m:
            e, kind = int(m.group(1)), m.group(2)
            if e >= self.num_experts:
                raise ModelLoadError(f"checkpoint has expert {e} but config.json says num_experts={self.num_experts}")
            if kind == "down":
                copy_checked(self.w2[e], tp_slice(tensor, 1, r, n), f"experts.{e}.down_proj")
                return "w2", e
            rows = slice(0, I) if kind == "gate" else slice(I, 2 * I)
            copy_checked(self.w13[e, rows], tp_slice(tensor, 0, r, n), f"experts.{e}.{kind}_proj")
            return "w13", (e, kind)
        if name in ("gate_up_proj", "down_proj"):
            param = self.w13 if name == "gate_up_proj" else self.w2
            if n > 1 and name == "gate_up_proj":  # [E, 2I, H]: gate's slice then up's
                gate, up = tensor.chunk(2, dim=1)
                tensor = torch.cat([tp_slice(gate, 1, r, n), tp_slice(up, 1, r, n)], dim=1)
            elif n > 1:
                tensor = tp_slice(tensor, 2, r, n)
            copy_checked(param, tensor, f"experts.{name}")
            pname = "w13" if name == "gate_up_proj" else "w2"
            return pname, self.expected_shards(pname)  # a set: every shard at once
        raise ModelLoadError(f"unexpected expert weight name {name!r}")

    def expert_forward(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert e's SwiGLU on its tokens x [n, H] -> [n, H] (dense_linear: a bf16 row streams through mv)."""
        return dense_linear(silu_and_mul(dense_linear(x, self.w13[e]), self.fused_act), self.w2[e])

    def gathered(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        return gathered_experts(x, topk_ids, topk_weights, self.w13, self.w2, lambda h: silu_and_mul(h, self.fused_act))

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        return experts_forward(self, x, topk_ids, topk_weights)


class SparseMoeBlock(nn.Module):
    """router ("gate") + experts; forward(x [T, H]) -> [T, H]."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        top_k: int,
        norm_topk_prob: bool,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        quant_config=None,
        prefix: str = "mlp",
        kernels: CpuKernels | None = None,
    ):
        super().__init__()
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob
        gate_method = quant_config.linear_method(f"{prefix}.gate") if quant_config is not None else None
        self.gate = ReplicatedLinear(
            hidden_size, num_experts, bias=False, dtype=dtype, device=device, quant_method=gate_method
        )
        experts_method = quant_config.experts_method(f"{prefix}.experts") if quant_config is not None else None
        tp = get_tp_rank_size()
        self.tp_size = tp[1]
        local = intermediate_size // tp[1]
        placement = current_placement()
        layer = layer_index(prefix)
        if placement is not None and placement.on_host(layer):  # --cpu-moe / --n-cpu-moe: kept in host memory
            self.experts = placement.host_experts(layer, num_experts, hidden_size, local, dtype, device, kernels)
        elif experts_method is not None:
            kw = {"tp": tp} if tp[1] > 1 else {}  # GGUF experts (refused under TP) take no tp
            self.experts = experts_method.create_experts(
                num_experts, hidden_size, local, dtype, device, kernels=kernels, **kw
            )
        else:
            self.experts = Experts(num_experts, hidden_size, local, dtype, device, tp=tp, kernels=kernels)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(topk_weights [T, k] in x's dtype, topk_ids [T, k])."""
        probs = torch.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        y = self.experts(x, ids, weights)
        if self.tp_size > 1:
            from ember.distributed.comm import all_reduce

            y = all_reduce(y)
        return y
