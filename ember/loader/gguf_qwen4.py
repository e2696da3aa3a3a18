"""qwen4_exp GGUF files (`general.architecture` qwen4exp) as llama.cpp's converter writes them
(conversion/qwen4exp.py, vendored in llama-cpp-python 0.3.36), turned back into ember's qwen4_exp config
and HF checkpoint names. Everything Qwen3.5-MoE has is gguf_hybrid's (value-head reorder, ssm_a, experts);
what qwen4exp adds (../shared/research/qwen4exp.md section 7), and how it is undone here:

- hyper-connections: blk.N.hc_{attn,ffn}_{norm,down,up,inject} and output_hc_{norm,down,up} are the
  {attn,mlp}_hyper_connection and hyper_connection_mixer projections; their grouped norms are stored 1 + w
  (as are ple_norm_*, indexer.{q,k}_norm and the attention's q/k norms): subtract 1. There is no attn_norm,
  ffn_norm or output_norm.
- the indexer's index_qk_proj was split into indexer.q_proj and indexer.k_proj: their rows are joined back
  (packed blocks row by row when both share a type, else both dequantized).
- PLE: ple.* metadata (0-based layer, n-gram size, heads, conv kernel, EOS) and the hash constants as
  uint64 arrays (ple.layer_multipliers, head_offsets, head_vocab_sizes). The HF config's seed, prime base
  and row padding are not stored: they are recovered from the constants (the seed by inverting splitmix64),
  and the PLE layer checks that its own hash derives the file's constants exactly. The n-gram table,
  per_layer_token_embd [dim, rows], is one tensor of any ggml type: it is handed over as a row source
  (ember.layers.table_rows.GGUFRows) that preads the rows a batch hashes to and dequantizes only those.
- attention.compress_ratios: the converter under transformers >= 5.23 writes every ratio 0 (it tests
  layer type == "full_attention" after transformers renamed it to indexed_attention), which llama.cpp runs
  dense. With indexer tensors present and every ratio 0, ember takes 4 (the only ratio Qwen ships) and warns.
- MTP: this converter writes none (no_mtp); a file with nextn tensors is refused by name like any unknown one.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from ember.errors import ModelLoadError
from ember.layers.ple import head_sizes
from ember.layers.table_rows import GGUFRows
from ember.quant.gguf_blocks import GGUFTensor

log = logging.getLogger(__name__)

ARCH = "qwen4exp"
TABLE = "per_layer_token_embd.weight"
_HC = {"norm": "hc_norm", "down": "input_mix_weight_down", "up": "input_mix_weight_up", "inject": "block_inject_weight"}
# per-block names beyond Qwen3.5-MoE's (gguf_hybrid.BLOCK_NAMES), under model.layers.N
BLOCK_NAMES = {
    **{f"hc_attn_{k}": f"attn_hyper_connection.{v}" for k, v in _HC.items()},
    **{f"hc_ffn_{k}": f"mlp_hyper_connection.{v}" for k, v in _HC.items()},
    "indexer.q_norm": "self_attn.indexer.q_layernorm",
    "indexer.k_norm": "self_attn.indexer.k_layernorm",
    "ple_key": "ple.key_proj",
    "ple_value": "ple.value_proj",
    "ple_norm_key": "ple.norm_key",
    "ple_norm_query": "ple.norm_query",
    "ple_norm_conv": "ple.norm_conv",
    "ple_conv1d": "ple.conv1d",
    # both halves name the joined projection (Qwen4Weights.indexer_part joins them)
    "indexer.q_proj": "self_attn.indexer.index_qk_proj",
    "indexer.k_proj": "self_attn.indexer.index_qk_proj",
}
GLOBAL_NAMES = {
    f"output_hc_{k}.weight": f"model.hyper_connection_mixer.{_HC[k]}.weight" for k in ("norm", "down", "up")
}
# stored as 1 + w
ZERO_CENTRED = (
    "hc_attn_norm",
    "hc_ffn_norm",
    "output_hc_norm",
    "indexer.q_norm",
    "indexer.k_norm",
    "ple_norm_key",
    "ple_norm_query",
    "ple_norm_conv",
)
# the split indexer projection: its parts in index_qk_proj's row order (4 query heads, then the key)
INDEXER_PARTS = ("indexer.q_proj", "indexer.k_proj")
INDEXER_QK = "self_attn.indexer.index_qk_proj.weight"
DEFAULT_COMPRESS_RATIO = 4
_CONSTANTS = {
    "layer_multipliers": "layer_multipliers",
    "head_vocab_sizes": "ngram_heads_vocab_sizes",
    "head_offsets": "ngram_heads_offsets",
}


def qwen4_config(ckpt, cfg: dict[str, Any]) -> dict[str, Any]:
    """Add qwen4_exp's keys (hyper-connections, the QSA indexer, PLE) to the hybrid config dict."""
    a, key = ckpt._arch, ckpt._arch_required
    if sections := a("rope.dimension_sections"):  # text positions are one axis: kept for the record
        cfg["rope_parameters"].update(mrope_section=list(sections)[:3], mrope_interleaved=True)
    cfg.update(
        hc_count=int(key("hyper_connection.count")),
        hc_lowrank=int(key("hyper_connection.low_rank")),
        output_gate_type="sigmoid",  # llama.cpp's qwen4exp graph has no other; the converter stores none
        indexer_n_heads=int(key("attention.indexer.head_count")),
        indexer_head_dim=int(key("attention.indexer.key_length")),
        indexer_budget=int(key("attention.indexer.top_k")),
        indexer_kv_heads=1,
        indexer_compress_ratio=_compress_ratio(ckpt, cfg["layer_types"]),
    )
    _check_hyper_connections(ckpt, cfg)
    if a("ple.layers") is not None or TABLE in ckpt._tensors:
        cfg.update(_ple_config(ckpt, cfg))
    return cfg


def _check_hyper_connections(ckpt, cfg: dict[str, Any]) -> None:
    """hyper_connection.count / low_rank against the final mixer's down-projection, ne [count x hidden, low_rank]."""
    count, lowrank, hidden = cfg["hc_count"], cfg["hc_lowrank"], cfg["hidden_size"]
    down = ckpt._tensors.get("output_hc_down.weight")
    if down is None:
        raise ModelLoadError(
            f"{ckpt.path} lacks output_hc_down.weight, the final hyper-connection mixer; re-convert it"
        )
    if count < 2 or lowrank < 1 or [int(n) for n in down.shape] != [count * hidden, lowrank]:
        raise ModelLoadError(
            f"{ckpt.path}: {ARCH}.hyper_connection.count {count} and .low_rank {lowrank} (hidden {hidden}) do not "
            f"fit output_hc_down.weight {[int(n) for n in down.shape]} (needs [count x hidden, low_rank], count >= 2); "
            "the metadata does not belong to these tensors: re-convert the file"
        )


def _compress_ratio(ckpt, types: list[str]) -> int:
    """The one QSA block size of the attention layers (attention.compress_ratios, 0 on the others)."""
    path, name = ckpt.path, f"{ARCH}.attention.compress_ratios"
    ratios = [int(r) for r in ckpt._arch("attention.compress_ratios") or []]
    attention = [i for i, t in enumerate(types) if t == "full_attention"]
    if ratios and len(ratios) < len(types):
        raise ModelLoadError(f"{path}: {name} lists {len(ratios)} layers, the model has {len(types)}; re-convert it")
    if not any(ratios):
        has_indexer = any(f"blk.{i}.indexer.k_proj.weight" in ckpt._tensors for i in attention)
        if not has_indexer:
            raise ModelLoadError(
                f"{path}: {name} is {'all 0' if ratios else 'missing'} and the attention layers have no "
                "indexer tensors; ember runs qwen4exp's attention with its QSA indexer only. Re-convert the file."
            )
        log.warning(
            "%s: %s is all 0 although its attention layers carry QSA indexers: the converter wrote it so under "
            "transformers >= 5.23 (which renamed full_attention to indexed_attention), and llama.cpp silently "
            "runs such a file dense. ember takes the ratio %d, Qwen's (re-convert with transformers < 5.23, "
            "or set the key, for llama.cpp to read it too)",
            path,
            name,
            DEFAULT_COMPRESS_RATIO,
        )
        return DEFAULT_COMPRESS_RATIO
    kinds = {ratios[i] for i in attention}
    if len(kinds) != 1 or 0 in kinds or any(ratios[i] for i in range(len(types)) if i not in attention):
        raise ModelLoadError(
            f"{path}: {name} {ratios} must give every attention layer {attention} one nonzero ratio (ember "
            "runs a single QSA block size) and the linear-attention layers 0; re-convert the file"
        )
    return kinds.pop()


def _ple_config(ckpt, cfg: dict[str, Any]) -> dict[str, Any]:
    """The HF config's PLE keys, recovered from the file's ple.* metadata and its table's shape."""
    path, key = ckpt.path, ckpt._arch_required
    layers = [int(i) for i in key("ple.layers")]
    if len(layers) != 1:
        raise ModelLoadError(
            f"{path}: {ARCH}.ple.layers {layers} names {len(layers)} PLE layers; the converter (and llama.cpp) "
            "write exactly one, with one set of hash constants"
        )
    table = ckpt._tensors.get(TABLE)
    if table is None:
        raise ModelLoadError(
            f"{path} has PLE metadata ({ARCH}.ple.layers {layers}) but no {TABLE} tensor (the n-gram table); "
            "the file is incomplete: re-download or re-convert it"
        )
    ngram, per = int(key("ple.ngram_size")), int(key("ple.heads_per_ngram"))
    width, rows = int(table.shape[0]), int(table.shape[1])
    stated = ckpt._arch("embedding_length_per_layer_input")
    if stated is not None and int(stated) != width:
        raise ModelLoadError(
            f"{path}: {ARCH}.embedding_length_per_layer_input is {stated} but {TABLE} has rows of {width}"
        )
    constants = {k: _constant(ckpt, k) for k in _CONSTANTS}
    heads = (ngram - 1) * per
    seed, base, padding = hash_parameters(constants, cfg["vocab_size"], ngram, heads, rows, path)
    eos = int(key("ple.eos_token_id"))
    tokenizer_eos = cfg.get("eos_token_id")
    return dict(
        ple_layer_ids=[layers[0] + 1],  # the HF config's are 1-based
        ple_embed_dim=width * heads,
        ple_conv_kernel_size=int(key("ple.conv_kernel")),
        ngram_size=ngram,
        heads_per_ngram=per,
        ngram_vocab_size_base=base,
        make_ngram_vocab_size_divisible_by=padding,
        seed=seed,
        # PLE restarts its n-grams on the first; the tokenizer's own EOS stays a stop token too
        eos_token_id=[eos] + ([tokenizer_eos] if tokenizer_eos is not None and tokenizer_eos != eos else []),
    )


def _constant(ckpt, name: str) -> list[int]:
    values = ckpt._arch(f"ple.{name}")
    if values is None:
        raise ModelLoadError(
            f"{ckpt.path} lacks {ARCH}.ple.{name}, one of the PLE hash constants (uint64 arrays the converter "
            "copies from the checkpoint's ple_embedding buffers); re-convert it with llama.cpp's current converter"
        )
    return [int(v) for v in values]


def hash_parameters(constants: dict, vocab: int, ngram: int, heads: int, rows: int, path: str) -> tuple[int, int, int]:
    """(seed, ngram_vocab_size_base, make_ngram_vocab_size_divisible_by) under which ember's NGramHash
    (ember.layers.ple) derives the file's constants for the first PLE layer; ModelLoadError naming the key
    when none does."""
    mult, sizes, offsets = constants["layer_multipliers"], constants["head_vocab_sizes"], constants["head_offsets"]
    name = f"{path}: {ARCH}.ple"
    if len(mult) != ngram or len(sizes) != heads or len(offsets) != heads:
        raise ModelLoadError(
            f"{name}.layer_multipliers / head_vocab_sizes / head_offsets have {len(mult)} / {len(sizes)} / "
            f"{len(offsets)} entries; ple.ngram_size {ngram} and ple.heads_per_ngram need {ngram} / {heads} / {heads}"
        )
    if head_sizes(sizes[0], heads, 0) != sizes or offsets != [sum(sizes[:g]) for g in range(heads)]:
        raise ModelLoadError(
            f"{name}.head_vocab_sizes {sizes[:4]}... must be consecutive primes and head_offsets their prefix "
            "sums (as the PLE hash makes them); the file's constants are damaged: re-convert it"
        )
    total = sum(sizes)
    if rows < total:
        raise ModelLoadError(f"{path}: {TABLE} has {rows} rows; the PLE hash heads address {total}")
    padding = 128 if -(-total // 128) * 128 == rows else rows  # Qwen pads to 128 rows; else the table's own
    return _seed(mult, vocab, path), sizes[0], padding


_MASK = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15
_C1, _C2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def _seed(multipliers: list[int], vocab: int, path: str) -> int:
    """The seed whose splitmix64 stream gives these multipliers (m_i = 2 (splitmix64(seed + gamma (i + 1)) mod
    h) + 1, h = (2^63 - 1) // vocab // 2: ember.layers.ple.layer_multipliers). splitmix64 is a bijection, so
    each of the 2^64 / h outputs congruent to (m_0 - 1) / 2 mod h gives one candidate seed; the other
    multipliers pick the one (vectorized: about 4 x vocab candidates)."""
    half = max(1, ((1 << 63) - 1) // max(vocab, 1) // 2)
    r = (multipliers[0] - 1) // 2
    if multipliers[0] % 2 == 0 or r >= half:
        raise ModelLoadError(
            f"{path}: {ARCH}.ple.layer_multipliers {multipliers} are not the PLE hash's for vocab {vocab}"
        )
    outputs = np.arange((_MASK - r) // half + 1, dtype=np.uint64) * np.uint64(half) + np.uint64(r)
    with np.errstate(over="ignore"):
        seeds = _unmix(outputs) - np.uint64(2 * _GAMMA & _MASK)  # splitmix adds gamma, the stream gamma (i + 1)
        keep = np.ones(len(seeds), dtype=bool)
        for i, m in enumerate(multipliers[1:], start=2):
            keep &= _mix(seeds + np.uint64(i * _GAMMA & _MASK) + np.uint64(_GAMMA)) % np.uint64(half) == (m - 1) // 2
    found = seeds[keep]
    if len(found) == 0:
        raise ModelLoadError(
            f"{path}: {ARCH}.ple.layer_multipliers {multipliers} come from no seed of the PLE hash for a vocabulary "
            f"of {vocab}; the file's constants or its vocabulary size are wrong: re-convert it"
        )
    return int(found.min())


def _mix(z: np.ndarray) -> np.ndarray:
    """splitmix64's output function (after its + gamma), uint64 with wraparound."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(_C1)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(_C2)
    return z ^ (z >> np.uint64(31))


def _unmix(y: np.ndarray) -> np.ndarray:
    """_mix's inverse."""
    y = _unshift(y, 31) * np.uint64(pow(_C2, -1, 1 << 64))
    y = _unshift(y, 27) * np.uint64(pow(_C1, -1, 1 << 64))
    return _unshift(y, 30)


def _unshift(y: np.ndarray, s: int) -> np.ndarray:
    """x from y = x ^ (x >> s)."""
    x = y
    for _ in range(64 // s):
        x = y ^ (x >> np.uint64(s))
    return x


class Qwen4Weights:
    """What iter_weights yields for qwen4exp beyond the per-tensor renaming: the n-gram table as a row
    source, the PLE hash constants (checked by the PLE layer against its own hash), and the indexer's
    two projections joined into index_qk_proj."""

    def __init__(self, ckpt):
        self.ckpt = ckpt
        self._pending: dict[int, dict[str, Any]] = {}
        ple = ckpt.config.get("ple_layer_ids")
        self.ple_prefix = f"model.layers.{ple[0] - 1}.ple.ple_embedding" if ple else None

    def table(self, t) -> tuple[str, GGUFRows]:
        """The n-gram table (the GGUF tensor t) as rows read from the file, never loaded."""
        rows = GGUFRows(self.ckpt.path, int(t.data_offset), int(t.tensor_type), int(t.shape[1]), int(t.shape[0]))
        return f"{self.ple_prefix}.ngram_embedding.weight", rows

    def constants(self):
        """The hash constants under the HF checkpoint's buffer names, as int64 tensors."""
        for gguf_name, hf_name in _CONSTANTS.items():
            values = torch.tensor([v - (1 << 64) if v >= 1 << 63 else v for v in _constant(self.ckpt, gguf_name)])
            yield f"{self.ple_prefix}.{hf_name}", values

    def indexer_part(self, layer: int, part: str, weight):
        """One half of a layer's split indexer projection; the joined index_qk_proj once both are in."""
        got = self._pending.setdefault(layer, {})
        got[part] = weight
        if len(got) < len(INDEXER_PARTS):
            return []
        del self._pending[layer]
        return [(f"model.layers.{layer}.{INDEXER_QK}", join_rows([got[p] for p in INDEXER_PARTS]))]

    def finish(self) -> None:
        if self._pending:
            layer, got = next(iter(self._pending.items()))
            lacking = [f"blk.{layer}.{p}.weight" for p in INDEXER_PARTS if p not in got]
            raise ModelLoadError(f"{self.ckpt.path} lacks {lacking[0]}, half of the QSA indexer's projection")


def join_rows(parts: list):
    """Matrices [rows_i, in] stacked by rows: packed blocks stay packed when they share a type (rows are
    independent runs of blocks), else every part is dequantized to float32."""
    if all(isinstance(p, GGUFTensor) for p in parts) and len({(p.qtype, p.shape[1]) for p in parts}) == 1:
        if all(p.input_order is None for p in parts):
            data = np.concatenate([p.data for p in parts])
            return GGUFTensor(parts[0].qtype, data, (data.shape[0], parts[0].shape[1]))
    if all(isinstance(p, torch.Tensor) for p in parts) and len({p.dtype for p in parts}) == 1:
        return torch.cat(parts)
    return torch.cat([p.dequantize(torch.float32) if isinstance(p, GGUFTensor) else p.float() for p in parts])
