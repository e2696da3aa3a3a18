"""The MTP (multi-token prediction) block for ember's Llama / Qwen2 / Qwen3 / Qwen3-MoE models.

Math (formats.md §4). For a flat row r of a step that carries token t_{i+1} at position i and
the hidden state h_i:

    e = Embed(t_{i+1})                        main model's embedding (shared)
    x = Proj(concat[Norm_e(e), Norm_h(h_i)])  MiMo: concat[Norm_h(h_i), Norm_e(e)]
    y = Block(x, position i)                  one ember LlamaDecoderLayer, own paged KV cache
    g = FinalNorm(y)                          y is the residual stream (residual + out)
    logits = Head(g)                          the layer's own `shared_head.head` if the checkpoint
                                              has one (DeepSeek/GLM), else the main LM head

g is both what gets logits and the hidden recycled into the next draft step (as current vLLM and
HF's MtpLayer do). Draft step j runs layer j % num_layers, so k > num_layers reuses them in turn.

Three published layouts differ only in names (ember.spec.mtp_weights maps them) and in:
- MiMo puts the hidden state first in the concat;
- Qwen3-Next / Qwen3.5 norms are zero-centred: rms(x) * (1 + w) in fp32. ember applies this to
  every norm of an MTP layer in that layout (pre_fc norms, mtp.norm and the block's input,
  post-attention and q/k norms), as Qwen3-Next's own decoder layer does;
- DeepSeek/GLM and MiMo set the embedding to zero at position 0 (vLLM's deepseek_mtp,
  glm4_moe_mtp and mimo_mtp do `where(positions == 0, 0, embeds)`: there is no token before the
  first one to condition on). Qwen3-Next's MTP layer (vLLM and HF) does not, and neither do we.

The block is built from the (main) model config, as the main layers are: the main model's
make_mlp(cfg, num_hidden_layers + j) picks dense SwiGLU or a sparse MoE block, so a Qwen3-MoE
model gets a MoE MTP block unless the index is in mlp_only_layers. MTP layers are always dense
(unquantized), whatever the main model's quantization.

KV cache: each MTP layer has its own [2, num_blocks, block_size, Hkv, D] cache, in the same layout
and read through the same AttentionMetadata (block tables, slot_mapping) as the main layers: the
engine gives the pool one more layer per MTP layer and shares the sequences' block tables.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from ember.kernels.metadata import AttentionMetadata, RowSelection
from ember.layers.embedding import LMHead
from ember.layers.linear import ReplicatedLinear
from ember.layers.norm import RMSNorm
from ember.layers.rotary import RotaryEmbedding
from ember.model_config import ModelConfig
from ember.models.llama import LlamaDecoderLayer, LlamaForCausalLM

LAYOUTS = ("deepseek", "mimo", "qwen3_next")


class ZeroCenteredRMSNorm(RMSNorm):
    """Qwen3-Next's RMSNorm: rms(x) * (1 + w), all in fp32, cast back at the end. w starts at 0."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu"):
        super().__init__(hidden_size, eps, dtype, device)
        self.weight.data.zero_()

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)


def _zero_center_block_norms(block: LlamaDecoderLayer, cfg: ModelConfig, dtype, device) -> None:
    eps = cfg.rms_norm_eps
    block.input_layernorm = ZeroCenteredRMSNorm(cfg.hidden_size, eps, dtype, device)
    block.post_attention_layernorm = ZeroCenteredRMSNorm(cfg.hidden_size, eps, dtype, device)
    attn = block.self_attn
    if attn.qk_norm:
        attn.q_norm = ZeroCenteredRMSNorm(cfg.head_dim, eps, dtype, device)
        attn.k_norm = ZeroCenteredRMSNorm(cfg.head_dim, eps, dtype, device)


class MTPLayer(nn.Module):
    """One MTP depth: enorm, hnorm, eh_proj, a decoder block, final_norm and an optional own head.

    shared: another MTPLayer whose enorm / hnorm / eh_proj / final_norm this one uses (Qwen3-Next
    has one mtp.fc and one set of mtp norms for all of its mtp.layers.*)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, dtype, device, attn_backend, mlp: nn.Module,
                 hidden_first: bool = False, zero_centered: bool = False, own_head: bool = False,
                 shared: "MTPLayer | None" = None):
        super().__init__()
        H, eps = cfg.hidden_size, cfg.rms_norm_eps
        norm = ZeroCenteredRMSNorm if zero_centered else RMSNorm
        if shared is None:
            self.enorm = norm(H, eps, dtype, device)
            self.hnorm = norm(H, eps, dtype, device)
            self.eh_proj = ReplicatedLinear(2 * H, H, bias=False, dtype=dtype, device=device)
            self.final_norm = norm(H, eps, dtype, device)
        else:
            self.enorm, self.hnorm, self.eh_proj, self.final_norm = (
                shared.enorm, shared.hnorm, shared.eh_proj, shared.final_norm)
        self.block = LlamaDecoderLayer(cfg, layer_idx, dtype, device, attn_backend, mlp)
        if zero_centered:
            _zero_center_block_norms(self.block, cfg, dtype, device)
        self.head = LMHead(cfg.vocab_size, H, dtype, device) if own_head else None
        self.hidden_first = hidden_first

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, cos_sin, kv_cache: torch.Tensor,
                meta: AttentionMetadata, select: RowSelection | None = None) -> torch.Tensor:
        e, h = self.enorm(embeds), self.hnorm(hidden.to(embeds.dtype))
        x = self.eh_proj(torch.cat((h, e) if self.hidden_first else (e, h), dim=-1))
        out, residual = self.block(x, None, cos_sin, kv_cache, meta, select)
        if select is not None and select.meta is None:
            return out  # [0, H]: only the K/V write was needed
        g, _ = self.final_norm(out, residual)
        return g


def dense_mlp_factory(main: LlamaForCausalLM, cfg: ModelConfig, dtype, device) -> Callable[[int], nn.Module]:
    """layer index -> the MLP the main model would build at that index (dense or MoE), unquantized."""

    def make(layer_idx: int) -> nn.Module:
        saved, main.quant_config = main.quant_config, None
        try:
            return main.make_mlp(cfg, layer_idx, dtype, device)
        finally:
            main.quant_config = saved

    return make


class MTPModule(nn.Module):
    """num_layers MTP layers sharing the main model's embedding, LM head and (when the block config
    matches) its rotary table. Parameters: layers.{j}.{enorm,hnorm,eh_proj,block.*,final_norm,head}."""

    # Checkpoint block names -> ember's fused modules: the main model's routing, reused as is.
    stacked_params = LlamaForCausalLM.stacked_params
    route_weight = LlamaForCausalLM.route_weight

    def __init__(self, main: LlamaForCausalLM, num_layers: int, layout: str = "deepseek",
                 block_cfg: ModelConfig | None = None, own_heads: list[bool] | None = None,
                 attn_backend=None, make_mlp: Callable[[int], nn.Module] | None = None):
        super().__init__()
        if layout not in LAYOUTS:
            raise ValueError(f"unknown MTP layout {layout!r}; one of {LAYOUTS}")
        if num_layers < 1:
            raise ValueError("an MTP module needs at least one layer")
        cfg = block_cfg or main.cfg
        dtype, device = main.dtype, main.device
        if attn_backend is None:
            attn_backend = main.model.layers[0].self_attn.attn.backend
        if make_mlp is None:
            make_mlp = dense_mlp_factory(main, cfg, dtype, device)
        own_heads = list(own_heads or [False] * num_layers)
        self.cfg, self.layout, self.dtype, self.device = cfg, layout, dtype, device
        # Plain attributes, not submodules: they belong to (and are loaded with) the main model.
        rotary = main.model.rotary
        if (cfg.head_dim, cfg.rope, cfg.max_position_embeddings) != (
                main.cfg.head_dim, main.cfg.rope, main.cfg.max_position_embeddings):
            self.rotary = rotary = RotaryEmbedding(cfg.head_dim, cfg.rope, cfg.max_position_embeddings, device)
        object.__setattr__(self, "_embed", main.model.embed_tokens)
        object.__setattr__(self, "_lm_head", main.lm_head)
        object.__setattr__(self, "_rotary", rotary)
        self.zero_embed_at_pos0 = layout in ("deepseek", "mimo")
        base = main.cfg.num_layers
        layers: list[MTPLayer] = []
        for j in range(num_layers):
            layers.append(MTPLayer(
                cfg, base + j, dtype, device, attn_backend, make_mlp(base + j),
                hidden_first=layout == "mimo", zero_centered=layout == "qwen3_next", own_head=own_heads[j],
                shared=layers[0] if layout == "qwen3_next" and j > 0 else None))
        self.layers = nn.ModuleList(layers)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """Shape of each MTP layer's paged cache (this rank's kv heads). Equal to a main layer's unless
        a separate MTP folder's config gives its block other kv heads or head_dim."""
        attn = self.layers[0].block.self_attn.attn
        return (2, num_blocks, block_size, attn.num_kv_heads, attn.head_dim)

    def layer_for_step(self, step: int) -> int:
        return step % len(self.layers)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
                kv_caches: list[torch.Tensor], meta: AttentionMetadata, step: int = 0,
                select: RowSelection | None = None) -> torch.Tensor:
        """One draft step over a flat varlen batch.

        Row r carries token input_ids[r] = t_{i+1} at positions[r] = i with hidden[r] = h_i (step 0:
        the target's final-normed hidden at position i; later steps: the g this module returned for
        the previous row). kv_caches: one cache per MTP layer; step j uses layer j % num_layers and
        its cache. Every row's K/V is written at meta.slot_mapping. select: as for the main model's
        last layer, keep only these rows after attention (e.g. the last row of each sequence).
        Returns g [T, H] (or [R, H] for select.rows), the post-final-norm hidden: feed it to
        compute_logits and recycle it as the next step's hidden.
        """
        j = self.layer_for_step(step)
        embeds = self._embed(input_ids)
        if self.zero_embed_at_pos0:
            embeds = embeds.masked_fill((positions == 0).unsqueeze(-1), 0)
        cos, sin = self._rotary.get_cos_sin(positions)
        cos_sin = (cos.to(embeds.dtype), sin.to(embeds.dtype))
        return self.layers[j](embeds, hidden, cos_sin, kv_caches[j], meta, select)

    def compute_logits(self, g: torch.Tensor, step: int = 0) -> torch.Tensor:
        """[N, H] -> [N, V] float32, through layer (step % num_layers)'s own head or the main LM head."""
        head = self.layers[self.layer_for_step(step)].head
        return (head if head is not None else self._lm_head)(g)
