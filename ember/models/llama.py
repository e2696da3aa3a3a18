"""One pre-norm GQA decoder for LlamaForCausalLM, Qwen2ForCausalLM and Qwen3ForCausalLM.

The differences are config flags: Qwen2 has a q/k/v bias; Qwen3 has per-head RMSNorm on q
and k (over head_dim, before RoPE) and a head_dim that need not be hidden/heads. Module names
mirror the HF checkpoint ("model.layers.N.self_attn.o_proj.weight"), except that q/k/v load
into the fused qkv_proj and gate/up into gate_up_proj.
"""

from __future__ import annotations

import logging
import re
from collections import defaultdict
from typing import Iterable

import torch
from torch import nn

from ember.config.model_config import ModelConfig
from ember.errors import ModelLoadError
from ember.kernels.cpu_kernels import CpuKernels
from ember.kernels.metadata import AttentionMetadata, RowSelection
from ember.layers.activation import SiluAndMul
from ember.layers.attention import Attention
from ember.layers.embedding import LMHead, VocabEmbedding
from ember.layers.linear import MergedColumnLinear, QKVLinear, RowParallelLinear, copy_checked
from ember.layers.norm import RMSNorm
from ember.layers.rotary import RotaryEmbedding, apply_rotary

log = logging.getLogger(__name__)
# FP8 KV scales (formats.md §6) -> the layer's Attention: llm-compressor "self_attn.k_scale",
# ModelOpt "self_attn.k_proj.k_scale", the deprecated "self_attn.kv_scale" (both k and v).
KV_SCALE_NAME = re.compile(r"(.*\.self_attn)\.(?:[kv]_proj\.|attn\.)?(k_scale|v_scale|kv_scale)")


def linear_method(quant_config, prefix: str):
    return quant_config.linear_method(prefix) if quant_config is not None else None


def embedding_method(quant_config, prefix: str):
    return quant_config.embedding_method(prefix) if quant_config is not None else None


def load_routed(modules: dict, route: tuple, tensor: torch.Tensor) -> tuple[str, set]:
    """Copy one checkpoint tensor to its routed (module path, local name, shard id); returns the
    loaded parameter's name and the shard ids it now holds (for the completeness check)."""
    mod_path, local, shard = route
    module = modules[mod_path]
    if hasattr(module, "load_weight"):
        local, shard = module.load_weight(local, tensor, shard)
    else:
        copy_checked(getattr(module, local), tensor, "it")
    return (f"{mod_path}.{local}" if mod_path else local), (shard if isinstance(shard, set) else {shard})


class LlamaAttention(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        layer_idx: int,
        dtype,
        device,
        attn_backend,
        quant_config=None,
        kernels: CpuKernels | None = None,
    ):
        super().__init__()
        kernels = kernels or CpuKernels()
        self.fused_rotary = kernels.fused_elementwise
        D = cfg.head_dim
        prefix = f"model.layers.{layer_idx}.self_attn"
        self.qkv_proj = QKVLinear(
            cfg.hidden_size,
            D,
            cfg.num_heads,
            cfg.num_kv_heads,
            bias=cfg.attention_bias,
            dtype=dtype,
            device=device,
            quant_method=linear_method(quant_config, f"{prefix}.qkv_proj"),
        )
        # HF: Llama/Qwen3 give o_proj the attention bias too; Qwen2 never does.
        o_bias = cfg.attention_bias and not cfg.traits.qkv_bias_only
        self.o_proj = RowParallelLinear(
            cfg.num_heads * D,
            cfg.hidden_size,
            bias=o_bias,
            dtype=dtype,
            device=device,
            quant_method=linear_method(quant_config, f"{prefix}.o_proj"),
        )
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:
            self.q_norm = RMSNorm(D, cfg.rms_norm_eps, dtype, device, kernels)
            self.k_norm = RMSNorm(D, cfg.rms_norm_eps, dtype, device, kernels)
        self.attn = Attention(self.qkv_proj.num_heads, D, self.qkv_proj.num_kv_heads, D**-0.5, attn_backend, layer_idx)

    def forward(self, x, cos_sin, kv_cache, meta, select: RowSelection | None = None):
        q, k, v = self.qkv_proj.split(self.qkv_proj(x))
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = cos_sin
        q, k = apply_rotary(q, cos, sin, self.fused_rotary), apply_rotary(k, cos, sin, self.fused_rotary)
        o = self.attn(q, k, v, kv_cache, meta, select)
        return self.o_proj(o.flatten(1))


class LlamaMLP(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        dtype,
        device,
        bias: bool = False,
        quant_config=None,
        prefix: str = "",
        kernels: CpuKernels | None = None,
    ):
        super().__init__()
        self.gate_up_proj = MergedColumnLinear(
            hidden_size,
            [intermediate_size] * 2,
            bias=bias,
            dtype=dtype,
            device=device,
            quant_method=linear_method(quant_config, f"{prefix}.gate_up_proj"),
        )
        self.down_proj = RowParallelLinear(
            intermediate_size,
            hidden_size,
            bias=bias,
            dtype=dtype,
            device=device,
            quant_method=linear_method(quant_config, f"{prefix}.down_proj"),
        )
        self.act = SiluAndMul(kernels)

    def forward(self, x):
        return self.down_proj(self.act(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        layer_idx: int,
        dtype,
        device,
        attn_backend,
        mlp: nn.Module,
        quant_config=None,
        kernels: CpuKernels | None = None,
    ):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device, kernels)
        self.self_attn = LlamaAttention(cfg, layer_idx, dtype, device, attn_backend, quant_config, kernels)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device, kernels)
        self.mlp = mlp

    def forward(self, h, residual, cos_sin, kv_cache, meta, select: RowSelection | None = None):
        """select: keep only these rows after attention (see RowSelection); all rows' K/V are written."""
        # The residual stream rides along and is added inside the next norm (one pass fewer).
        if residual is None:
            residual, h = h, self.input_layernorm(h)
        else:
            h, residual = self.input_layernorm(h, residual)
        h = self.self_attn(h, cos_sin, kv_cache, meta, select)
        if select is not None:
            residual = residual[select.rows]
            if select.meta is None:  # nothing to sample: only the K/V write was needed
                return h, residual
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        dtype,
        device,
        attn_backend,
        make_mlp,
        quant_config=None,
        kernels: CpuKernels | None = None,
    ):
        super().__init__()
        self.embed_tokens = VocabEmbedding(
            cfg.vocab_size,
            cfg.hidden_size,
            dtype,
            device,
            quant_method=embedding_method(quant_config, "model.embed_tokens"),
        )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, i, dtype, device, attn_backend, make_mlp(i), quant_config, kernels)
            for i in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device, kernels)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope, cfg.max_position_embeddings, device)

    def forward(self, input_ids, positions, kv_caches, meta, select: RowSelection | None = None):
        h = self.embed_tokens(input_ids)
        cos, sin = self.rotary.get_cos_sin(positions)  # once per step, shared by every layer
        cos_sin = (cos.to(h.dtype), sin.to(h.dtype))
        residual = None
        last = len(self.layers) - 1
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            h, residual = layer(h, residual, cos_sin, kv_cache, meta, select if i == last else None)
        if select is not None and select.meta is None:
            return h
        h, _ = self.norm(h, residual)
        return h


class LlamaForCausalLM(nn.Module):
    # (fused param, checkpoint name part, shard id): q/k/v -> qkv_proj, gate/up -> gate_up_proj.
    stacked_params = (
        (".qkv_proj.", ".q_proj.", "q"),
        (".qkv_proj.", ".k_proj.", "k"),
        (".qkv_proj.", ".v_proj.", "v"),
        (".gate_up_proj.", ".gate_proj.", "gate"),
        (".gate_up_proj.", ".up_proj.", "up"),
    )

    def __init__(
        self,
        cfg: ModelConfig,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str = "cpu",
        attn_backend=None,
        quant_config=None,
        kernels: CpuKernels | None = None,
    ):
        """attn_backend: default the torch reference; kernels: the CPU kernels its layers may use
        (default: every one that applies; CpuKernels.none() for the torch ops only)."""
        super().__init__()
        if attn_backend is None:
            from ember.kernels.torch_attention import TorchAttentionBackend

            attn_backend = TorchAttentionBackend()
        self.cfg, self.dtype, self.device = cfg, dtype, torch.device(device)
        self.quant_config = quant_config
        self.attn_backend = attn_backend
        self.kernels = kernels = kernels or CpuKernels()
        self.model = self.make_body(cfg, dtype, device, attn_backend, quant_config, kernels)
        tied = self.model.embed_tokens if cfg.tie_word_embeddings else None
        self.lm_head = LMHead(
            cfg.vocab_size,
            cfg.hidden_size,
            dtype,
            device,
            tied_to=tied,
            quant_method=None if tied else embedding_method(quant_config, "lm_head"),
        )

    def make_body(self, cfg: ModelConfig, dtype, device, attn_backend, quant_config, kernels: CpuKernels) -> nn.Module:
        """The decoder stack between the embedding and the LM head (its layers' MLPs from make_mlp); a
        family with other layers (the hybrids) builds its own and shares the rest: head, loading."""
        return LlamaModel(
            cfg, dtype, device, attn_backend, lambda i: self.make_mlp(cfg, i, dtype, device), quant_config, kernels
        )

    def make_mlp(self, cfg: ModelConfig, layer_idx: int, dtype, device) -> nn.Module:
        bias = bool(cfg.raw.get("mlp_bias", False))  # some Llama variants
        return LlamaMLP(
            cfg.hidden_size,
            cfg.intermediate_size,
            dtype,
            device,
            bias=bias,
            quant_config=self.quant_config,
            prefix=f"model.layers.{layer_idx}.mlp",
            kernels=self.kernels,
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        select: RowSelection | None = None,
    ) -> torch.Tensor:
        """input_ids, positions [T] -> final-normed hidden [T, H], or [R, H] for select.rows."""
        return self.model(input_ids, positions, kv_caches, meta, select)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, H] -> [N, V] float32."""
        return self.lm_head(hidden)

    # ---- weights -------------------------------------------------------------------------

    def skip_weight(self, name: str) -> bool:
        if "rotary_emb.inv_freq" in name:
            return True
        return self.cfg.tie_word_embeddings and name == "lm_head.weight"

    def route_weight(self, name: str, params: dict, modules: dict):
        """checkpoint name -> (module path, local name, shard id), or None if the model has no such weight."""
        if (m := KV_SCALE_NAME.fullmatch(name)) and f"{m[1]}.attn" in modules:
            return f"{m[1]}.attn", m[2], None
        for fused, part, shard in self.stacked_params:
            if part in name:
                cand = name.replace(part, fused)
                if cand in params:
                    mod, local = cand.rsplit(".", 1)
                    return mod, local, shard
        if name in params:
            mod, _, local = name.rpartition(".")
            return mod, local, None
        # A module that parses its own sub-names (e.g. MoE experts "mlp.experts.3.up_proj.weight").
        parts = name.split(".")
        for i in range(len(parts) - 1, 0, -1):
            mod = ".".join(parts[:i])
            if mod in modules and hasattr(modules[mod], "load_weight"):
                return mod, ".".join(parts[i:]), None
        return None

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy (and cast) checkpoint tensors into the parameters; returns our loaded param names.

        Raises ModelLoadError naming every parameter (and fused shard) the checkpoint did not provide.
        """
        params = dict(self.named_parameters())
        modules = dict(self.named_modules())
        got: dict[str, set] = defaultdict(set)
        ignored = []
        for name, tensor in weights:
            if self.skip_weight(name):
                continue
            route = self.route_weight(name, params, modules)
            if route is None:
                ignored.append(name)
                continue
            try:
                key, shards = load_routed(modules, route, tensor)
            except ModelLoadError as e:
                raise ModelLoadError(f"checkpoint tensor {name}: {e}") from None
            got[key] |= shards
        if ignored:
            log.info("ignored %d checkpoint tensors the model does not use (e.g. %s)", len(ignored), ignored[0])
        missing = []
        for pname in params:
            mod_path, _, local = pname.rpartition(".")
            module = modules[mod_path]
            want = module.expected_shards(local) if hasattr(module, "expected_shards") else {None}
            lacking = want - got.get(pname, set())
            if lacking:
                missing.append(pname if lacking == {None} else f"{pname} (shards {sorted(map(str, lacking))})")
        if missing:
            shown = ", ".join(missing[:12]) + (f", ... ({len(missing)} in all)" if len(missing) > 12 else "")
            raise ModelLoadError(
                f"the checkpoint lacks weights the model needs: {shown}. Check that the folder holds every "
                "shard of the model and that config.json belongs to these weights"
            )
        return set(got)


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Llama + q/k/v bias (cfg.attention_bias)."""


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Llama + per-head q/k RMSNorm (cfg.qk_norm) and explicit head_dim."""
