"""Linear layers with a QuantMethod seam and tensor-parallel sharding in their weight loaders.

A Linear owns its shapes and its TP slicing; a QuantMethod owns how the weight is stored
(dense, AWQ int4, GGUF blocks) and how `x @ W^T` is computed. Fused layers (qkv, gate_up)
hold several checkpoint tensors ("shards") side by side along the output dim, so one big
GEMM replaces three or two small ones.

TP layout: column-parallel layers split the output dim, row-parallel ones the input dim.
Loaders narrow the full checkpoint tensor by (tp_rank, tp_size); with tp_size 1 the narrow
is the identity. The split is a fraction of the stored dim, so it also works for packed or
grouped layouts (int4 words, per-group scales) as long as they divide evenly.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ember.errors import ModelLoadError
from ember.kernels import cpu_half_gemv
from ember.kernels.tracing import tracing


def get_tp_rank_size() -> tuple[int, int]:
    """(tp_rank, tp_size) the layers built now are sharded for (see ember.distributed.parallel_state)."""
    from ember.distributed.parallel_state import get_tp_rank_size as current

    return current()


def new_param(shape, dtype, device, output_dim: int | None = None, input_dim: int | None = None) -> nn.Parameter:
    """An inference parameter tagged with which of its dims are the output / input features."""
    p = nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)
    p.output_dim = output_dim
    p.input_dim = input_dim
    return p


class QuantMethod:
    """How a Linear stores its weight and computes y = x W^T (+ b)."""

    def create_weights(
        self,
        layer: "LinearBase",
        in_features: int,
        out_features_per_shard: list[int],
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        """Register the weight parameter(s) on `layer` (per-partition sizes), tagged with output_dim/input_dim."""
        raise NotImplementedError

    def load_weight(self, layer: "LinearBase", param_name: str, tensor: torch.Tensor, shard_id) -> None:
        """Copy one (already TP-narrowed) checkpoint tensor into `layer.<param_name>` at its shard's place."""
        raise NotImplementedError

    def apply(self, layer: "LinearBase", x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        raise NotImplementedError


class DenseMethod(QuantMethod):
    """Plain [out, in] weight in the model dtype; F.linear."""

    def create_weights(self, layer, in_features, out_features_per_shard, dtype, device):
        layer.weight = new_param((sum(out_features_per_shard), in_features), dtype, device, output_dim=0, input_dim=1)

    def load_weight(self, layer, param_name, tensor, shard_id):
        copy_checked(layer.shard_view(getattr(layer, param_name), shard_id), tensor, _what(param_name, shard_id))

    def apply(self, layer, x, bias=None):
        return dense_linear(x, layer.weight, bias)


def dense_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, except for one bf16 row of x on CPU: a GEMV there (_one_row), which streams the weight at
    the memory's speed where the single-row GEMM does not (docs/tuning.md, "Dense GEMV"; in float32 the two
    tie, in float16 mv loses). A traced step calls it as an opaque op (row_gemv): inductor would lower
    torch.mv to a loop of its own."""
    if x.dim() == 2 and x.shape[0] == 1 and x.dtype == weight.dtype == torch.bfloat16 and x.device.type == "cpu":
        y = row_gemv(weight, x) if tracing(x) else _one_row(weight, x)
        return y if bias is None else y + bias
    return F.linear(x, weight, bias)


def _one_row(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """weight [N, K] bf16 @ x[0] -> [1, N] bf16: the C++ 16-bit GEMV where it is built (float32 products and
    sums, as torch.mv's; ~1/4 of torch.mv's time on the small matrices of a qwen4_exp step, a router's 128 x
    1024: docs/tuning.md, "Dense GEMV"), else torch.mv."""
    if weight.is_contiguous() and cpu_half_gemv.available():
        return cpu_half_gemv.linear(x.float().contiguous(), weight, 1).to(x.dtype)
    return torch.mv(weight, x[0])[None]


@torch.library.custom_op("ember::row_gemv", mutates_args=())
def row_gemv(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """weight [N, K] @ x[0] -> [1, N] (_one_row)."""
    return _one_row(weight, x)


@row_gemv.register_fake
def _(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return x.new_empty((1, weight.shape[0]))


def _what(param_name: str, shard_id) -> str:
    return param_name if shard_id is None else f"{param_name} shard {shard_id!r}"


def copy_checked(dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
    """dst.copy_(src) (casting), or a ModelLoadError if the shapes differ."""
    if dst.shape != src.shape:
        raise ModelLoadError(
            f"{what} has shape {tuple(src.shape)} but the model expects {tuple(dst.shape)}; "
            "the checkpoint does not match its config.json"
        )
    dst.copy_(src)


class LinearBase(nn.Module):
    """Shared machinery: shards laid side by side on the output dim, TP narrowing, bias, forward.

    out_features_per_shard are the *full* (unsharded) sizes of each checkpoint tensor that
    lands in this layer; shard_ids name them (None for a single-tensor layer).
    tp_mode: "column" (split outputs), "row" (split inputs) or None (replicated).
    """

    def __init__(
        self,
        in_features: int,
        out_features_per_shard: list[int],
        bias: bool,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        quant_method: QuantMethod | None = None,
        shard_ids: list | None = None,
        tp_mode: str | None = None,
        shard_partitions: list[tuple[int, int]] | None = None,
    ):
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank_size() if tp_mode else (0, 1)
        self.tp_mode = tp_mode
        self.shard_ids = list(shard_ids) if shard_ids is not None else [None]
        # (rank, number of parts) each shard is narrowed to; differs from (tp_rank, tp_size) only
        # for kv heads replicated across ranks when tp_size > num_kv_heads.
        self.shard_partitions = shard_partitions or [(self.tp_rank, self.tp_size)] * len(self.shard_ids)
        if tp_mode == "column":
            local = [n // parts for n, (_, parts) in zip(out_features_per_shard, self.shard_partitions)]
            in_local = in_features
        elif tp_mode == "row":
            local = list(out_features_per_shard)
            in_local = in_features // self.tp_size
        else:
            local, in_local = list(out_features_per_shard), in_features
        self.in_features, self.out_features = in_local, sum(local)
        self.shard_sizes = dict(zip(self.shard_ids, local))
        offsets, o = {}, 0
        for sid, n in zip(self.shard_ids, local):
            offsets[sid], o = o, o + n
        self.shard_offsets = offsets
        self.quant_method = quant_method or DenseMethod()
        self.quant_method.create_weights(self, in_local, local, dtype, device)
        # Row-parallel bias is added once, after the all-reduce, so it is never split.
        self.bias = None
        if bias:
            self.bias = new_param((self.out_features,), dtype, device, output_dim=None if tp_mode == "row" else 0)

    def shard_view(self, param: torch.Tensor, shard_id) -> torch.Tensor:
        """The part of `param` that holds `shard_id`, in the param's own units (packed dims scale)."""
        dim = getattr(param, "output_dim", None)
        if dim is None or len(self.shard_ids) == 1:
            return param
        n = param.shape[dim]
        start = self.shard_offsets[shard_id] * n // self.out_features
        size = self.shard_sizes[shard_id] * n // self.out_features
        return param.narrow(dim, start, size)

    def _tp_narrow(self, param: torch.Tensor, tensor: torch.Tensor, shard_id) -> torch.Tensor:
        if self.tp_mode == "column":
            rank, parts = self.shard_partitions[self.shard_ids.index(shard_id)]
            dim = getattr(param, "output_dim", None)
        elif self.tp_mode == "row":
            rank, parts = self.tp_rank, self.tp_size
            dim = getattr(param, "input_dim", None)
        else:
            return tensor
        if parts == 1 or dim is None:
            return tensor
        size = tensor.shape[dim] // parts
        return tensor.narrow(dim, rank * size, size)

    def expected_shards(self, param_name: str) -> set:
        return set(self.shard_ids)

    def load_weight(self, param_name: str, tensor: torch.Tensor, shard_id=None):
        """Load one checkpoint tensor; returns (param_name, shard_id) so the model can track completeness."""
        if shard_id not in self.shard_sizes:
            raise ModelLoadError(f"{type(self).__name__} has no shard {shard_id!r} (has {self.shard_ids})")
        param = getattr(self, param_name, None)
        if not isinstance(param, nn.Parameter):
            raise ModelLoadError(f"{type(self).__name__} has no parameter {param_name!r}")
        tensor = self._tp_narrow(param, tensor, shard_id)
        if param_name == "bias":
            copy_checked(self.shard_view(param, shard_id), tensor, _what("bias", shard_id))
        else:
            self.quant_method.load_weight(self, param_name, tensor, shard_id)
        return param_name, shard_id

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x, self.bias)


class ReplicatedLinear(LinearBase):
    """Every rank holds the whole weight (e.g. the MoE router)."""

    def __init__(self, in_features, out_features, bias=False, dtype=torch.float32, device="cpu", quant_method=None):
        super().__init__(in_features, [out_features], bias, dtype, device, quant_method)


class MergedColumnLinear(LinearBase):
    """Several column-parallel projections of the same input in one weight (gate_up: shards "gate", "up")."""

    def __init__(
        self,
        in_features,
        out_features_per_shard: list[int],
        bias=False,
        dtype=torch.float32,
        device="cpu",
        quant_method=None,
        shard_ids=("gate", "up"),
    ):
        super().__init__(
            in_features,
            out_features_per_shard,
            bias,
            dtype,
            device,
            quant_method,
            shard_ids=list(shard_ids),
            tp_mode="column",
        )


class QKVLinear(LinearBase):
    """q, k and v projections fused into one [(Hq + 2 Hkv) * D, H] weight; shards "q", "k", "v"."""

    def __init__(
        self,
        hidden_size,
        head_dim,
        num_heads,
        num_kv_heads,
        bias=False,
        dtype=torch.float32,
        device="cpu",
        quant_method=None,
    ):
        tp_rank, tp_size = get_tp_rank_size()
        # With more ranks than kv heads, each kv head is replicated on tp_size / num_kv_heads ranks.
        kv_parts = min(tp_size, num_kv_heads)
        kv_rank = tp_rank // (tp_size // kv_parts)
        super().__init__(
            hidden_size,
            [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim],
            bias,
            dtype,
            device,
            quant_method,
            shard_ids=["q", "k", "v"],
            tp_mode="column",
            shard_partitions=[(tp_rank, tp_size), (kv_rank, kv_parts), (kv_rank, kv_parts)],
        )
        self.num_heads = num_heads // tp_size  # per rank
        self.num_kv_heads = num_kv_heads // kv_parts
        self.head_dim = head_dim

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[T, (Hq + 2 Hkv) D] -> q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D] (views)."""
        T, D = qkv.shape[0], self.head_dim
        q, k, v = qkv.split([self.num_heads * D, self.num_kv_heads * D, self.num_kv_heads * D], dim=-1)
        return q.view(T, self.num_heads, D), k.view(T, self.num_kv_heads, D), v.view(T, self.num_kv_heads, D)


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial outputs are summed (all-reduce) before the bias."""

    def __init__(self, in_features, out_features, bias=False, dtype=torch.float32, device="cpu", quant_method=None):
        super().__init__(in_features, [out_features], bias, dtype, device, quant_method, tp_mode="row")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The bias joins on rank 0 only, so the all-reduce sums it exactly once.
        y = self.quant_method.apply(self, x, self.bias if self.tp_rank == 0 else None)
        if self.tp_size > 1:
            from ember.distributed.comm import all_reduce

            y = all_reduce(y)
        return y
