"""GGUF files of the hybrid Qwen models (`qwen3next`, `qwen35`, `qwen35moe`) as llama.cpp's converter
writes them, turned back into the HF config and checkpoint names / layouts ember's model loads.

What the converter does (llama.cpp conversion/qwen.py, 0.3.36) and how it is undone here:
- every zero-centred norm is stored as 1 + w (attn_norm, post_attention_norm, output_norm,
  attn_q_norm, attn_k_norm): subtract 1; the Gated DeltaNet output norm (ssm_norm) is stored as is;
- A_log becomes ssm_a = -exp(A_log): A_log = log(-ssm_a); dt_bias becomes ssm_dt.bias;
- conv1d [C, 1, K] is squeezed to [C, K] (ember's layer takes either);
- Qwen3-Next's in_proj_qkvz (interleaved per key-head group) is split into attn_qkv = [q | k | v]
  and attn_gate = z, both in HF's grouped value-head order; in_proj_ba stays interleaved (ssm_ba):
  they load as Qwen3.5's in_proj_qkv / in_proj_z and Qwen3-Next's in_proj_ba;
- Qwen3.5 (qwen35, qwen35moe; and qwen4exp, ember.loader.gguf_qwen4) moves value heads from grouped order (head j reads key head j // r)
  to tiled order (key head j % nk) across attn_qkv's v rows, attn_gate, ssm_alpha / ssm_beta
  (in_proj_a / in_proj_b), ssm_a, ssm_dt, ssm_conv1d's v channels and ssm_out's columns, when the
  key and value head counts differ: each is permuted back. Rows of a packed quantized matrix move
  as whole rows (each row is quantized on its own); ssm_out's columns cannot (they share blocks), so
  a quantized ssm_out stays packed in the file's column order and its input is permuted instead
  (GGUFTensor.with_input_order: out_proj reads the value heads in the file's tiled order);
- experts are stacked (ffn_{gate,up,down}_exps), the shared expert is ffn_*_shexp with its gate
  ffn_gate_inp_shexp;
- the MTP layer (unless converted with --no-mtp): block_count grows by nextn_predict_layers, mtp.layers.{j}.*
  becomes block num_hidden_layers + j (an ordinary full-attention block), and the shared mtp.fc,
  mtp.pre_fc_norm_embedding, mtp.pre_fc_norm_hidden and mtp.norm become blk.{num_hidden_layers}.nextn.eh_proj,
  .enorm, .hnorm and .shared_head_norm, their norms 1 + w like the others. The main model skips these blocks;
  MTP speculation reads them back under their HF names (GGUFCheckpoint.iter_weights(mtp=True)).
"""

from __future__ import annotations

import numpy as np
import torch

from ember.errors import ModelLoadError
from ember.loader import gguf_qwen4

# Beyond the names every GGUF architecture shares (ember.loader.gguf's block table)
BLOCK_NAMES = {
    "post_attention_norm": "post_attention_layernorm",
    "attn_qkv": "linear_attn.in_proj_qkv",
    "attn_gate": "linear_attn.in_proj_z",
    "ssm_ba": "linear_attn.in_proj_ba",
    "ssm_alpha": "linear_attn.in_proj_a",
    "ssm_beta": "linear_attn.in_proj_b",
    "ssm_conv1d": "linear_attn.conv1d",
    "ssm_norm": "linear_attn.norm",
    "ssm_out": "linear_attn.out_proj",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
# 1-D tensors that are not "<name>.weight" / ".bias" in the file
BARE_NAMES = {"ssm_a": "linear_attn.A_log", "ssm_dt": "linear_attn.dt_bias"}
# the MTP layer's own tensors -> its HF names (the converter's remapper in conversion/qwen.py, reversed)
NEXTN_NAMES = {
    "nextn.eh_proj": "mtp.fc",
    "nextn.enorm": "mtp.pre_fc_norm_embedding",
    "nextn.hnorm": "mtp.pre_fc_norm_hidden",
    "nextn.shared_head_norm": "mtp.norm",
}
ZERO_CENTRED = (
    "attn_norm",
    "post_attention_norm",
    "attn_q_norm",
    "attn_k_norm",
    "nextn.enorm",
    "nextn.hnorm",
    "nextn.shared_head_norm",
)


def hybrid_config(ckpt, cfg: dict) -> dict:
    """Add the hybrid keys to the base config dict built from the file's common metadata."""
    a = ckpt._arch
    nextn = int(a("nextn_predict_layers", 0) or 0)
    layers = int(ckpt._arch_required("block_count")) - nextn
    recurrent = a("attention.recurrent_layers")
    if recurrent is not None:
        types = ["linear_attention" if r else "full_attention" for r in list(recurrent)[:layers]]
    else:
        interval = int(a("full_attention_interval", 4))
        types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)]
    nk, nv = int(ckpt._arch_required("ssm.group_count")), int(ckpt._arch_required("ssm.time_step_rank"))
    head_dim = cfg["head_dim"]
    rot = int(a("rope.dimension_count", head_dim // 4))
    cfg.update(
        num_hidden_layers=layers,
        layer_types=types,
        linear_num_key_heads=nk,
        linear_num_value_heads=nv,
        linear_key_head_dim=int(ckpt._arch_required("ssm.state_size")),
        linear_value_head_dim=int(ckpt._arch_required("ssm.inner_size")) // nv,
        linear_conv_kernel_dim=int(ckpt._arch_required("ssm.conv_kernel")),
        rope_parameters={
            "rope_type": "default",
            "rope_theta": cfg["rope_theta"],
            "partial_rotary_factor": rot / head_dim,
        },
        attention_bias=False,
    )
    if ckpt.architecture in ("qwen3next", "qwen35moe", "qwen4exp"):
        cfg.update(
            num_experts=int(ckpt._arch_required("expert_count")),
            num_experts_per_tok=int(ckpt._arch_required("expert_used_count")),
            moe_intermediate_size=int(ckpt._arch_required("expert_feed_forward_length")),
            shared_expert_intermediate_size=int(a("expert_shared_feed_forward_length", 0) or 0),
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )
    if nextn:  # what the HF config calls it: the planner sizes the MTP's KV by it, MTP speculation reads it
        cfg["mtp_num_hidden_layers"] = nextn
    return cfg


class Untangler:
    """Per tensor: its HF name and the inverse of what the converter did to it."""

    def __init__(self, ckpt, common_names: dict[str, str]):
        """common_names: the block names every architecture shares (attn_q, ffn_gate, ...)."""
        self.names = {**common_names, **BLOCK_NAMES}
        self.zero_centred = ZERO_CENTRED + ("output_norm",)
        if ckpt.architecture == gguf_qwen4.ARCH:
            self.names |= gguf_qwen4.BLOCK_NAMES
            self.zero_centred += gguf_qwen4.ZERO_CENTRED
        cfg = ckpt.config
        self.num_layers = cfg["num_hidden_layers"]
        self.nk, self.nv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
        self.dk, self.dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
        self.tiled = ckpt.architecture in ("qwen35", "qwen35moe", gguf_qwen4.ARCH) and self.nk != self.nv

    def is_mtp_layer(self, layer: int) -> bool:
        return layer >= self.num_layers

    def mtp_prefix(self, layer: int) -> str:
        return f"mtp.layers.{layer - self.num_layers}."

    def nextn_name(self, layer: int, part: str, kind: str | None) -> str | bool:
        """HF name of an MTP layer's own tensor; False for one Qwen's MTP has not (a dedicated embedding or
        head), or one past the first MTP block (the converter puts the shared ones there)."""
        if part not in NEXTN_NAMES or kind is None or layer != self.num_layers:
            return False
        return f"{NEXTN_NAMES[part]}.{kind}"

    def hf_name(self, layer: int, part: str, kind: str | None) -> str | None | bool:
        if part in BARE_NAMES and kind is None or part == "ssm_dt" and kind == "bias":
            return f"model.layers.{layer}.{BARE_NAMES[part]}"
        if part in self.names and kind is not None:
            return f"model.layers.{layer}.{self.names[part]}.{kind}"
        return False

    def grouped_order(self, head_dim: int) -> np.ndarray:
        """Row index (in the file's tiled order) of each row in HF's grouped order."""
        r = self.nv // self.nk
        g, i = np.divmod(np.arange(self.nv), r)  # grouped head j = g * r + i
        tiled = i * self.nk + g
        return (tiled[:, None] * head_dim + np.arange(head_dim)[None, :]).reshape(-1)

    def fix(self, part: str, weight):
        """The file's tensor -> HF's (weight: float32 torch tensor, or GGUFTensor rows for matrices)."""
        if part in self.zero_centred:
            return weight - 1.0
        if part == "ffn_gate_inp_shexp" and isinstance(weight, torch.Tensor) and weight.dim() == 1:
            return weight[None]  # llama.cpp's quantizer writes the [hidden, 1] gate with ne [hidden]
        if part == "ssm_a":
            if (weight >= 0).any():
                raise ModelLoadError("ssm_a must be negative (-exp(A_log)); the file is not a converted Qwen hybrid")
            weight = torch.log(-weight)
        if not self.tiled:
            return weight
        if part in ("ssm_a", "ssm_dt", "ssm_alpha", "ssm_beta"):
            return _rows(weight, self.grouped_order(1))
        if part == "attn_gate":
            return _rows(weight, self.grouped_order(self.dv))
        if part in ("attn_qkv", "ssm_conv1d"):
            qk = 2 * self.nk * self.dk
            return _rows(weight, np.concatenate([np.arange(qk), qk + self.grouped_order(self.dv)]))
        if part == "ssm_out":
            order = self.grouped_order(self.dv)
            if not isinstance(weight, torch.Tensor):  # columns of packed blocks cannot move: x's do
                return weight.with_input_order(order)
            return weight[:, torch.from_numpy(order)].contiguous()
        return weight


def _rows(weight, order: np.ndarray):
    if isinstance(weight, torch.Tensor):
        return weight[torch.from_numpy(order)].contiguous()
    return weight.permute_rows(order)
