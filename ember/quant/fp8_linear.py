"""The fp8 QuantMethods: a Linear's (or the stacked MoE experts') weight kept float8_e4m3fn with the
checkpoint's block scales, dequantized a tile at a time inside the GEMV (ember.quant.fp8 reads the format).

Storage, per Linear (fused ones included: q | k | v, gate | up, Gated DeltaNet's q | k | v | z):
- `weight` float8_e4m3fn [N, K], exactly the checkpoint's bytes, its parts side by side;
- while loading, `weight_scale_inv` float32 [N, KB]: one row of block scales per weight row (the stream
  expands them: ember.quant.fp8_blocks), so they land where their rows land under any fuse or TP split;
- after loading, `fp8_scale` [B, KB] (the checkpoint's scale rows, a part starting mid-block keeping its
  own copy of the block row it shares) and `fp8_scale_row` int32 [N].
Tensor parallelism: a column split narrows rows, which always works; a row-parallel split narrows the input
dim, which must fall on a scale block boundary (K / tp a multiple of the block's width), else the layer is
refused at build time with what to do.

Compute: CPU -> the C++ GEMV (ember.kernels.cpu_fp8_gemv; float32 products, x and y float32); CUDA ->
the Triton GEMM (ember.kernels.triton_fp8); elsewhere, or without them -> the reference, which dequantizes
the weight for the call (fp8_blocks.dequantize) and frees it after.
"""

from __future__ import annotations

import torch

from ember.errors import ModelLoadError, UnsupportedModelError
from ember.kernels.cpu_kernels import CpuKernels
from ember.layers.linear import QuantMethod, copy_checked, new_param
from ember.quant import fp8_blocks

FP8_GEMV_MAX_ROWS = 32  # rows of x the CPU kernel's GEMV takes; more: decoded panels for torch's GEMM


def cpu_kernel_ready(kernels: CpuKernels | None, device) -> bool:
    """Whether the C++ fp8 GEMV runs this model's layers (built or loaded on first ask)."""
    from ember.kernels import cpu_fp8_gemv

    return torch.device(device).type == "cpu" and (kernels or CpuKernels()).fp8_gemv and cpu_fp8_gemv.available()


def fp8_matmul(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, scale_row: torch.Tensor, block_k: int, cpu_kernel: bool
) -> torch.Tensor:
    """x [M, K] @ W^T for W = weight * its block scales -> [M, N] in x's dtype."""
    if x.device.type == "cpu" and cpu_kernel:
        from ember.kernels import cpu_fp8_gemv

        y = cpu_fp8_gemv.linear(x.float().contiguous(), weight, scale, scale_row, block_k, FP8_GEMV_MAX_ROWS)
        return y.to(x.dtype)
    if x.is_cuda:
        from ember.kernels import triton_fp8

        if triton_fp8.available() and triton_fp8.block_k_for(block_k) is not None:
            return triton_fp8.fp8_linear(x, weight, scale, scale_row, block_k)
    return x @ fp8_blocks.dequantize(weight, scale, scale_row, block_k, x.dtype).t()


def _check_loaded(what: str, name: str, tensor: torch.Tensor) -> None:
    if name.endswith("weight_scale_inv") or name.endswith("_scale_inv"):
        return
    if tensor.dtype != fp8_blocks.FP8_DTYPE:
        raise ModelLoadError(
            f"{what} is {tensor.dtype}, but the checkpoint's other parts of this layer are fp8 "
            "(quantization_config.quant_method 'fp8'); the checkpoint mixes formats within one matrix"
        )


def _check_row_split(what: str, in_local: int, block_k: int, tp_size: int) -> None:
    if tp_size > 1 and in_local % block_k:
        raise UnsupportedModelError(
            f"{what}: --tensor-parallel-size {tp_size} splits its {in_local * tp_size} inputs into parts of "
            f"{in_local}, which cuts the checkpoint's {block_k}-wide fp8 scale blocks. Use a tensor-parallel size "
            f"that splits its {-(-in_local * tp_size // block_k)} blocks evenly, or the bf16 checkpoint"
        )


class FP8LinearMethod(QuantMethod):
    def __init__(self, block: tuple[int, int], kernels: CpuKernels | None = None):
        self.block, self.kernels = block, kernels

    def create_weights(self, layer, in_features, out_features_per_shard, dtype, device):
        bk = self.block[1]
        if layer.tp_mode == "row":
            _check_row_split(type(layer).__name__, in_features, bk, layer.tp_size)
        N = sum(out_features_per_shard)
        layer.weight = new_param((N, in_features), fp8_blocks.FP8_DTYPE, device, output_dim=0, input_dim=1)
        KB = fp8_blocks.blocks(in_features, bk)
        layer.weight_scale_inv = new_param((N, KB), torch.float32, device, output_dim=0, input_dim=1)
        layer.fp8_block_k = bk

    def load_weight(self, layer, param_name, tensor, shard_id):
        what = param_name if shard_id is None else f"{param_name} shard {shard_id!r}"
        _check_loaded(what, param_name, tensor)
        copy_checked(layer.shard_view(getattr(layer, param_name), shard_id), tensor, what)

    def process_weights_after_loading(self, layer):
        scale, scale_row = fp8_blocks.fold_rows(layer.weight_scale_inv.data)
        del layer.weight_scale_inv
        device = layer.weight.device
        layer.register_buffer("fp8_scale", scale.to(device))
        layer.register_buffer("fp8_scale_row", scale_row.to(device))
        layer.fp8_cpu_kernel = cpu_kernel_ready(self.kernels, device)

    def apply(self, layer, x, bias=None):
        K, N = layer.in_features, layer.out_features
        cpu = getattr(layer, "fp8_cpu_kernel", False)
        y = fp8_matmul(x.reshape(-1, K), layer.weight, layer.fp8_scale, layer.fp8_scale_row, layer.fp8_block_k, cpu)
        if bias is not None:
            y = y + bias
        return y.view(*x.shape[:-1], N)

    def dense_weight(self, layer) -> torch.Tensor:
        """W [N, K] in float32 (for a dense copy: ember.quant.weight_copies)."""
        return fp8_blocks.dequantize(layer.weight, layer.fp8_scale, layer.fp8_scale_row, layer.fp8_block_k)
