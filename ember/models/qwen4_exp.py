"""qwen4_exp (Qwen3.8-Flash-Next): Qwen3.5-MoE's hybrid with hyper-connections, a per-layer n-gram
embedding and indexed sparse attention (../shared/research/qwen4exp.md).

- The residual is hc_count streams ([T, n*H]); a HyperConnection mixer before every sublayer takes the
  place of its norm, and the model's last mixer is its final norm (ember.layers.hyper_connection).
- One or more Gated DeltaNet layers add PLE's hashed n-gram rows to the streams first (ember.layers.ple);
  their state (conv window, last ids) rides in the layer's RecurrentState (PLEState).
- Every attention layer is Qwen3.5's gated attention whose keys are chosen per query by a QSA indexer
  (ember.layers.qsa): the engine's attention backend while every sequence of the step is within the dense
  threshold, past it the selection in index form and the selected-block kernel (C++ on CPU, Triton on CUDA,
  gathered torch ops otherwise).
- The Gated DeltaNet output gate is output_gate_type's (sigmoid in the release); every MLP is the sparse MoE
  with its gated shared expert.
The vision-language checkpoint serves its text model; its MTP layer is not loaded yet.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from ember.config.model_config import LINEAR_ATTENTION, ModelConfig
from ember.kernels.cpu_kernels import CpuKernels
from ember.kernels.metadata import AttentionMetadata, RowSelection
from ember.layers.attention import write_kv_cache
from ember.layers.embedding import VocabEmbedding
from ember.layers.gated_deltanet import GatedDeltaNet
from ember.layers.hyper_connection import HyperConnection
from ember.layers.ple import PLELayer
from ember.layers.qsa import QSAIndexer, selected_attention
from ember.layers.rotary import RotaryEmbedding, apply_rotary
from ember.models.llama import embedding_method, linear_method
from ember.models.qwen3_next import GatedAttention, Qwen3NextForCausalLM, SharedExpertMoeBlock


def mixer(cfg: ModelConfig, dtype, device, quant_config, prefix: str, inject: bool = True) -> HyperConnection:
    """The hyper-connection mixer at `prefix` (its projections quantized as the checkpoint says)."""
    return HyperConnection(
        cfg.hidden_size,
        cfg.hc_count,
        cfg.hc_lowrank,
        cfg.rms_norm_eps,
        dtype,
        device,
        inject,
        lambda proj: linear_method(quant_config, f"{prefix}.{proj}"),
    )


class QSAGatedAttention(GatedAttention):
    def __init__(self, cfg: ModelConfig, layer_idx: int, dtype, device, attn_backend, quant_config=None, kernels=None):
        super().__init__(cfg, layer_idx, dtype, device, attn_backend, quant_config)
        self.cpu_kernel = (kernels or CpuKernels()).qsa_attention  # the C++ sparse attention where it applies
        prefix = f"model.layers.{layer_idx}.self_attn.indexer.index_qk_proj"
        self.indexer = QSAIndexer(
            cfg.indexer, cfg.hidden_size, cfg.rms_norm_eps, dtype, device, linear_method(quant_config, prefix)
        )

    def forward(self, x, cos_sin, kv_cache, meta: AttentionMetadata, sequence_cos_sin=None):
        """sequence_cos_sin(N) -> (cos, sin) of sequence indices 0..N-1 (the block keys' positions)."""
        q_gate, k, v = self.qkv_proj.split(self.qkv_proj(x))
        T, D = x.shape[0], self.qkv_proj.head_dim
        q, gate = q_gate.reshape(T, self.num_heads, 2 * D).chunk(2, dim=-1)
        q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = cos_sin
        q, k = apply_rotary(q, cos, sin, False), apply_rotary(k, cos, sin, False)
        index_q = self.indexer(x, cos, sin, kv_cache, meta)
        if meta.fixed_shape or meta.max_seq_len <= self.indexer.cfg.dense_below:
            o = self.attn(q, k, v, kv_cache, meta)  # every visible token is selected: the backend, dense
        else:
            o = self._sparse(q, k, v, index_q, kv_cache, meta, sequence_cos_sin)
        return self.o_proj((o * torch.sigmoid(gate)).flatten(1))

    def _sparse(self, q, k, v, index_q, kv_cache, meta: AttentionMetadata, sequence_cos_sin) -> torch.Tensor:
        """The step's queries over the tokens their selection keeps, all sequences in one call (ember.layers.qsa:
        the selection in index form, then the C++ / Triton kernel or the gathered torch form)."""
        # never an fp8 cache: refused at start (engine.startup.limits)
        write_kv_cache(k, v, kv_cache, meta.slot_mapping, meta.all_slots_valid)
        n = sum(meta.query_lens_cpu)
        sel = self.indexer.select_blocks(index_q[:n], meta, sequence_cos_sin(meta.max_seq_len))
        out = torch.zeros_like(q) if n < q.shape[0] else None  # rows past the sequences' (padding): zeros
        o = selected_attention(q[:n], kv_cache, meta.block_tables, sel, self.attn.scale, self.cpu_kernel)
        if out is None:
            return o
        out[:n] = o
        return out


class Qwen4ExpDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, dtype, device, attn_backend, quant_config, kernels):
        super().__init__()
        self.is_linear = cfg.layer_type(layer_idx) == LINEAR_ATTENTION
        prefix = f"model.layers.{layer_idx}"
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(cfg, dtype, device, quant_config, f"{prefix}.linear_attn", kernels)
        else:
            self.self_attn = QSAGatedAttention(cfg, layer_idx, dtype, device, attn_backend, quant_config, kernels)
        self.mlp = SharedExpertMoeBlock(cfg, dtype, device, quant_config, f"{prefix}.mlp", kernels)
        self.ple = None
        if cfg.ple is not None and layer_idx in cfg.ple.layers:
            index = cfg.ple.layers.index(layer_idx)
            self.ple = PLELayer(
                cfg.ple, cfg.vocab_size, cfg.hidden_size, cfg.hc_count, cfg.rms_norm_eps, index, dtype, device
            )

        self.attn_hyper_connection = mixer(cfg, dtype, device, quant_config, f"{prefix}.attn_hyper_connection")
        self.mlp_hyper_connection = mixer(cfg, dtype, device, quant_config, f"{prefix}.mlp_hyper_connection")

    def forward(self, X, input_ids, cos_sin, cache, meta: AttentionMetadata, sequence_cos_sin):
        if self.ple is not None:
            X = X + self.ple(X, input_ids, cache, meta)
        x, w = self.attn_hyper_connection(X)
        if self.is_linear:
            y = self.linear_attn(x, cache, meta)
        else:
            y = self.self_attn(x, cos_sin, cache, meta, sequence_cos_sin)
        X = HyperConnection.inject(X, y, w)
        x, w = self.mlp_hyper_connection(X)
        return HyperConnection.inject(X, self.mlp(x), w)


class Qwen4ExpModel(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype, device, attn_backend, quant_config, kernels):
        super().__init__()
        self.hc_count = cfg.hc_count
        self.embed_tokens = VocabEmbedding(
            cfg.vocab_size,
            cfg.hidden_size,
            dtype,
            device,
            quant_method=embedding_method(quant_config, "model.embed_tokens"),
        )
        self.layers = nn.ModuleList(
            Qwen4ExpDecoderLayer(cfg, i, dtype, device, attn_backend, quant_config, kernels)
            for i in range(cfg.num_layers)
        )
        self.hyper_connection_mixer = mixer(cfg, dtype, device, quant_config, "model.hyper_connection_mixer", False)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope, cfg.max_position_embeddings, device)

    def forward(self, input_ids, positions, caches, meta: AttentionMetadata, select: RowSelection | None = None):
        h = self.embed_tokens(input_ids)
        cos, sin = self.rotary.get_cos_sin(positions)
        cos_sin = (cos.to(h.dtype), sin.to(h.dtype))

        @functools.cache  # once a step, whichever attention layer asks first
        def sequence_cos_sin(n: int):  # text: a token's position is its index in the sequence
            c, s = self.rotary.get_cos_sin(torch.arange(n, device=h.device))
            return c.to(h.dtype), s.to(h.dtype)

        X = h.repeat(1, self.hc_count)  # every stream starts as the embedding
        for layer, cache in zip(self.layers, caches):
            X = layer(X, input_ids, cos_sin, cache, meta, sequence_cos_sin)
        if select is not None:
            if select.meta is None:
                return h[:0]
            X = X[select.rows]
        return self.hyper_connection_mixer(X)


class Qwen4ExpForCausalLM(Qwen3NextForCausalLM):
    """Loads through Qwen3.5's routing; a PLE's tensors go to its own loader (its n-gram table's row
    shards are kept as they come, never concatenated)."""

    # the n-gram table's shards stay in the checkpoint's mapping, read by the rows a batch hashes to
    MAPPED_WEIGHTS = (".ple_embedding.ngram_embedding.",)

    def make_body(self, cfg: ModelConfig, dtype, device, attn_backend, quant_config, kernels: CpuKernels) -> nn.Module:
        return Qwen4ExpModel(cfg, dtype, device, attn_backend, quant_config, kernels)

    def make_recurrent_states(self, num_slots: int, device) -> list:
        states = []
        for layer in self.model.layers:
            if not layer.is_linear:
                states.append(None)
            elif layer.ple is not None:
                states.append(layer.ple.make_state(layer.linear_attn.state_args(device), num_slots))
            else:
                states.append(layer.linear_attn.make_state(num_slots, device))
        return states

    @torch.no_grad()
    def load_weights(self, weights) -> set[str]:
        loaded = super().load_weights(weights)
        parts = int(self.cfg.raw.get("split_ngram_parts", 1) or 1)
        for layer in self.model.layers:
            if layer.ple is not None:
                layer.ple.finish_table(parts)
        return loaded


class Qwen4ExpForConditionalGeneration(Qwen4ExpForCausalLM):
    """The released (vision-language) checkpoint served as its text model: text weights under
    model.language_model.*, the vision tower skipped, config under text_config."""
