"""Random MTP layers for the tiny models, written in the three published layouts, and an
independent reference for their forward (plain torch + transformers' own decoder layer classes).

A reference layer holds HF modules: the block is transformers' Qwen3DecoderLayer (or
Qwen3MoeDecoderLayer for a MoE model) with random weights; the norms are Qwen3RMSNorm, or
Qwen3NextRMSNorm (1 + w) for the Qwen3-Next layout, where the block's own norms are swapped for
Qwen3NextRMSNorm too. checkpoint_tensors() writes the same weights under each layout's names.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
from dataclasses import dataclass

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from ember.kernels.metadata import AttentionMetadata, RowSelection
from tests.models.tiny_models import HF_CONFIGS

LAYOUTS = ("deepseek", "mimo", "qwen3_next")
COUNT_KEY = {
    "deepseek": "num_nextn_predict_layers",
    "mimo": "num_nextn_predict_layers",
    "qwen3_next": "mtp_num_hidden_layers",
}


def hf_config(main_dir: str):
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(main_dir)
    cfg._attn_implementation = "sdpa"
    return cfg


def _hf_classes(model_type: str):
    if model_type == "qwen3_moe":
        from transformers.models.qwen3_moe import modeling_qwen3_moe as m

        return m.Qwen3MoeDecoderLayer, m.Qwen3MoeRMSNorm, m.Qwen3MoeRotaryEmbedding
    from transformers.models.qwen3 import modeling_qwen3 as m

    return m.Qwen3DecoderLayer, m.Qwen3RMSNorm, m.Qwen3RotaryEmbedding


@dataclass
class RefMTPLayer:
    enorm: nn.Module
    hnorm: nn.Module
    proj: torch.Tensor  # [H, 2H]
    block: nn.Module  # transformers decoder layer
    final_norm: nn.Module
    head: torch.Tensor | None  # own shared_head.head [V, H] (DeepSeek layout), else None


def make_ref_layers(
    hf_cfg, layout: str, num_layers: int = 1, own_head: bool = False, seed: int = 1, arch: str = "qwen3"
) -> list[RefMTPLayer]:
    """num_layers random MTP layers (fp32), initialised like tests.models.tiny_models.build_hf_model."""
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNorm

    Layer, Norm, _ = _hf_classes(hf_cfg.model_type)
    embed_std, weight_std = HF_CONFIGS[arch]["init_std"]
    H, eps = hf_cfg.hidden_size, hf_cfg.rms_norm_eps
    zc = layout == "qwen3_next"
    torch.manual_seed(seed)
    layers = []
    block_cfg = copy.deepcopy(hf_cfg)  # layer_types covers the decoder only: extend it to the MTP indices
    if getattr(block_cfg, "layer_types", None) is not None:
        block_cfg.layer_types = list(block_cfg.layer_types) + ["full_attention"] * num_layers
    for j in range(num_layers):
        block = Layer(block_cfg, layer_idx=hf_cfg.num_hidden_layers + j).float().eval()
        if zc:  # Qwen3-Next: every norm of the MTP layer is zero-centred
            block.input_layernorm = Qwen3NextRMSNorm(H, eps)
            block.post_attention_layernorm = Qwen3NextRMSNorm(H, eps)
            block.self_attn.q_norm = Qwen3NextRMSNorm(hf_cfg.head_dim, eps)
            block.self_attn.k_norm = Qwen3NextRMSNorm(hf_cfg.head_dim, eps)
        norms = [(Qwen3NextRMSNorm(H, eps) if zc else Norm(H, eps=eps)) for _ in range(3)]
        with torch.no_grad():
            for name, p in block.named_parameters():
                if "norm" in name:
                    p.copy_((0.0 if zc else 1.0) + 0.2 * torch.randn_like(p))
                else:
                    p.normal_(0.0, weight_std)
            for n in norms:
                n.weight.copy_((0.0 if zc else 1.0) + 0.2 * torch.randn_like(n.weight))
        proj = torch.randn(H, 2 * H) * weight_std
        head = torch.randn(hf_cfg.vocab_size, H) * embed_std if own_head else None
        layers.append(RefMTPLayer(norms[0], norms[1], proj, block, norms[2], head))
    return layers


def _block_tensors(block: nn.Module, moe_intermediate: int) -> dict[str, torch.Tensor]:
    """HF decoder-layer weights under released checkpoint names (MoE experts split per expert)."""
    out = {}
    for name, t in block.state_dict().items():
        if name == "mlp.experts.gate_up_proj":
            I = moe_intermediate
            for e in range(t.shape[0]):
                out[f"mlp.experts.{e}.gate_proj.weight"] = t[e, :I].clone()
                out[f"mlp.experts.{e}.up_proj.weight"] = t[e, I:].clone()
        elif name == "mlp.experts.down_proj":
            for e in range(t.shape[0]):
                out[f"mlp.experts.{e}.down_proj.weight"] = t[e].clone()
        else:
            out[name] = t.clone()
    return out


def checkpoint_tensors(
    layers: list[RefMTPLayer],
    layout: str,
    num_hidden_layers: int,
    moe_intermediate: int = 0,
    embed: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """The reference layers' weights under the layout's checkpoint names."""
    out = {}
    for j, ref in enumerate(layers):
        blk = _block_tensors(ref.block, moe_intermediate)
        if layout == "deepseek":
            p = f"model.layers.{num_hidden_layers + j}."
            special = {"enorm": ref.enorm, "hnorm": ref.hnorm, "shared_head.norm": ref.final_norm}
            out[p + "eh_proj.weight"] = ref.proj.clone()
            if ref.head is not None:
                out[p + "shared_head.head.weight"] = ref.head.clone()
            if embed is not None:  # DeepSeek keeps a copy of the embedding in each MTP layer
                out[p + "embed_tokens.weight"] = embed.clone()
        elif layout == "mimo":
            p = f"model.mtp_layers.{j}."
            special = {"token_layernorm": ref.enorm, "hidden_layernorm": ref.hnorm, "final_layernorm": ref.final_norm}
            out[p + "input_proj.weight"] = ref.proj.clone()
        else:
            p = f"mtp.layers.{j}."
            special = (
                {
                    "mtp.pre_fc_norm_embedding": ref.enorm,
                    "mtp.pre_fc_norm_hidden": ref.hnorm,
                    "mtp.norm": ref.final_norm,
                }
                if j == 0
                else {}
            )
            if j == 0:
                out["mtp.fc.weight"] = ref.proj.clone()
        for k, norm in special.items():
            out[(k if layout == "qwen3_next" else p + k) + ".weight"] = norm.weight.detach().clone()
        for k, t in blk.items():
            out[p + k] = t
    return out


def _write_tensors(folder: str, tensors: dict[str, torch.Tensor]) -> None:
    save_file(
        {k: v.contiguous() for k, v in tensors.items()},
        os.path.join(folder, "model.safetensors"),
        metadata={"format": "pt"},
    )


def write_main_with_mtp(main_dir: str, dest: str, tensors: dict[str, torch.Tensor], config_update: dict) -> str:
    """A copy of the model folder whose model.safetensors also holds `tensors` and whose config.json
    gets `config_update` (e.g. num_nextn_predict_layers)."""
    shutil.copytree(main_dir, dest)
    weights = load_file(os.path.join(dest, "model.safetensors"))
    _write_tensors(dest, {**weights, **tensors})
    with open(os.path.join(dest, "config.json")) as f:
        cfg = json.load(f)
    cfg.update(config_update)
    with open(os.path.join(dest, "config.json"), "w") as f:
        json.dump(cfg, f)
    return dest


def write_mtp_folder(dest: str, tensors: dict[str, torch.Tensor], config: dict | None) -> str:
    """A separate MTP folder: the tensors and (unless config is None) a config.json."""
    os.makedirs(dest, exist_ok=True)
    _write_tensors(dest, tensors)
    if config is not None:
        with open(os.path.join(dest, "config.json"), "w") as f:
            json.dump(config, f)
    return dest


# ---- reference forward --------------------------------------------------------------------------


@torch.no_grad()
def ref_mtp(
    ref: RefMTPLayer,
    hf_cfg,
    embed: torch.Tensor,
    tokens: torch.Tensor,
    positions: torch.Tensor,
    hidden: torch.Tensor,
    layout: str,
) -> torch.Tensor:
    """One MTP layer over ONE sequence whose rows are positions 0..T-1 in order (causal attention
    over the whole sequence: a full recompute). tokens [T] are t_{i+1}; hidden [T, H] is h_i.
    Returns g [T, H] = FinalNorm(block(Proj(concat(...))))."""
    _, _, Rotary = _hf_classes(hf_cfg.model_type)
    e = embed[tokens].clone()
    if layout in ("deepseek", "mimo"):
        e[positions == 0] = 0.0
    en, hn = ref.enorm(e), ref.hnorm(hidden)
    x = torch.cat([hn, en] if layout == "mimo" else [en, hn], dim=-1) @ ref.proj.T
    cos_sin = Rotary(hf_cfg)(x[None], positions[None])
    y = ref.block(x[None], attention_mask=None, position_ids=positions[None], position_embeddings=cos_sin)
    if isinstance(y, tuple):
        y = y[0]
    return ref.final_norm(y[0])


def ref_logits(ref: RefMTPLayer, g: torch.Tensor, lm_head: torch.Tensor) -> torch.Tensor:
    return g @ (ref.head if ref.head is not None else lm_head).T


# ---- paged KV in miniature ----------------------------------------------------------------------


class MiniPager:
    """Shuffled block pool and varlen metadata for MTP caches (the engine gives the MTP layer its
    own cache with the same block tables as the main layers)."""

    def __init__(self, num_blocks: int = 32, block_size: int = 4, seed: int = 0):
        import random

        self.block_size = block_size
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)
        self.tables: dict[int, list[int]] = {}

    def cache(self, cfg, num_blocks: int = 32, seed: int = 0, dtype=torch.float32) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)  # finite garbage: unused slots must never be trusted
        return torch.randn(2, num_blocks, self.block_size, cfg.num_kv_heads, cfg.head_dim, generator=g).to(dtype)

    def meta(self, work: list[tuple[int, int, int]]) -> AttentionMetadata:
        """work: (seq id, start position, q_len) per sequence, in row order."""
        bs = self.block_size
        slots, qlens, seq_lens = [], [], []
        for sid, start, n in work:
            blocks = self.tables.setdefault(sid, [])
            while len(blocks) * bs < start + n:
                blocks.append(self.free.pop())
            slots += [blocks[p // bs] * bs + p % bs for p in range(start, start + n)]
            qlens.append(n)
            seq_lens.append(start + n)
        width = max(len(self.tables[sid]) for sid, _, _ in work)
        tables = [self.tables[sid] + [0] * (width - len(self.tables[sid])) for sid, _, _ in work]
        qsl = [0]
        for n in qlens:
            qsl.append(qsl[-1] + n)
        return AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_tables=torch.tensor(tables, dtype=torch.int32),
            block_size=bs,
            query_lens_cpu=qlens,
            seq_lens_cpu=seq_lens,
            max_query_len=max(qlens),
            max_seq_len=max(seq_lens),
            all_slots_valid=True,
        )

    def last_rows(self, meta: AttentionMetadata, positions: torch.Tensor) -> RowSelection:
        """The last row of each sequence, as the runner's RowSelection builds it."""
        rows = (meta.query_start_loc[1:] - 1).long()
        seq_lens = [int(positions[r]) + 1 for r in rows]
        sub = AttentionMetadata(
            slot_mapping=meta.slot_mapping[rows],
            query_start_loc=torch.arange(len(rows) + 1, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_tables=meta.block_tables,
            block_size=meta.block_size,
            query_lens_cpu=[1] * len(rows),
            seq_lens_cpu=seq_lens,
            max_query_len=1,
            max_seq_len=max(seq_lens),
            all_slots_valid=True,
        )
        return RowSelection(rows, sub)
