"""QuantConfig: the base of every quantization method's per-checkpoint settings (AWQConfig,
GGUFConfig). Its own module, so that the methods subclass it without importing ember.quant's
__init__, which imports them (resolve_quant_config)."""

from __future__ import annotations

from ember.kernels.cpu_kernels import CpuKernels


class QuantConfig:
    """Per-checkpoint quantization settings; a factory of per-layer QuantMethods.

    kernels: the model's CpuKernels, handed to the methods it makes (packed GGUF weights take the
    tiled GEMV's layout only where they allow it); set by resolve_quant_config."""

    name = "none"
    kernels: CpuKernels = CpuKernels()

    def linear_method(self, prefix: str):
        """QuantMethod for the Linear at `prefix` (fused names: qkv_proj, gate_up_proj), or None for dense."""
        return None

    def experts_method(self, prefix: str):
        """Method for the stacked MoE experts at `prefix` ("model.layers.N.mlp.experts"), or None for dense."""
        return None

    def checkpoint_weights(self, weights):
        """The checkpoint's (name, tensor) stream as this method's layers take it (ember.quant.fp8 expands
        its block scales to rows there); the identity by default."""
        return weights

    def embedding_method(self, prefix: str):
        """Method for the token embedding / untied LM head at `prefix`, or None for dense."""
        return None
