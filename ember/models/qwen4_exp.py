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
The vision-language checkpoint serves its text model. The forward returns the 4-stream residual
before the final mixer (compute_logits mixes), which is what the MTP layer (Qwen4ExpMTP) reads.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ember.config.model_config import LINEAR_ATTENTION, ModelConfig
from ember.errors import ModelLoadError
from ember.kernels import cpu_row_top
from ember.kernels.cpu_kernels import CpuKernels
from ember.kernels.metadata import AttentionMetadata, RowSelection
from ember.layers import qsa_graph
from ember.layers.attention import write_kv_cache
from ember.layers.embedding import VocabEmbedding
from ember.layers.gated_deltanet import GatedDeltaNet
from ember.layers.hyper_connection import HyperConnection
from ember.layers.linear import ReplicatedLinear
from ember.layers.norm import ZeroCenteredRMSNorm
from ember.layers.ple import PLELayer
from ember.layers.qsa import QSAIndexer, selected_attention
from ember.layers.rotary import RotaryEmbedding, apply_rotary
from ember.models.llama import LlamaForCausalLM, embedding_method, linear_method
from ember.models.mtp import MTPModule, chain_attention
from ember.models.qwen3_next import GatedAttention, Qwen3NextForCausalLM, SharedExpertMoeBlock


def mixer(
    cfg: ModelConfig, dtype, device, quant_config, prefix: str, inject: bool = True, kernels: CpuKernels | None = None
) -> HyperConnection:
    """The hyper-connection mixer at `prefix` (its projections quantized as the checkpoint says; the C++ mixer
    where `kernels` allow it)."""
    return HyperConnection(
        cfg.hidden_size,
        cfg.hc_count,
        cfg.hc_lowrank,
        cfg.rms_norm_eps,
        dtype,
        device,
        inject,
        lambda proj: linear_method(quant_config, f"{prefix}.{proj}"),
        cpu_kernel=(kernels or CpuKernels()).hc_mixer,
    )


class QSAGatedAttention(GatedAttention):
    def __init__(self, cfg: ModelConfig, layer_idx: int, dtype, device, attn_backend, quant_config=None, kernels=None):
        super().__init__(cfg, layer_idx, dtype, device, attn_backend, quant_config)
        kernels = kernels or CpuKernels()
        self.cpu_kernel = kernels.qsa_attention  # the C++ sparse attention where it applies
        prefix = f"model.layers.{layer_idx}.self_attn.indexer.index_qk_proj"
        self.indexer = QSAIndexer(
            cfg.indexer,
            cfg.hidden_size,
            cfg.rms_norm_eps,
            dtype,
            device,
            linear_method(quant_config, prefix),
            cpu_scoring=kernels.qsa_scoring,
        )

    def forward(
        self,
        x,
        cos_sin,
        kv_cache,
        meta: AttentionMetadata,
        sequence_cos_sin=None,
        keys=None,
        select: RowSelection | None = None,
    ):
        """sequence_cos_sin(N) -> (cos, sin) of sequence indices 0..N-1 (the block keys' positions); keys: the
        indexer's raw key pool a compiled step is handed (None: the indexer's own). select (eager only): every
        row's K/V and indexer key are written, the attention and o_proj run for select's rows only (an MTP fill)."""
        q_gate, k, v = self.qkv_proj.split(self.qkv_proj(x))
        T, D = x.shape[0], self.qkv_proj.head_dim
        q, gate = q_gate.reshape(T, self.num_heads, 2 * D).chunk(2, dim=-1)
        q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = cos_sin
        q, k = apply_rotary(q, cos, sin, False), apply_rotary(k, cos, sin, False)
        if meta.fixed_shape:  # a compiled step: the selection in index form, whatever the lengths
            keys = self.indexer.keys if keys is None else keys
            index_q = qsa_graph.index_queries(self.indexer, x, cos, sin, keys, meta.slot_mapping)
            write_kv_cache(k, v, kv_cache, meta.slot_mapping, fixed_shape=True)
            sel = qsa_graph.select_blocks(self.indexer, index_q, keys, meta, sequence_cos_sin(meta.max_seq_len, True))
            o = selected_attention(q, kv_cache, meta.block_tables, sel, self.attn.scale, self.cpu_kernel)
            return self.o_proj((o * torch.sigmoid(gate)).flatten(1))
        index_q = self.indexer(x, cos, sin, kv_cache, meta)
        if meta.max_seq_len <= self.indexer.cfg.dense_below:
            o = self.attn(q, k, v, kv_cache, meta, select)  # every visible token is selected: the backend, dense
        elif select is None:
            o = self._sparse(q, k, v, index_q, kv_cache, meta, sequence_cos_sin)
        else:
            write_kv_cache(k, v, kv_cache, meta.slot_mapping, meta.all_slots_valid)
            rows = select.rows
            o = (
                q[:0]
                if select.meta is None
                else self._sparse(q[rows], None, None, index_q[rows], kv_cache, select.meta, sequence_cos_sin)
            )
        if select is not None:
            gate = gate[select.rows]
        return self.o_proj((o * torch.sigmoid(gate)).flatten(1))

    def _sparse(self, q, k, v, index_q, kv_cache, meta: AttentionMetadata, sequence_cos_sin) -> torch.Tensor:
        """The step's queries over the tokens their selection keeps, all sequences in one call (ember.layers.qsa:
        the selection in index form, then the C++ / Triton kernel or the gathered torch form)."""
        # never an fp8 cache: refused at start (engine.startup.limits); k None: written already (a selection's rows)
        if k is not None:
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
    def __init__(
        self, cfg: ModelConfig, layer_idx: int, dtype, device, attn_backend, quant_config, kernels, attention=False
    ):
        """attention: an attention layer whatever layer_types says (the MTP layer, past the model's layers)."""
        super().__init__()
        self.is_linear = not attention and cfg.layer_type(layer_idx) == LINEAR_ATTENTION
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
                cfg.ple, cfg.vocab_size, cfg.hidden_size, cfg.hc_count, cfg.rms_norm_eps, index, dtype, device, kernels
            )

        self.attn_hyper_connection = mixer(
            cfg, dtype, device, quant_config, f"{prefix}.attn_hyper_connection", kernels=kernels
        )
        self.mlp_hyper_connection = mixer(
            cfg, dtype, device, quant_config, f"{prefix}.mlp_hyper_connection", kernels=kernels
        )

    def forward(
        self, X, input_ids, cos_sin, cache, meta: AttentionMetadata, sequence_cos_sin, keys=None, ple=None, select=None
    ):
        """keys: an attention layer's indexer key pool in a compiled step; ple: PLELayer.start's (None: started
        here); select (an attention layer only, eager): the rows kept past the attention; every row's K/V and
        indexer key are written, the rest of the layer runs for select's rows (an MTP fill needs one row's output)."""
        if self.ple is not None:
            X = X + self.ple(X, input_ids, cache, meta, ple)
        x, w = self.attn_hyper_connection(X)
        if self.is_linear:
            y = self.linear_attn(x, cache, meta)
        else:
            y = self.self_attn(x, cos_sin, cache, meta, sequence_cos_sin, keys, select)
        if select is not None:
            X, w = X[select.rows], w[select.rows]
            if select.meta is None:
                return X  # no row kept: the K/V and indexer keys were the work
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
        self.hyper_connection_mixer = mixer(
            cfg, dtype, device, quant_config, "model.hyper_connection_mixer", False, kernels
        )
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope, cfg.max_position_embeddings, device)

    def forward(self, input_ids, positions, caches, meta: AttentionMetadata, select: RowSelection | None = None):
        """caches: one per layer, then in a compiled step the attention layers' indexer key pools in layer
        order (Qwen4ExpForCausalLM.graph_pools)."""
        # the PLE rows first: their gather runs on a thread of its own while the layers before them run
        ple = {
            i: layer.ple.start(input_ids, caches[i], meta)
            for i, layer in enumerate(self.layers)
            if layer.ple is not None
        }
        h = self.embed_tokens(input_ids)
        cos, sin = self.rotary.get_cos_sin(positions)
        cos_sin = (cos.to(h.dtype), sin.to(h.dtype))
        sequence_cos_sin = sequence_rotary(self.rotary, h.dtype, h.device)
        X = h.repeat(1, self.hc_count)  # every stream starts as the embedding
        pools = iter(caches[len(self.layers) :])
        for i, (layer, cache) in enumerate(zip(self.layers, caches)):
            keys = None if layer.is_linear else next(pools, None)
            X = layer(X, input_ids, cos_sin, cache, meta, sequence_cos_sin, keys, ple.get(i))
        return selected_rows(X, select)


def selected_rows(X: torch.Tensor, select: RowSelection | None) -> torch.Tensor:
    """The rows a step keeps (select: the logit rows; None: every row)."""
    if select is None:
        return X
    return X[:0] if select.meta is None else X[select.rows]


def sequence_rotary(rotary: RotaryEmbedding, dtype, device):
    """(n, bound=False) -> (cos, sin) of sequence indices 0..n-1 (text: a token's position is its index),
    computed once a step, whichever attention layer asks first (the QSA block keys' positions). bound: n is a
    compiled step's table bound (symbolic: never a key to remember it by, which would specialise the graph
    to one width; the graph shares the layers' copies itself), which may pass the rotary table's end by
    less than a block: those indices, past every sequence, are clamped."""
    memo: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def compute(index: torch.Tensor):
        c, s = rotary.get_cos_sin(index)
        return c.to(dtype), s.to(dtype)

    def cos_sin(n, bound: bool = False):
        if bound:
            return compute(torch.arange(n, device=device).clamp(max=rotary.cos_cache.shape[0] - 1))
        if n not in memo:
            memo[n] = compute(torch.arange(n, device=device))
        return memo[n]

    return cos_sin


class Qwen4ExpForCausalLM(Qwen3NextForCausalLM):
    """Loads through Qwen3.5's routing; a PLE's tensors go to its own loader (its n-gram table's row
    shards are kept as they come, never concatenated)."""

    # the n-gram table's shards stay in the checkpoint's mapping, read by the rows a batch hashes to
    MAPPED_WEIGHTS = (".ple_embedding.ngram_embedding.",)

    def make_body(self, cfg: ModelConfig, dtype, device, attn_backend, quant_config, kernels: CpuKernels) -> nn.Module:
        return Qwen4ExpModel(cfg, dtype, device, attn_backend, quant_config, kernels)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: the 4-stream residual [N, n*H] the forward returns (what the MTP layer reads) -> the final
        mixer (the model's final norm) -> [N, V] float32."""
        return self.lm_head(self.model.hyper_connection_mixer(hidden))

    def build_mtp(self, num_layers: int, attn_backend=None) -> "Qwen4ExpMTP":
        """The model's MTP layer(s) as ember's MTP proposer drives them (ember.spec.mtp_weights.load_mtp)."""
        return Qwen4ExpMTP(self, num_layers, attn_backend)

    def graph_pools(self, kv_caches: list) -> list[torch.Tensor]:
        """What a compiled step writes beside its caches, handed to it after them (ember.engine.executor.compiled):
        each attention layer's indexer key pool, in layer order (made now where no step has made it)."""
        layers = zip(self.model.layers, kv_caches)
        return [
            qsa_graph.key_pool(layer.self_attn.indexer, c, self.dtype) for layer, c in layers if not layer.is_linear
        ]

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


# a fused projection's parts under their checkpoint names (MTP export)
FUSED_PARTS = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "gate": "gate_proj", "up": "up_proj"}


class Qwen4ExpMTPLayer(Qwen4ExpDecoderLayer):
    """One MTP depth: a full attention decoder layer (hyper-connections, QSA attention with its own indexer,
    the MoE), scored through the model's LM head (no head or draft vocabulary of its own)."""

    head = None
    draft_vocab = None


class Qwen4ExpMTP(nn.Module):
    """qwen4_exp's MTP layer (../shared/research/qwen4exp.md section 6; SGLang's qwen4_exp_mtp input fusion).
    A row carries token t_{i+1} at position i and the trunk's 4-stream residual H_i before its final mixer
    (what Qwen4ExpForCausalLM.forward returns), never a pooled one:
        e = fc_embedding(norm_e(Embed(t_{i+1})))               norm_e: zero-centred RMS over H
        X_s = e + fc_hidden(norm_h(H_i)_s)   s = 1..n           norm_h: ONE RMS over all n*H values
        G = MTP decoder layer(X)                                its own paged KV and indexer keys
        logits = LMHead(mixer(G))                               its own final mixer, the model's head
    G (pre-mixer, [T, n*H]) is what the next draft step takes as H. The MTPModule interface ember's MTP
    proposer drives (ember.spec.mtp_proposer); checkpoint names mtp.{fc_embedding, fc_hidden,
    pre_fc_norm_embedding, pre_fc_norm_hidden, hyper_connection_mixer.*, layers.{j}.*}. Unquantized."""

    layout = "qwen4_exp"
    stacked_params = LlamaForCausalLM.stacked_params
    route_weight = LlamaForCausalLM.route_weight

    def __init__(self, main: Qwen4ExpForCausalLM, num_layers: int, attn_backend=None):
        super().__init__()
        cfg, dtype, device = main.cfg, main.dtype, main.device
        H, n, eps = cfg.hidden_size, cfg.hc_count, cfg.rms_norm_eps
        self.cfg, self.dtype, self.device, self.hc_count = cfg, dtype, device, n
        self.pre_fc_norm_embedding = ZeroCenteredRMSNorm(H, eps, dtype, device)
        self.pre_fc_norm_hidden = ZeroCenteredRMSNorm(n * H, eps, dtype, device)
        self.fc_embedding = ReplicatedLinear(H, H, dtype=dtype, device=device)
        self.fc_hidden = ReplicatedLinear(H, H, dtype=dtype, device=device)
        backend = attn_backend or main.attn_backend
        self.layers = nn.ModuleList(
            Qwen4ExpMTPLayer(cfg, cfg.num_layers + j, dtype, device, backend, None, main.kernels, attention=True)
            for j in range(num_layers)
        )
        self.hyper_connection_mixer = mixer(cfg, dtype, device, None, "mtp.hyper_connection_mixer", False, main.kernels)
        # the model's embedding, head and rotary table: plain attributes, loaded with (and owned by) the model
        object.__setattr__(self, "_embed", main.model.embed_tokens)
        object.__setattr__(self, "_lm_head", main.lm_head)
        object.__setattr__(self, "_rotary", main.model.rotary)

    @staticmethod
    def shape_of(cfg: ModelConfig) -> dict[str, int]:
        """The config values that size the layer's tensors (all the model's: the layer is built from the model's
        config), by their config.json names: an MTP folder made for another model differs in one of them."""
        ix = cfg.indexer
        return {
            "hc_count": cfg.hc_count,
            "hc_lowrank": cfg.hc_lowrank,
            "num_attention_heads": cfg.num_heads,
            "num_key_value_heads": cfg.num_kv_heads,
            "head_dim": cfg.head_dim,
            "num_experts": cfg.num_experts,
            "moe_intermediate_size": cfg.moe_intermediate_size,
            "shared_expert_intermediate_size": cfg.shared_expert_intermediate_size,
            "indexer_n_heads": ix.num_heads if ix is not None else 0,
            "indexer_head_dim": ix.head_dim if ix is not None else 0,
        }

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def weight_dtype(self) -> torch.dtype:
        """The layer's float dtype now (float32 master weights while training), read off a norm: the
        projections may be packed to codes on CPU (MTPProposer._pack_draft_weights)."""
        return self.pre_fc_norm_embedding.weight.dtype

    @property
    def hidden_width(self) -> int:
        """A row's hidden state, what the fill takes (H_i) and a draft step gives (G): the n streams' residual."""
        return self.hc_count * self.cfg.hidden_size

    def layer_for_step(self, step: int) -> int:
        return step % len(self.layers)

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        attn = self.layers[0].self_attn.attn
        return (2, num_blocks, block_size, attn.num_kv_heads, attn.head_dim)

    def kv_bytes_per_token(self, elem_bytes: int) -> int:
        """Each layer's K/V and its indexer's raw key per token (the planner's kv_bytes_per_token terms)."""
        _, _, _, heads, dim = self.kv_cache_shape(1, 1)
        return self.num_layers * (2 * heads * dim + self.cfg.indexer.head_dim) * elem_bytes

    def fuse(self, input_ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """The layer's 4-stream input (the class docstring): [T] ids, [T, n*H] residuals -> [T, n*H], in the
        layer's dtype (float32 master weights while training)."""
        T, H, dtype = input_ids.shape[0], self.cfg.hidden_size, self.weight_dtype
        e = self.fc_embedding(self.pre_fc_norm_embedding(self._embed(input_ids).to(dtype)))
        h = self.pre_fc_norm_hidden(hidden.to(dtype)).reshape(T * self.hc_count, H)
        return (e.unsqueeze(1) + self.fc_hidden(h).view(T, self.hc_count, H)).flatten(1)

    def forward(self, input_ids, positions, hidden, kv_caches, meta: AttentionMetadata, step=0, select=None):
        """One draft step over a flat batch (MTPModule.forward's contract): row r carries t_{i+1} at
        position i and H_i. Returns G [T, n*H] (or select's rows): feed it to compute_logits and on."""
        j = self.layer_for_step(step)
        X = self.fuse(input_ids, hidden)
        cos, sin = self._rotary.get_cos_sin(positions)
        cos_sin = (cos.to(X.dtype), sin.to(X.dtype))
        sequence_cos_sin = sequence_rotary(self._rotary, X.dtype, X.device)
        keys = kv_caches[len(self.layers) + j] if len(kv_caches) > len(self.layers) else None  # graph_pools'
        if keys is not None or meta.fixed_shape:  # a compiled step: the whole layer, then select's rows
            X = self.layers[j](X, input_ids, cos_sin, kv_caches[j], meta, sequence_cos_sin, keys)
            return selected_rows(X, select)
        # select: only the rows that draft next run past the attention (the others' K/V and indexer keys are written)
        return self.layers[j](X, input_ids, cos_sin, kv_caches[j], meta, sequence_cos_sin, select=select)

    def graph_pools(self, kv_caches: list) -> list[torch.Tensor]:
        """Its layers' indexer key pools (Qwen4ExpForCausalLM.graph_pools)."""
        return [qsa_graph.key_pool(layer.self_attn.indexer, c, self.dtype) for layer, c in zip(self.layers, kv_caches)]

    def compute_draft_logits(self, g: torch.Tensor, step: int = 0) -> tuple[torch.Tensor, None]:
        mixed = self.hyper_connection_mixer(g.to(self.weight_dtype))
        return self._lm_head(mixed.to(self._embed.weight.dtype)), None

    def compute_logits(self, g: torch.Tensor, step: int = 0) -> torch.Tensor:
        return self.compute_draft_logits(g, step)[0]

    def propose_greedy(self, g: torch.Tensor, step: int = 0) -> torch.Tensor:
        return cpu_row_top.argmax(self.compute_logits(g, step))

    def draft_vocab(self, step: int = 0) -> None:
        return None

    def copy_cache_blocks(self, caches: list[torch.Tensor], layers, src: torch.Tensor, dst: torch.Tensor) -> None:
        """A chain's scratch copy of a partly filled block: its K/V and its indexer's raw keys."""
        MTPModule.copy_cache_blocks(caches, layers, src, dst)
        for j in layers:
            keys = self.layers[j].self_attn.indexer.keys
            if keys is not None:
                paged = keys.view(caches[j].shape[1], caches[j].shape[2], -1)
                paged.index_copy_(0, dst, paged.index_select(0, src))

    def skip_weight(self, name: str) -> bool:
        return False

    # ---- training (ember.train.mtp) ------------------------------------------------------------

    def forward_dense(self, input_ids, positions, hidden, step: int = 0, prior_kv=None):
        """MTPModule.forward_dense's contract over whole padded sequences ([B, T] ids and positions, [B, T,
        n*H] residuals): (G [B, T, n*H], (k, v) [B, Hkv, T, D]), differentiable. The attention is causal and
        dense: QSA's selection changes nothing below the budget, and past it only what a draft sees."""
        B, T = input_ids.shape
        layer = self.layers[self.layer_for_step(step)]
        X = self.fuse(input_ids.reshape(-1), hidden.reshape(B * T, -1))
        cos, sin = self._rotary.get_cos_sin(positions.reshape(-1))
        x, w = layer.attn_hyper_connection(X)
        attn = layer.self_attn
        q_gate, k, v = attn.qkv_proj.split(attn.qkv_proj(x))
        D = attn.qkv_proj.head_dim
        q, gate = q_gate.reshape(B * T, attn.num_heads, 2 * D).chunk(2, dim=-1)
        q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = (apply_rotary(t, cos.to(X.dtype), sin.to(X.dtype), False) for t in (q, k))
        q, k, v = (t.reshape(B, T, t.shape[1], D).transpose(1, 2) for t in (q, k, v))
        if prior_kv is None:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=attn.attn.scale, enable_gqa=True)
        else:
            o = chain_attention(q, k, v, prior_kv, attn.attn.scale)
        y = attn.o_proj((o.transpose(1, 2).reshape(B * T, attn.num_heads, D) * torch.sigmoid(gate)).flatten(1))
        X = HyperConnection.inject(X, y, w)
        x, w = layer.mlp_hyper_connection(X)
        X = HyperConnection.inject(X, layer.mlp(x), w)
        return X.view(B, T, -1), (k, v)

    @torch.no_grad()
    def init_from_main(self, main: Qwen4ExpForCausalLM) -> None:
        """A start for training: the layer a copy of the model's last attention layer, the final mixer the
        model's, the fusion an identity (e + H_s, each normed to unit RMS)."""
        last = [layer for layer in main.model.layers if not layer.is_linear][-1]
        for layer in self.layers:
            layer.load_state_dict(last.state_dict())
        self.hyper_connection_mixer.load_state_dict(main.model.hyper_connection_mixer.state_dict())
        for fc in (self.fc_embedding, self.fc_hidden):
            fc.weight.copy_(torch.eye(self.cfg.hidden_size, dtype=fc.weight.dtype))
        self.pre_fc_norm_embedding.weight.zero_()
        self.pre_fc_norm_hidden.weight.zero_()

    def export_tensors(self) -> dict[str, torch.Tensor]:
        """The weights under the checkpoint's mtp.* names (fused projections and experts split back as
        transformers names them), what load_mtp_weights reads."""
        out, modules = {}, dict(self.named_modules())
        for pname, p in self.named_parameters():
            mod_path, _, local = pname.rpartition(".")
            module = modules[mod_path]
            if getattr(module, "shard_ids", [None]) != [None]:  # q/k/v, gate/up: one tensor a part
                parent = mod_path.rpartition(".")[0]
                for sid in module.shard_ids:
                    out[f"mtp.{parent}.{FUSED_PARTS[sid]}.{local}"] = module.shard_view(p, sid)
            elif local in ("w13", "w2"):  # stacked experts, in transformers' fused layout
                out[f"mtp.{mod_path}.{'gate_up_proj' if local == 'w13' else 'down_proj'}"] = p
            else:
                out[f"mtp.{pname}"] = p
        return {k: v.detach().cpu().contiguous().clone() for k, v in out.items()}

    @torch.no_grad()
    def load_mtp_weights(self, weights, where: str) -> None:
        """(checkpoint name, tensor) of the mtp.* tensors -> the layer(s), through the model's routing; a
        ModelLoadError names what is missing."""
        local = ((name.removeprefix("mtp."), t) for name, t in weights)
        try:
            LlamaForCausalLM.load_weights(self, local)
        except ModelLoadError as e:
            raise ModelLoadError(f"the MTP layer in {where}: {e}") from None
