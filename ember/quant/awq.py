"""AutoAWQ / vLLM-format AWQ checkpoints (`--quantization awq`): 4-bit, group-wise, with zero points,
"GEMM" packing (formats.md §1). Tensors per quantized Linear: qweight int32 [in, out/8],
qzeros int32 [in/G, out/8], scales fp16 [in/G, out]; y = x @ Wd with Wd[k, n] = (q - z) * s.

Where the weights run:
- CPU: after loading, each Linear (fused q/k/v or gate/up as one) is repacked exactly into ONE
  Int4Weight (torch's CPU int4 kernel layout) and the AWQ tensors are freed. Shapes that kernel
  cannot take (N % 64, G not in 32..256) keep the AWQ tensors and dequantize on the fly.
- CUDA: the AWQ tensors stay as loaded; fewer than 256 rows go through the Triton AWQ GEMM,
  more through a dequantize + dense matmul (vLLM's split); without triton, always the latter.

Embeddings, the LM head and norms stay dense, and so does every module that
`modules_to_not_convert` names (typically the MoE router `mlp.gate`).
"""

from __future__ import annotations

import torch
from torch import nn

from ember.errors import ModelLoadError, UnsupportedModelError
from ember.kernels.cpu_kernels import CpuKernels
from ember.layers.activation import silu_and_mul
from ember.layers.linear import QuantMethod, copy_checked, new_param
from ember.layers.moe_compute import experts_forward, register_experts
from ember.quant import gemm_dispatch
from ember.quant.awq_packing import dequantize_awq, unpack_awq
from ember.quant.int4_cpu import Int4Weight
from ember.quant.quant_config import QuantConfig

PACK = 8  # 4-bit values per int32
# Our fused layers and the HF modules they hold, for matching modules_to_not_convert.
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
REQUANTIZE = "or quantize the full-precision model with `ember quantize MODEL --method awq --out DIR`"


def names_module(entry: str, name: str) -> bool:
    """Does modules_to_not_convert entry `entry` name module `name`? Whole dotted components must
    match ("mlp.gate" names "model.layers.0.mlp.gate", not "...mlp.gate_proj"), unlike vLLM's plain
    substring test, under which the common entry "gate" would also swallow every gate_proj."""
    e, n = entry.strip(".").split("."), name.split(".")
    return any(n[i : i + len(e)] == e for i in range(len(n) - len(e) + 1))


class AWQConfig(QuantConfig):
    name = "awq"

    def __init__(self, group_size: int, modules_to_not_convert: list[str] | None = None):
        self.group_size = group_size  # -1: one group over the whole input
        self.modules_to_not_convert = list(modules_to_not_convert or [])

    @classmethod
    def from_settings(cls, d: dict) -> "AWQConfig":
        """From config.json's quantization_config or an old quant_config.json (w_bit, q_group_size, ...)."""
        bits = int(d.get("bits", d.get("w_bit", 4)))
        if bits != 4:
            raise UnsupportedModelError(
                f"this AWQ checkpoint has {bits}-bit weights; ember runs 4-bit AWQ only. "
                f"Use a 4-bit AWQ export, {REQUANTIZE}"
            )
        group_size = int(d.get("group_size", d.get("q_group_size", 128)))
        if group_size != -1 and group_size <= 0:
            raise UnsupportedModelError(f"AWQ group_size {group_size} is invalid (a positive size or -1)")
        if not d.get("zero_point", True):
            raise UnsupportedModelError(
                "this AWQ checkpoint is symmetric (zero_point: false), which ember does not support (neither do "
                f"vLLM's AWQ kernels). Use an AWQ export made with zero_point true, {REQUANTIZE}"
            )
        version = str(d.get("version", "gemm")).lower()
        if version != "gemm":
            raise UnsupportedModelError(
                f"this AWQ checkpoint uses the {version!r} packing; ember reads AutoAWQ's GEMM packing only "
                f"(version 'gemm'). Use a GEMM export, {REQUANTIZE}"
            )
        return cls(group_size, d.get("modules_to_not_convert"))

    def _skipped(self, prefix: str) -> bool:
        """True if prefix stays dense. A fused layer is skipped only if all its HF modules are."""
        parent, _, leaf = prefix.rpartition(".")
        names = [f"{parent}.{m}" for m in FUSED.get(leaf, ())] or [prefix]
        hit = [any(names_module(e, n) for e in self.modules_to_not_convert) for n in names]
        if all(hit) or any(names_module(e, prefix) for e in self.modules_to_not_convert):
            return True
        if any(hit):
            raise UnsupportedModelError(
                f"modules_to_not_convert keeps only some of {', '.join(names)} dense; ember fuses them into "
                f"{prefix} and needs them all quantized or all dense. Fix modules_to_not_convert in config.json"
            )
        return False

    def linear_method(self, prefix: str):
        return None if self._skipped(prefix) else AWQLinearMethod(self.group_size)

    def experts_method(self, prefix: str):
        return None if self._skipped(prefix) else AWQExpertsMethod(self.group_size)


def _group(group_size: int, in_features: int) -> int:
    return in_features if group_size == -1 else group_size


def _awq_params(in_f: int, out_f: int, G: int, device, lead: tuple = ()) -> dict[str, nn.Parameter]:
    """qweight [*lead, in, out/8] int32, qzeros [*lead, in/G, out/8] int32, scales [*lead, in/G, out] fp16."""
    d = len(lead)
    shapes = {
        "qweight": ((in_f, out_f // PACK), torch.int32),
        "qzeros": ((in_f // G, out_f // PACK), torch.int32),
        "scales": ((in_f // G, out_f), torch.float16),
    }
    return {
        k: new_param(lead + shape, dtype, device, output_dim=d + 1, input_dim=d) for k, (shape, dtype) in shapes.items()
    }


def _check_shapes(what: str, in_f: int, outs: list[int], G: int) -> None:
    if in_f % G:
        raise ModelLoadError(
            f"{what}: input size {in_f} is not a multiple of the AWQ group size {G}; "
            "the checkpoint's group_size does not fit this model"
        )
    bad = [n for n in outs if n % PACK]
    if bad:
        raise ModelLoadError(
            f"{what}: AWQ needs output sizes that are multiples of 8, got {bad}; list this module in "
            "modules_to_not_convert if the checkpoint keeps it dense"
        )


def _load_awq(dst: torch.Tensor, name: str, tensor: torch.Tensor, what: str) -> None:
    if name in ("qweight", "qzeros") and tensor.dtype != torch.int32:
        raise ModelLoadError(
            f"{what} is {tensor.dtype}, but AWQ {name} is packed int32; the checkpoint is not an AWQ GEMM export"
        )
    copy_checked(dst, tensor, what)


def to_int4(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, G: int, dtype) -> Int4Weight:
    """Exact repack of one AWQ matrix into the CPU int4 kernel's layout: Wd^T = q * s - z * s."""
    q = unpack_awq(qweight).t()  # [N, K]
    s = scales.float().t()  # [N, K/G]
    z = unpack_awq(qzeros).float().t()
    return Int4Weight.from_affine(q, s, -z * s, G, dtype)


def awq_matmul(
    x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, G: int
) -> torch.Tensor:
    """x [M, K] @ Wd [K, N] from AWQ tensors, in x's dtype (the paths that keep AWQ tensors)."""
    if x.is_cuda:
        from ember.kernels import triton_awq

        if triton_awq.available():
            if gemm_dispatch.awq_fused(x) and triton_awq.block_k_for(G) is not None:
                return triton_awq.awq_gemm(x, qweight, qzeros, scales, G)
            return x @ triton_awq.awq_dequantize(qweight, qzeros, scales, G, dtype=x.dtype)
    # (q - z) * s in fp32 is exact (a small integer times an fp16); one rounding to x's dtype.
    return x @ dequantize_awq(qweight, qzeros, scales.float(), G).to(x.dtype)


class AWQLinearMethod(QuantMethod):
    def __init__(self, group_size: int):
        self.group_size = group_size

    def create_weights(self, layer, in_features, out_features_per_shard, dtype, device):
        G = _group(self.group_size, in_features)
        _check_shapes(type(layer).__name__, in_features, out_features_per_shard, G)
        for name, p in _awq_params(in_features, sum(out_features_per_shard), G, device).items():
            setattr(layer, name, p)
        layer.awq_group_size, layer.awq_dtype = G, dtype

    def load_weight(self, layer, param_name, tensor, shard_id):
        what = param_name if shard_id is None else f"{param_name} shard {shard_id!r}"
        _load_awq(layer.shard_view(getattr(layer, param_name), shard_id), param_name, tensor, what)

    def process_weights_after_loading(self, layer):
        K, N, G = layer.in_features, layer.out_features, layer.awq_group_size
        if layer.qweight.device.type != "cpu" or not Int4Weight.supports(N, K, G):
            return  # CUDA: Triton over the AWQ tensors; CPU odd shapes: dequantize on the fly
        w = to_int4(layer.qweight, layer.qzeros, layer.scales, G, layer.awq_dtype)
        del layer.qweight, layer.qzeros, layer.scales
        layer.register_buffer("int4_packed", w.packed)
        layer.register_buffer("int4_scales_zeros", w.scales_zeros)

    def apply(self, layer, x, bias=None):
        K, N, G = layer.in_features, layer.out_features, layer.awq_group_size
        if hasattr(layer, "int4_packed"):
            return Int4Weight(layer.int4_packed, layer.int4_scales_zeros, G, N, K).linear(x, bias)
        y = awq_matmul(x.reshape(-1, K), layer.qweight, layer.qzeros, layer.scales, G)
        if bias is not None:
            y = y + bias
        return y.view(*x.shape[:-1], N)

    def dense_weight(self, layer) -> torch.Tensor:
        """W [N, K] in float32 (for a dense copy: ember.quant.weight_copies)."""
        K, N, G = layer.in_features, layer.out_features, layer.awq_group_size
        if hasattr(layer, "int4_packed"):
            return Int4Weight(layer.int4_packed, layer.int4_scales_zeros, G, N, K).dequantize(torch.float32)
        return dequantize_awq(layer.qweight, layer.qzeros, layer.scales.float(), G).t()


class AWQExpertsMethod:
    """Builds the AWQ experts module for a SparseMoeBlock."""

    def __init__(self, group_size: int):
        self.group_size = group_size

    def create_experts(self, num_experts, hidden_size, intermediate_size, dtype, device, tp=(0, 1), kernels=None):
        experts = AWQExperts(
            num_experts, hidden_size, intermediate_size, self.group_size, dtype, device, tp=tp, kernels=kernels
        )
        experts.quant_method = self  # so ember.quant.process_weights_after_loading calls the hook below
        return experts

    def process_weights_after_loading(self, experts: "AWQExperts") -> None:
        experts.repack_for_cpu()


class AWQExperts(nn.Module):
    """E AWQ SwiGLU experts stacked like vLLM's: w13_* (gate;up, [E, H, 2I/8] ...) and w2_* ([E, I, H/8] ...),
    loaded from per-expert checkpoint names ("{e}.gate_proj.qweight", ...). Computes like
    `Experts`: token slots grouped by expert, one int4 GEMM pair per expert that has tokens."""

    def __init__(
        self,
        num_experts,
        hidden_size,
        intermediate_size,
        group_size,
        dtype,
        device="cpu",
        tp=(0, 1),
        kernels: CpuKernels | None = None,
    ):
        """intermediate_size: this rank's slice; tp (rank, size): checkpoint tensors are narrowed to it
        (gate/up along their packed output columns, down along its input rows and groups)."""
        super().__init__()
        self.tp = tp
        self.fused_act = (kernels or CpuKernels()).fused_elementwise
        E, H, I = num_experts, hidden_size, intermediate_size
        self.num_experts, self.hidden_size, self.intermediate_size, self.dtype = E, H, I, dtype
        self.g13, self.g2 = _group(group_size, H), _group(group_size, I)
        _check_shapes("experts gate_up_proj", H, [I, I], self.g13)
        _check_shapes("experts down_proj", I, [H], self.g2)
        for prefix, (in_f, out_f, G) in {"w13": (H, 2 * I, self.g13), "w2": (I, H, self.g2)}.items():
            for name, p in _awq_params(in_f, out_f, G, device, lead=(E,)).items():
                setattr(self, f"{prefix}_{name}", p)
        self.int4 = False
        self.graph_key = register_experts(self)

    def expected_shards(self, param_name: str) -> set:
        E = range(self.num_experts)
        return {(e, s) for e in E for s in ("gate", "up")} if param_name.startswith("w13") else set(E)

    def load_weight(self, name: str, tensor: torch.Tensor, shard_id=None):
        parts = name.split(".")  # "{e}.{gate|up|down}_proj.{qweight|qzeros|scales}"
        if (
            len(parts) != 3
            or not parts[0].isdigit()
            or parts[1] not in ("gate_proj", "up_proj", "down_proj")
            or parts[2] not in ("qweight", "qzeros", "scales")
        ):
            raise ModelLoadError(
                f"unexpected AWQ expert tensor name {name!r} (expected "
                "'{e}.{gate|up|down}_proj.{qweight|qzeros|scales}'); if the checkpoint keeps the "
                "experts dense, list them in modules_to_not_convert"
            )
        e, kind, pname = int(parts[0]), parts[1][:-5], parts[2]
        if e >= self.num_experts:
            raise ModelLoadError(f"checkpoint has expert {e} but config.json says num_experts={self.num_experts}")
        what = f"experts.{name}"
        r, n = self.tp
        if n > 1:  # AWQ is [in, out]: down splits its input (dim 0), gate/up their output (dim 1)
            part = tensor.shape[0 if kind == "down" else 1] // n
            tensor = tensor.narrow(0 if kind == "down" else 1, r * part, part)
        if kind == "down":
            _load_awq(getattr(self, f"w2_{pname}")[e], pname, tensor, what)
            return f"w2_{pname}", e
        param = getattr(self, f"w13_{pname}")[e]
        half = param.shape[-1] // 2  # gate in the first half of the (packed) output columns, up in the second
        _load_awq(param[:, :half] if kind == "gate" else param[:, half:], pname, tensor, what)
        return f"w13_{pname}", (e, kind)

    def repack_for_cpu(self) -> None:
        """On CPU, repack every expert exactly into Int4Weight buffers and free the AWQ tensors."""
        if self.w13_qweight.device.type != "cpu":
            return
        E, H, I = self.num_experts, self.hidden_size, self.intermediate_size
        if not (Int4Weight.supports(2 * I, H, self.g13) and Int4Weight.supports(H, I, self.g2)):
            return  # dequantize per expert on the fly
        for prefix, G in (("w13", self.g13), ("w2", self.g2)):
            qw, qz, s = (getattr(self, f"{prefix}_{n}") for n in ("qweight", "qzeros", "scales"))
            ws = [to_int4(qw[e], qz[e], s[e], G, self.dtype) for e in range(E)]
            for n in ("qweight", "qzeros", "scales"):
                delattr(self, f"{prefix}_{n}")
            self.register_buffer(f"{prefix}_packed", torch.stack([w.packed for w in ws]))
            self.register_buffer(f"{prefix}_scales_zeros", torch.stack([w.scales_zeros for w in ws]))
        self.int4 = True

    def _linear(self, prefix: str, e: int, x: torch.Tensor, K: int, N: int, G: int) -> torch.Tensor:
        if self.int4:
            return Int4Weight(
                getattr(self, f"{prefix}_packed")[e], getattr(self, f"{prefix}_scales_zeros")[e], G, N, K
            ).linear(x)
        return awq_matmul(
            x,
            getattr(self, f"{prefix}_qweight")[e],
            getattr(self, f"{prefix}_qzeros")[e],
            getattr(self, f"{prefix}_scales")[e],
            G,
        )

    def expert_forward(self, e: int, x: torch.Tensor) -> torch.Tensor:
        H, I = self.hidden_size, self.intermediate_size
        h = silu_and_mul(self._linear("w13", e, x, H, 2 * I, self.g13), self.fused_act)
        return self._linear("w2", e, h, I, H, self.g2)

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        return experts_forward(self, x, topk_ids, topk_weights)
