"""Hybrid Qwen: Qwen3-Next and Qwen3.5 (dense and MoE, and their vision-language checkpoints served
as text models).

A decoder layer mixes tokens with either Gated DeltaNet (linear attention with a recurrent state,
ember.layers.gated_deltanet; cfg.layer_types says which) or gated full attention: q_proj gives
[q_h | gate_h] per head, q/k get a zero-centred RMSNorm and partial RoPE, and the output is
o_proj(attn * sigmoid(gate)). Every norm except the Gated DeltaNet output norm is zero-centred
(the checkpoint stores w - 1). The MLP is SwiGLU (Qwen3.5 dense, Qwen3-Next's mlp_only_layers) or
a sparse MoE with a shared expert behind a sigmoid gate.

The engine hands each layer its cache: paged KV for an attention layer, a RecurrentState for a
linear one (kv_caches lines up with the layers). Qwen3.5's interleaved MRoPE equals plain partial
RoPE for text (its three position ids are equal), which is all ember serves.
"""

from __future__ import annotations

import logging
import re
from typing import Iterable

import torch
from torch import nn

from ember.config.model_config import LINEAR_ATTENTION, ModelConfig
from ember.errors import ModelLoadError
from ember.kernels.cpu_kernels import CpuKernels
from ember.kernels.metadata import AttentionMetadata, RowSelection
from ember.layers.attention import Attention
from ember.layers.embedding import VocabEmbedding
from ember.layers.gated_deltanet import GatedDeltaNet
from ember.layers.linear import QKVLinear, ReplicatedLinear, RowParallelLinear
from ember.layers.moe import SparseMoeBlock
from ember.layers.norm import ZeroCenteredRMSNorm
from ember.layers.rotary import RotaryEmbedding, apply_rotary
from ember.models.llama import LlamaForCausalLM, LlamaMLP, embedding_method, linear_method

log = logging.getLogger(__name__)


class GatedAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, dtype, device, attn_backend, quant_config=None):
        super().__init__()
        D, H = cfg.head_dim, cfg.num_heads
        prefix = f"model.layers.{layer_idx}.self_attn"
        # q_proj is [q_h | gate_h] per head: as 2H heads of D it fuses (and shards) like any q.
        self.qkv_proj = QKVLinear(
            cfg.hidden_size,
            D,
            2 * H,
            cfg.num_kv_heads,
            bias=cfg.attention_bias,
            dtype=dtype,
            device=device,
            quant_method=linear_method(quant_config, f"{prefix}.qkv_proj"),
        )
        self.o_proj = RowParallelLinear(
            H * D,
            cfg.hidden_size,
            bias=cfg.attention_bias,
            dtype=dtype,
            device=device,
            quant_method=linear_method(quant_config, f"{prefix}.o_proj"),
        )
        self.q_norm = ZeroCenteredRMSNorm(D, cfg.rms_norm_eps, dtype, device)
        self.k_norm = ZeroCenteredRMSNorm(D, cfg.rms_norm_eps, dtype, device)
        self.num_heads = self.qkv_proj.num_heads // 2  # this rank's
        self.attn = Attention(self.num_heads, D, self.qkv_proj.num_kv_heads, D**-0.5, attn_backend, layer_idx)

    def forward(self, x, cos_sin, kv_cache, meta, select: RowSelection | None = None):
        q_gate, k, v = self.qkv_proj.split(self.qkv_proj(x))
        T, D = x.shape[0], self.qkv_proj.head_dim
        q, gate = q_gate.reshape(T, self.num_heads, 2 * D).chunk(2, dim=-1)
        q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = cos_sin
        q, k = apply_rotary(q, cos, sin, False), apply_rotary(k, cos, sin, False)
        o = self.attn(q, k, v, kv_cache, meta, select)
        if select is not None:
            gate = gate[select.rows]
        return self.o_proj((o * torch.sigmoid(gate)).flatten(1))


class SharedExpertMoeBlock(SparseMoeBlock):
    """The routed experts plus a shared SwiGLU expert scaled by sigmoid(shared_expert_gate(x))."""

    def __init__(self, cfg: ModelConfig, dtype, device, quant_config=None, prefix: str = "mlp", kernels=None):
        super().__init__(
            cfg.hidden_size,
            cfg.moe_intermediate_size,
            cfg.num_experts,
            cfg.num_experts_per_tok,
            cfg.norm_topk_prob,
            dtype,
            device,
            quant_config,
            prefix,
            kernels,
        )
        self.shared_expert = None
        if cfg.shared_expert_intermediate_size > 0:
            self.shared_expert = LlamaMLP(
                cfg.hidden_size,
                cfg.shared_expert_intermediate_size,
                dtype,
                device,
                quant_config=quant_config,
                prefix=f"{prefix}.shared_expert",
                kernels=kernels,
            )
            self.shared_expert_gate = ReplicatedLinear(cfg.hidden_size, 1, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        if self.shared_expert is not None:
            y = y + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return y


class HybridDecoderLayer(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        layer_idx: int,
        dtype,
        device,
        attn_backend,
        quant_config,
        kernels,
        attention: bool = False,
    ):
        """attention: a full-attention layer whatever layer_types says (the MTP block, past the last layer)."""
        super().__init__()
        self.is_linear = not attention and cfg.layer_type(layer_idx) == LINEAR_ATTENTION
        prefix = f"model.layers.{layer_idx}"
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(cfg, dtype, device, quant_config, f"{prefix}.linear_attn", kernels)
        else:
            self.self_attn = GatedAttention(cfg, layer_idx, dtype, device, attn_backend, quant_config)
        if cfg.is_moe_layer(layer_idx):
            self.mlp = SharedExpertMoeBlock(cfg, dtype, device, quant_config, f"{prefix}.mlp", kernels)
        else:
            self.mlp = LlamaMLP(
                cfg.hidden_size,
                cfg.intermediate_size,
                dtype,
                device,
                quant_config=quant_config,
                prefix=f"{prefix}.mlp",
                kernels=kernels,
            )
        norm = lambda: ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device, kernels)  # noqa: E731
        self.input_layernorm, self.post_attention_layernorm = norm(), norm()

    def forward(self, h, residual, cos_sin, cache, meta, select: RowSelection | None = None):
        """select (an attention layer that is the last): keep only these rows after attention."""
        if residual is None:
            residual, h = h, self.input_layernorm(h)
        else:
            h, residual = self.input_layernorm(h, residual)
        if self.is_linear:
            h = self.linear_attn(h, cache, meta)  # every row: each one moves the state
        else:
            h = self.self_attn(h, cos_sin, cache, meta, select)
            if select is not None:
                residual = residual[select.rows]
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class HybridModel(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype, device, attn_backend, quant_config, kernels):
        super().__init__()
        self.embed_tokens = VocabEmbedding(
            cfg.vocab_size,
            cfg.hidden_size,
            dtype,
            device,
            quant_method=embedding_method(quant_config, "model.embed_tokens"),
        )
        self.layers = nn.ModuleList(
            HybridDecoderLayer(cfg, i, dtype, device, attn_backend, quant_config, kernels)
            for i in range(cfg.num_layers)
        )
        self.norm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device, kernels)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope, cfg.max_position_embeddings, device)

    def forward(self, input_ids, positions, caches, meta: AttentionMetadata, select: RowSelection | None = None):
        h = self.embed_tokens(input_ids)
        cos, sin = self.rotary.get_cos_sin(positions)
        cos_sin = (cos.to(h.dtype), sin.to(h.dtype))
        residual = None
        last = len(self.layers) - 1
        for i, (layer, cache) in enumerate(zip(self.layers, caches)):
            sel = (
                select if i == last and not layer.is_linear and select is not None and select.meta is not None else None
            )
            h, residual = layer(h, residual, cos_sin, cache, meta, sel)
        if select is not None and h.shape[0] != select.rows.numel():  # the last layer ran every row
            if select.meta is None:
                return h[:0]
            h, residual = h[select.rows], residual[select.rows]
        h, _ = self.norm(h, residual)
        return h


class Qwen3NextForCausalLM(LlamaForCausalLM):
    """Loads through LlamaForCausalLM's routing (fused q/k/v, gate/up, experts); linear-attention
    tensors go to their layer's own loader, a VL checkpoint's text names lose their prefix."""

    _LINEAR = re.compile(r"(model\.layers\.\d+\.linear_attn)\.(.+)")

    def __init__(self, cfg: ModelConfig, *args, **kwargs):
        if cfg.num_experts_per_tok <= 0 and cfg.num_experts > 0:
            raise ModelLoadError(f"{cfg.architecture} needs num_experts_per_tok > 0 in config.json")
        super().__init__(cfg, *args, **kwargs)

    def make_body(self, cfg: ModelConfig, dtype, device, attn_backend, quant_config, kernels: CpuKernels) -> nn.Module:
        return HybridModel(cfg, dtype, device, attn_backend, quant_config, kernels)

    def make_recurrent_states(self, num_slots: int, device) -> list:
        """One RecurrentState per linear-attention layer, None for the attention layers (their KV is paged)."""
        return [
            layer.linear_attn.make_state(num_slots, device) if layer.is_linear else None for layer in self.model.layers
        ]

    @staticmethod
    def copy_states(states: list, copies: list[tuple[int, int]]) -> None:
        """Slot to slot (prefix-cache snapshot restores), in order, in every linear-attention layer."""
        for src, dst in copies:
            for st in states:
                st.copy(src, dst)

    @staticmethod
    def commit_states(states: list, accepted: dict[int, int]) -> None:
        """After a verify: slot -> drafts accepted (RecurrentState.commit), in every linear-attention layer."""
        for st in states:
            st.commit(accepted)

    def skip_weight(self, name: str) -> bool:
        return name.startswith(("mtp.", "model.visual.")) or super().skip_weight(name)

    def route_weight(self, name: str, params: dict, modules: dict):
        if m := self._LINEAR.fullmatch(name):
            return m[1], m[2], None
        return super().route_weight(name, params, modules)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        if not self.cfg.traits.vision_language:
            return super().load_weights(weights)
        return super().load_weights(self._text_names(weights))

    @staticmethod
    def _text_names(weights):
        """The VL layout: model.language_model.* is the text model; the vision tower is skipped."""
        skipped = 0
        for name, tensor in weights:
            if name.startswith("model.visual."):
                skipped += 1
                continue
            yield name.replace("model.language_model.", "model.", 1), tensor
        if skipped:
            log.info("serving the text model: skipped %d vision-tower tensors (model.visual.*)", skipped)


class Qwen3_5ForCausalLM(Qwen3NextForCausalLM):
    """Qwen3.5 dense: split Gated DeltaNet projections, a SwiGLU MLP in every layer."""


class Qwen3_5MoeForCausalLM(Qwen3NextForCausalLM):
    """Qwen3.5 MoE: every layer sparse, top-k always renormalised."""


class Qwen3_5ForConditionalGeneration(Qwen3_5ForCausalLM):
    """The published Qwen3.5 (vision-language) checkpoint served as its text model: text weights
    under model.language_model.*, the vision tower skipped, config under text_config."""


class Qwen3_5MoeForConditionalGeneration(Qwen3_5MoeForCausalLM):
    """The published Qwen3.5-MoE (vision-language) checkpoint served as its text model."""
