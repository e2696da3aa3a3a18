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

Reduced draft vocabulary (FR-Spec / EAGLE-3 style, what `ember train-mtp` writes): a layer may
carry `draft_vocab`, an int64 index of V_draft token ids, with its own head of V_draft rows
(checkpoint: `shared_head.head.weight` [V_draft, H] + `shared_head.draft_vocab` [V_draft]). The
draft then only proposes tokens inside it, at V_draft / V of the head's cost; speculation stays
lossless because the target verifies. compute_draft_logits gives the [N, V_draft] logits and the
index (propose draft_vocab[argmax]); compute_logits scatters them into [N, V] with -inf elsewhere
(probability 0), so code written for a full head works unchanged.

Training (ember.train.mtp) runs forward_dense: the same weights over whole padded sequences
[B, T] with causal SDPA instead of the paged cache, differentiable, and able to recurse (draft
step s attends to step 0's keys up to its start and to its own chain's earlier steps, exactly
what the paged cache holds when the engine drafts).

KV cache: each MTP layer has its own [2, num_blocks, block_size, Hkv, D] cache, in the same layout
and read through the same AttentionMetadata (block tables, slot_mapping) as the main layers: the
engine gives the pool one more layer per MTP layer and shares the sequences' block tables.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ember.config.model_config import ModelConfig
from ember.kernels import cpu_row_top
from ember.kernels.cpu_kernels import CpuKernels
from ember.kernels.metadata import AttentionMetadata, RowSelection
from ember.layers.embedding import LMHead
from ember.layers.linear import ReplicatedLinear
from ember.layers.norm import RMSNorm
from ember.layers.rotary import RotaryEmbedding, apply_rotary
from ember.models.llama import LlamaDecoderLayer, LlamaForCausalLM

LAYOUTS = ("deepseek", "mimo", "qwen3_next")


class ZeroCenteredRMSNorm(RMSNorm):
    """Qwen3-Next's RMSNorm: rms(x) * (1 + w), all in fp32, cast back at the end. w starts at 0."""

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-6,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ):
        super().__init__(hidden_size, eps, dtype, device)
        self.weight.data.zero_()
        self.fused = False  # the C++ RMSNorm computes w * rms(x), not (1 + w) * rms(x)

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

    def __init__(
        self,
        cfg: ModelConfig,
        layer_idx: int,
        dtype,
        device,
        attn_backend,
        mlp: nn.Module,
        hidden_first: bool = False,
        zero_centered: bool = False,
        own_head: bool = False,
        shared: "MTPLayer | None" = None,
        draft_vocab_size: int | None = None,
        kernels: CpuKernels | None = None,
    ):
        super().__init__()
        H, eps = cfg.hidden_size, cfg.rms_norm_eps
        if zero_centered:

            def norm(n):
                return ZeroCenteredRMSNorm(n, eps, dtype, device)
        else:

            def norm(n):
                return RMSNorm(n, eps, dtype, device, kernels)

        if shared is None:
            self.enorm = norm(H)
            self.hnorm = norm(H)
            self.eh_proj = ReplicatedLinear(2 * H, H, bias=False, dtype=dtype, device=device)
            self.final_norm = norm(H)
        else:
            self.enorm, self.hnorm, self.eh_proj, self.final_norm = (
                shared.enorm,
                shared.hnorm,
                shared.eh_proj,
                shared.final_norm,
            )
        if cfg.is_hybrid:  # Qwen3-Next / Qwen3.5's own MTP: the model's gated full-attention layer (MoE and all)
            from ember.models.qwen3_next import HybridDecoderLayer

            self.block = HybridDecoderLayer(cfg, layer_idx, dtype, device, attn_backend, None, kernels, attention=True)
        else:
            self.block = LlamaDecoderLayer(cfg, layer_idx, dtype, device, attn_backend, mlp, kernels=kernels)
            if zero_centered:
                _zero_center_block_norms(self.block, cfg, dtype, device)
        if draft_vocab_size is not None and not 0 < draft_vocab_size <= cfg.vocab_size:
            raise ValueError(f"draft_vocab_size {draft_vocab_size} must be in 1..{cfg.vocab_size}")
        rows = draft_vocab_size or cfg.vocab_size
        self.head = LMHead(rows, H, dtype, device) if own_head or draft_vocab_size else None
        # token id of each head row (reduced draft vocabulary), else None: the head covers every id
        self.register_buffer(
            "draft_vocab",
            None if draft_vocab_size is None else torch.arange(draft_vocab_size, dtype=torch.int64, device=device),
        )
        self.hidden_first = hidden_first

    def forward(
        self,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        cos_sin,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        select: RowSelection | None = None,
    ) -> torch.Tensor:
        e, h = self.enorm(embeds), self.hnorm(hidden.to(embeds.dtype))
        x = self.eh_proj(torch.cat((h, e) if self.hidden_first else (e, h), dim=-1))
        out, residual = self.block(x, None, cos_sin, kv_cache, meta, select)
        if select is not None and select.meta is None:
            return out  # [0, H]: only the K/V write was needed
        g, _ = self.final_norm(out, residual)
        return g

    def forward_dense(self, embeds: torch.Tensor, hidden: torch.Tensor, cos_sin, prior_kv=None):
        """Whole padded sequences, no cache: embeds / hidden [B, T, H], cos_sin each [B, T, rot/2].

        prior_kv None: causal attention over the T rows (draft step 0). Else (K0, V0, chain):
        row t (a recursive draft step for the chain that started at row t) attends to K0[:, :, :t+1]
        (step 0's keys up to its start), then to the chain's earlier steps' keys chain[j][0][:, :, t]
        and to its own key. Keys are [B, Hkv, T, D] after norm and RoPE.
        Returns (g [B, T, H], (k, v) [B, Hkv, T, D] of these rows)."""
        B, T, H = embeds.shape
        dtype = self.eh_proj.weight.dtype  # the layer's own (e.g. float32 master weights while training)
        embeds, cos_sin = embeds.to(dtype), (cos_sin[0].to(dtype), cos_sin[1].to(dtype))
        e, h = self.enorm(embeds), self.hnorm(hidden.to(dtype))
        x = self.eh_proj(torch.cat((h, e) if self.hidden_first else (e, h), dim=-1)).reshape(B * T, H)
        blk = self.block
        residual, a = x, blk.input_layernorm(x)
        attn = blk.self_attn
        q, k, v = attn.qkv_proj.split(attn.qkv_proj(a))
        if attn.qk_norm:
            q, k = attn.q_norm(q), attn.k_norm(k)
        cos, sin = (c.reshape(B * T, -1) for c in cos_sin)
        q, k = apply_rotary(q, cos, sin, attn.fused_rotary), apply_rotary(k, cos, sin, attn.fused_rotary)
        # [B*T, heads, D] -> [B, heads, T, D]
        q, k, v = (t.view(B, T, t.shape[1], t.shape[2]).transpose(1, 2) for t in (q, k, v))
        scale = attn.attn.scale
        if prior_kv is None:
            o = F.scaled_dot_product_attention(
                q, k.to(q.dtype), v.to(q.dtype), is_causal=True, scale=scale, enable_gqa=True
            )
        else:
            o = chain_attention(q, k, v, prior_kv, scale)
        o = attn.o_proj(o.transpose(1, 2).reshape(B * T, -1))
        hmid, residual = blk.post_attention_layernorm(o, residual)
        out = blk.mlp(hmid)
        g, _ = self.final_norm(out, residual)
        return g.view(B, T, H), (k, v)


def chain_attention(q, k, v, prior_kv, scale: float) -> torch.Tensor:
    """q [B, Hq, T, D]; k, v [B, Hkv, T, D]; prior_kv (K0, V0, [(Kj, Vj), ...]) as in forward_dense.
    Scores: causal over K0 (key j <= row t), then one per chain key at the same row; one softmax."""
    K0, V0, chain = prior_kv
    B, Hq, T, D = q.shape
    Hkv = K0.shape[1]
    qg = q.reshape(B, Hkv, Hq // Hkv, T, D).float()
    s0 = torch.einsum("bhgtd,bhsd->bhgts", qg, K0.float()) * scale  # [B, Hkv, G, T, T]
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    s0 = s0.masked_fill(~causal, float("-inf"))
    keys = [kj for kj, _ in chain] + [k]
    vals = [vj for _, vj in chain] + [v]
    diag = torch.stack([torch.einsum("bhgtd,bhtd->bhgt", qg, kj.float()) * scale for kj in keys], dim=-1)
    w = torch.softmax(torch.cat((s0, diag), dim=-1), dim=-1)
    o = torch.einsum("bhgts,bhsd->bhgtd", w[..., :T], V0.float())
    o = o + torch.einsum("bhgtj,jbhtd->bhgtd", w[..., T:], torch.stack([vj.float() for vj in vals]))
    return o.reshape(B, Hq, T, D).to(q.dtype)


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

    def __init__(
        self,
        main: LlamaForCausalLM,
        num_layers: int,
        layout: str = "deepseek",
        block_cfg: ModelConfig | None = None,
        own_heads: list[bool] | None = None,
        attn_backend=None,
        make_mlp: Callable[[int], nn.Module] | None = None,
        draft_vocab_sizes: list[int | None] | None = None,
    ):
        super().__init__()
        if layout not in LAYOUTS:
            raise ValueError(f"unknown MTP layout {layout!r}; one of {LAYOUTS}")
        if num_layers < 1:
            raise ValueError("an MTP module needs at least one layer")
        cfg = block_cfg or main.cfg
        dtype, device = main.dtype, main.device
        if attn_backend is None:
            attn_backend = main.attn_backend
        if make_mlp is None and not cfg.is_hybrid:  # a hybrid's block builds its own MLP
            make_mlp = dense_mlp_factory(main, cfg, dtype, device)
        own_heads = list(own_heads or [False] * num_layers)
        draft_vocab_sizes = list(draft_vocab_sizes or [None] * num_layers)
        self.cfg, self.layout, self.dtype, self.device = cfg, layout, dtype, device
        # Plain attributes, not submodules: they belong to (and are loaded with) the main model.
        rotary = main.model.rotary
        if (cfg.head_dim, cfg.rope, cfg.max_position_embeddings) != (
            main.cfg.head_dim,
            main.cfg.rope,
            main.cfg.max_position_embeddings,
        ):
            self.rotary = rotary = RotaryEmbedding(cfg.head_dim, cfg.rope, cfg.max_position_embeddings, device)
        object.__setattr__(self, "_embed", main.model.embed_tokens)
        object.__setattr__(self, "_lm_head", main.lm_head)
        object.__setattr__(self, "_rotary", rotary)
        self.zero_embed_at_pos0 = layout in ("deepseek", "mimo")
        base = main.cfg.num_layers
        layers: list[MTPLayer] = []
        for j in range(num_layers):
            layers.append(
                MTPLayer(
                    cfg,
                    base + j,
                    dtype,
                    device,
                    attn_backend,
                    None if cfg.is_hybrid else make_mlp(base + j),
                    hidden_first=layout == "mimo",
                    zero_centered=layout == "qwen3_next",
                    own_head=own_heads[j],
                    shared=layers[0] if layout == "qwen3_next" and j > 0 else None,
                    draft_vocab_size=draft_vocab_sizes[j],
                    kernels=main.kernels,
                )
            )
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

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        step: int = 0,
        select: RowSelection | None = None,
    ) -> torch.Tensor:
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

    def forward_dense(
        self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor, step: int = 0, prior_kv=None
    ):
        """The same math as forward over whole sequences without the paged cache (training, evaluation).

        input_ids, positions [B, T]; hidden [B, T, H]. Row t of sequence b carries t_{i+1} at position
        i with hidden h_i, as in forward. Step 0 (prior_kv None): causal attention over the rows (pad
        sequences at the end: earlier rows never see padding). A recursive step s > 0 recomputes every
        row as the s-th draft of the chain that started at that row: positions are +s, hidden the g of
        step s - 1 for the same row, and prior_kv = (K0, V0, [(K1, V1), ..., (K_{s-1}, V_{s-1})]) the
        keys/values returned by steps 0..s-1 (see MTPLayer.forward_dense). Differentiable.
        Returns (g [B, T, H], (k, v)) -- pass the (k, v) on to the next step's prior_kv."""
        j = self.layer_for_step(step)
        embeds = self._embed(input_ids.reshape(-1)).view(*input_ids.shape, -1)
        if self.zero_embed_at_pos0:
            embeds = embeds.masked_fill((positions == 0).unsqueeze(-1), 0)
        cos, sin = self._rotary.get_cos_sin(positions.reshape(-1))
        cos_sin = (cos.to(embeds.dtype).view(*positions.shape, -1), sin.to(embeds.dtype).view(*positions.shape, -1))
        return self.layers[j].forward_dense(embeds, hidden, cos_sin, prior_kv)

    @staticmethod
    def copy_cache_blocks(caches: list[torch.Tensor], layers, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy blocks src -> dst in the caches of these MTP layers (a drafting chain's scratch copy
        of a partly filled block). A method here so tensor parallelism can replay it on every rank."""
        from ember.layers.attention import is_fp8

        for j in layers:
            cache = caches[j].view(torch.uint8) if is_fp8(caches[j].dtype) else caches[j]
            cache.index_copy_(1, dst, cache.index_select(1, src))

    def draft_vocab(self, step: int = 0) -> torch.Tensor | None:
        """Token ids of layer (step % num_layers)'s head rows (a reduced draft vocabulary), or None."""
        return self.layers[self.layer_for_step(step)].draft_vocab

    def compute_draft_logits(self, g: torch.Tensor, step: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[N, H] -> (logits [N, V_draft] float32, draft_vocab [V_draft] or None). With a reduced
        draft vocabulary, column c is token draft_vocab[c]: the greedy draft is
        draft_vocab[logits.argmax(-1)]. Without one, (the full [N, V] logits, None)."""
        layer = self.layers[self.layer_for_step(step)]
        head = layer.head if layer.head is not None else self._lm_head
        return head(g), layer.draft_vocab

    def compute_logits(self, g: torch.Tensor, step: int = 0) -> torch.Tensor:
        """[N, H] -> [N, V] float32, through layer (step % num_layers)'s own head or the main LM head.
        A reduced draft vocabulary's logits are scattered into the full vocabulary, -inf elsewhere."""
        logits, ids = self.compute_draft_logits(g, step)
        if ids is None:
            return logits
        full = logits.new_full((logits.shape[0], self._lm_head.vocab_size), float("-inf"))
        return full.index_copy_(1, ids, logits)

    def propose_greedy(self, g: torch.Tensor, step: int = 0) -> torch.Tensor:
        """[N, H] -> the argmax draft token ids [N] (int64), read through the draft vocabulary."""
        logits, ids = self.compute_draft_logits(g, step)
        top = cpu_row_top.argmax(logits)
        return top if ids is None else ids[top]
