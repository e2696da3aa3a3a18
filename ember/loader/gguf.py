"""A single-file GGUF checkpoint seen as a Hugging Face model: config dict, tokenizer, weights.

Layout and metadata keys: shared/research/formats.md section 3. The file is memory-mapped by
the `gguf` package's reader; tensors are dequantized to float32 one at a time as they are
iterated, so peak memory stays near one tensor above what is loaded (each tensor's pages of the map
leave the resident set once copied: gguf_blocks.release_pages). With `packed=True` quantized
weights come instead as GGUFTensor raw blocks (views of the map) for the gguf QuantMethods.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import re
import struct
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType, ReaderField
from gguf.quants import dequantize
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from ember.config.architectures import GGUF_ARCHITECTURES
from ember.errors import ModelLoadError, UnsupportedModelError
from ember.loader import gguf_hybrid, gguf_qwen4
from ember.loader.tokenizer import Tokenizer
from ember.quant.gguf_blocks import FLOAT_TYPES, GGUFTensor, release_pages
from ember.quant.mapped_experts import map_view

log = logging.getLogger(__name__)

# Per-block tensor names: gguf suffix -> HF suffix under model.layers.N.
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# Tensors that are not parameters of the HF model; the config carries what they encode.
_SKIPPED = {"rope_freqs.weight"}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# ssm_a has no suffix; an MTP layer's own tensors are blk.N.nextn.*, qwen4exp's indexer blk.N.indexer.*
_HYBRID_BLOCK_RE = re.compile(r"blk\.(\d+)\.((?:nextn\.|indexer\.)?\w+?)(?:\.(weight|bias))?")
_EXPERTS_RE = re.compile(r"ffn_(gate|up|down)_exps")

# tokenizer.ggml.token_type values
_CONTROL, _USER_DEFINED = 3, 4


class GGUFCheckpoint:
    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        start = time.perf_counter()
        self._reader = _open_reader(self.path)
        self._tensors = {t.name: t for t in self._reader.tensors}
        self._tokenizer: Tokenizer | None = None
        self.architecture: str = self.metadata("general.architecture", "")
        if self.architecture not in GGUF_ARCHITECTURES:
            raise UnsupportedModelError(
                f"{self.path} is a GGUF of architecture {self.architecture!r}, which ember does not "
                f"implement. Supported GGUF architectures: {', '.join(sorted(GGUF_ARCHITECTURES))}."
            )
        self.traits = GGUF_ARCHITECTURES[self.architecture]
        self.config: dict[str, Any] = self._build_config()
        self._untangler = gguf_hybrid.Untangler(self, _BLOCK_NAMES) if self.traits.hybrid else None
        self.tensor_bytes: int = sum(int(t.n_bytes) for t in self._reader.tensors)
        self.num_parameters: int = sum(int(t.n_elements) for t in self._reader.tensors if t.name not in _SKIPPED)
        log.debug(
            "opened %s (%s, %d tensors) in %.2fs",
            self.path,
            self.architecture,
            len(self._tensors),
            time.perf_counter() - start,
        )

    # ---- metadata -------------------------------------------------------------------------

    def metadata(self, key: str, default: object = None) -> Any:
        """A metadata value by its GGUF key (arrays come back as lists)."""
        field = self._reader.fields.get(key)
        return default if field is None else field.contents()

    def _arch(self, key: str, default: object = None) -> Any:
        return self.metadata(f"{self.architecture}.{key}", default)

    def _arch_required(self, key: str) -> Any:
        value = self._arch(key)
        if value is None:
            raise ModelLoadError(
                f"{self.path} lacks metadata {self.architecture}.{key}; re-convert it with a current llama.cpp."
            )
        return value

    def _build_config(self) -> dict[str, Any]:
        arch_name, model_type = self.traits.name, self.traits.gguf_model_type
        hidden = int(self._arch_required("embedding_length"))
        heads = int(self._arch_required("attention.head_count"))
        kv_heads = self._arch("attention.head_count_kv", heads)
        if isinstance(kv_heads, list):  # some converters write one count per layer
            kv_heads = max(kv_heads)
        vocab = self._arch("vocab_size")
        if vocab is None and "tokenizer.ggml.tokens" in self._reader.fields:
            vocab = len(self._reader.fields["tokenizer.ggml.tokens"].data)
        if vocab is None and "token_embd.weight" in self._tensors:  # ne is [hidden, vocab]
            vocab = int(self._tensors["token_embd.weight"].shape[1])
        if vocab is None:
            raise ModelLoadError(f"{self.path} states no vocabulary size and has no token list or embedding.")
        cfg: dict[str, Any] = {
            "architectures": [arch_name],
            "model_type": model_type,
            "hidden_size": hidden,
            "num_hidden_layers": int(self._arch_required("block_count")),
            "num_attention_heads": heads,
            "num_key_value_heads": int(kv_heads),
            "head_dim": int(self._arch("attention.key_length", hidden // heads)),
            "rms_norm_eps": _f32(self._arch("attention.layer_norm_rms_epsilon", 1e-6)),
            "rope_theta": _f32(self._arch("rope.freq_base", 10000.0)),
            "max_position_embeddings": int(self._arch("context_length", 2048)),
            "vocab_size": int(vocab),
            "hidden_act": "silu",
            "tie_word_embeddings": "output.weight" not in self._tensors,
            "attention_bias": self.architecture == "qwen2",
            "bos_token_id": self.metadata("tokenizer.ggml.bos_token_id"),
            "eos_token_id": self.metadata("tokenizer.ggml.eos_token_id"),
            "pad_token_id": self.metadata("tokenizer.ggml.padding_token_id"),
        }
        if (ffn := self._arch("feed_forward_length")) is not None:
            cfg["intermediate_size"] = int(ffn)
        if self.architecture == "qwen3moe":
            cfg.update(
                num_experts=int(self._arch_required("expert_count")),
                num_experts_per_tok=int(self._arch_required("expert_used_count")),
                moe_intermediate_size=int(self._arch_required("expert_feed_forward_length")),
                # llama.cpp always renormalizes the top-k weights for qwen3moe
                norm_topk_prob=True,
                decoder_sparse_step=1,
                mlp_only_layers=[],
            )
        if (rope_scaling := self._rope_scaling(cfg)) is not None:
            cfg["rope_scaling"] = rope_scaling
        if self.traits.hybrid:
            cfg = gguf_hybrid.hybrid_config(self, cfg)
        if self.architecture == gguf_qwen4.ARCH:
            cfg = gguf_qwen4.qwen4_config(self, cfg)
        return cfg

    def _rope_scaling(self, cfg: dict[str, Any]) -> dict[str, Any] | None:
        kind = self._arch("rope.scaling.type")
        factor = self._arch("rope.scaling.factor")
        if kind is None and self._arch("rope.scale_linear") is not None:  # older files
            kind, factor = "linear", self._arch("rope.scale_linear")
        if kind in ("linear", "yarn") and factor is not None:
            out: dict[str, Any] = {"rope_type": kind, "factor": float(factor)}
            if (orig := self._arch("rope.scaling.original_context_length")) is not None:
                out["original_max_position_embeddings"] = int(orig)
            if kind == "yarn":
                for key in ("beta_fast", "beta_slow"):
                    if (v := self._arch(f"rope.scaling.yarn_{key}")) is not None:
                        out[key] = float(v)
            return out
        if kind not in (None, "none"):
            raise UnsupportedModelError(
                f"{self.path} uses RoPE scaling {kind!r}; ember supports linear, yarn and llama3."
            )
        # Llama 3.1+ files carry llama3 scaling only as the rope_freqs tensor of divisors
        freqs = self._tensors.get("rope_freqs.weight")
        if freqs is None:
            return None
        dim = int(self._arch("rope.dimension_count", cfg["head_dim"]))
        return _llama3_scaling_from_divisors(
            np.asarray(dequantize(freqs.data, freqs.tensor_type), dtype=np.float64).reshape(-1),
            cfg["rope_theta"],
            dim,
            self.path,
        )

    # ---- tokenizer ------------------------------------------------------------------------

    def tokenizer(self) -> Tokenizer:
        """The file's tokenizer, built once per checkpoint."""
        if self._tokenizer is None:
            self._tokenizer = self._build_tokenizer()
        return self._tokenizer

    def _build_tokenizer(self) -> Tokenizer:
        tokens: list[str] = self.metadata("tokenizer.ggml.tokens")
        if tokens is None:
            raise ModelLoadError(f"{self.path} has no tokenizer.ggml.tokens; it carries no tokenizer.")
        kind = self.metadata("tokenizer.ggml.model", "gpt2")
        types = self.metadata("tokenizer.ggml.token_type") or [1] * len(tokens)
        if kind == "gpt2":
            merges = self.metadata("tokenizer.ggml.merges") or []
            hf_tok, in_vocab = _byte_level_bpe(tokens, merges, self.metadata("tokenizer.ggml.pre", "default"))
            add_bos_default = False
        elif kind == "llama":
            scores = self.metadata("tokenizer.ggml.scores")
            if scores is None:
                raise UnsupportedModelError(f"{self.path}: a SentencePiece vocabulary without scores.")
            hf_tok, in_vocab = _sentencepiece_bpe(
                tokens,
                scores,
                self.metadata("tokenizer.ggml.add_space_prefix", True),
                self.metadata("tokenizer.ggml.unknown_token_id"),
            )
            # llama.cpp adds BOS to SentencePiece vocabularies unless told otherwise
            add_bos_default = True
        else:
            raise UnsupportedModelError(
                f"{self.path} has a {kind!r} tokenizer; ember reads 'gpt2' (byte-level BPE) and "
                "'llama' (SentencePiece BPE) GGUF tokenizers."
            )

        def token_of(key: str) -> str | None:
            i = self.metadata(f"tokenizer.ggml.{key}")
            return tokens[i] if i is not None and 0 <= i < len(tokens) else None

        strings = {
            "bos_token": token_of("bos_token_id"),
            "eos_token": token_of("eos_token_id"),
            "unk_token": token_of("unknown_token_id"),
            "pad_token": token_of("padding_token_id"),
        }
        # Control tokens (<|im_start|>) match whole and are special; user-defined ones (<think>)
        # match whole but stay ordinary text. Only spellings the vocabulary holds can be added
        # without growing it (a byte-level file can mislabel a token in a foreign spelling).
        hf_tok.add_special_tokens(
            [
                AddedToken(t, normalized=False, special=True)
                for t, ty in zip(tokens, types)
                if ty == _CONTROL and in_vocab(t)
            ]
        )
        hf_tok.add_tokens(
            [
                AddedToken(t, normalized=False, special=False)
                for t, ty in zip(tokens, types)
                if ty == _USER_DEFINED and in_vocab(t)
            ]
        )
        hf_tok.add_special_tokens(
            [AddedToken(s, normalized=False, special=True) for s in strings.values() if s is not None and in_vocab(s)]
        )

        # EOS first, then llama.cpp's other end-of-generation ids (Llama 3's <|eom_id|>, ...)
        eos_ids = [self.metadata(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
        return Tokenizer(
            hf_tok,
            bos_token_id=self.metadata("tokenizer.ggml.bos_token_id"),
            eos_token_ids=[i for i in eos_ids if i is not None],
            chat_template=self._chat_templates(),
            add_bos_token=bool(self.metadata("tokenizer.ggml.add_bos_token", add_bos_default)),
            add_eos_token=bool(self.metadata("tokenizer.ggml.add_eos_token", False)),
            **strings,
        )

    def _chat_templates(self) -> str | dict[str, str] | None:
        """The default template, plus any named ones (tokenizer.chat_template.tool_use, ...)."""
        default = self.metadata("tokenizer.chat_template")
        prefix = "tokenizer.chat_template."
        named = {k[len(prefix) :]: self.metadata(k) for k in self._reader.fields if k.startswith(prefix)}
        if not named:
            return default
        return ({"default": default} if default else {}) | named

    # ---- weights --------------------------------------------------------------------------

    def iter_weights(
        self, packed: bool = False, mtp: bool = False, mapped: Callable[[str], bool] | None = None
    ) -> Iterator[tuple[str, torch.Tensor | GGUFTensor]]:
        """(HF name, tensor in [out, in] layout) for every parameter, in file order.

        Tensors are float32 (BF16 and F16 matrices in their own dtype), except with `packed`: then
        quantized weights (2-D and per-expert slices) are GGUFTensor raw blocks, which the gguf
        QuantMethods keep or repack.
        1-D tensors (norms, biases) are always float32. Names are all resolved before the
        first tensor is read, so an unknown tensor fails fast rather than halfway through a load.
        mtp: the hybrid's MTP layer(s) instead (the converter's blk.N.nextn.* and blocks past
        num_hidden_layers), under the HF checkpoint's mtp.* names (gguf_hybrid.NEXTN_NAMES).
        mapped(name): the matrices it picks (routed experts kept in host memory: ember.quant.mapped_experts)
        come as views of the file's map whatever `packed` says, raw blocks or float views, never read."""
        plan = [(t, self._mtp_name(t.name) if mtp else self._hf_name(t.name)) for t in self._reader.tensors]
        unknown = [t.name for t, name in plan if name is False]
        if unknown:
            raise UnsupportedModelError(
                f"{self.path} has tensors ember does not know for {self.architecture}: {unknown[:5]}"
                f"{' ...' if len(unknown) > 5 else ''}. The file may be a newer variant of the architecture."
            )
        qwen4 = gguf_qwen4.Qwen4Weights(self) if self.architecture == gguf_qwen4.ARCH and not mtp else None
        if qwen4 is not None and qwen4.ple_prefix is not None:
            yield from qwen4.constants()
        for t, name in plan:
            if name is None:
                continue
            if qwen4 is not None and t.name == gguf_qwen4.TABLE:  # read by row from the file, never loaded
                yield qwen4.table(t)
                continue
            keep = mapped is not None and len(t.shape) >= 2 and mapped(name)
            if (packed or keep) and _is_quantized_matrix(t):
                weight = _as_blocks(t)
            else:
                weight = _float_view(t) if keep else _to_torch(t)
            if self._untangler is not None:
                part = _HYBRID_BLOCK_RE.fullmatch(t.name)
                weight = self._untangler.fix(part[2] if part else t.name.split(".")[0], weight)
                if qwen4 is not None and part and part[2] in gguf_qwen4.INDEXER_PARTS:
                    yield from qwen4.indexer_part(int(part[1]), part[2], weight)
                    continue
            m = _BLOCK_RE.fullmatch(t.name)
            if m and _EXPERTS_RE.fullmatch(m[2]):
                # Stacked [E, out, in]: one HF tensor per expert
                experts = int(t.shape[2])
                rows = weight.shape[0] // experts if isinstance(weight, GGUFTensor) else None
                for e in range(experts):
                    yield name.format(e=e), weight[e] if rows is None else weight.narrow(0, e * rows, rows)
                continue
            if self.architecture == "llama" and m and m[2] in ("attn_q", "attn_k"):
                heads = self.config["num_attention_heads" if m[2] == "attn_q" else "num_key_value_heads"]
                if isinstance(weight, GGUFTensor):  # rows are whole blocks: permuting raw rows is exact
                    weight = weight.permute_rows(_unpermute_rows(torch.arange(weight.shape[0]), heads).numpy())
                else:
                    weight = _unpermute_rows(weight, heads)
            yield name, weight
        if qwen4 is not None:
            qwen4.finish()

    def _hf_name(self, gguf_name: str) -> str | None | bool:
        """HF name (with {e} for experts), None for tensors to skip, False for unknown ones."""
        if gguf_name in _SKIPPED:
            return None
        if gguf_name in _GLOBAL_NAMES:
            return _GLOBAL_NAMES[gguf_name]
        if self.architecture == gguf_qwen4.ARCH and gguf_name in gguf_qwen4.GLOBAL_NAMES:
            return gguf_qwen4.GLOBAL_NAMES[gguf_name]
        if self.architecture == gguf_qwen4.ARCH and gguf_name == gguf_qwen4.TABLE:
            return "ple n-gram table"  # iter_weights hands it over as a row source (gguf_qwen4.Qwen4Weights)
        if self._untangler is not None and (h := _HYBRID_BLOCK_RE.fullmatch(gguf_name)) is not None:
            if self._untangler.is_mtp_layer(int(h[1])):
                return None  # read by iter_weights(mtp=True) when MTP speculation asks for it
            return self._block_hf_name(gguf_name, int(h[1]), h[2], h[3])
        return self._block_hf_name(gguf_name)

    def _block_hf_name(self, gguf_name: str, layer=None, part=None, kind=None) -> str | None | bool:
        """A block tensor's name under model.layers.{layer} (hybrids: layer, part, kind from _HYBRID_BLOCK_RE)."""
        if layer is not None and _EXPERTS_RE.fullmatch(part) is None:
            return self._untangler.hf_name(layer, part, kind)
        m = _BLOCK_RE.fullmatch(gguf_name)
        if m is None:
            return False
        layer, part, kind = m.groups()
        if (e := _EXPERTS_RE.fullmatch(part)) is not None:
            return f"model.layers.{layer}.mlp.experts.{{e}}.{e[1]}_proj.{kind}"
        if part not in _BLOCK_NAMES:
            return False
        return f"model.layers.{layer}.{_BLOCK_NAMES[part]}.{kind}"

    def _mtp_name(self, gguf_name: str) -> str | None | bool:
        """An MTP layer's tensor under the HF checkpoint's name (mtp.fc, mtp.layers.{j}.*), None for the rest."""
        h = _HYBRID_BLOCK_RE.fullmatch(gguf_name) if self._untangler is not None else None
        if h is None or not self._untangler.is_mtp_layer(int(h[1])):
            return None
        layer, part, kind = int(h[1]), h[2], h[3]
        if part.startswith("nextn."):
            return self._untangler.nextn_name(layer, part, kind)
        name = self._block_hf_name(gguf_name, layer, part, kind)
        return name and name.replace(f"model.layers.{layer}.", self._untangler.mtp_prefix(layer), 1)

    def mtp_tensor_names(self) -> list[str]:
        """The HF names iter_weights(mtp=True) gives (experts as one name with {e}), read from the header only."""
        return [name for t in self._reader.tensors if (name := self._mtp_name(t.name))]

    @property
    def num_mtp_layers(self) -> int:
        """MTP layers the file carries (a hybrid converted without --no-mtp): nextn_predict_layers."""
        return int(self.config.get("mtp_num_hidden_layers", 0))

    def loaded_tensor_infos(self) -> list[tuple[str, str, int, int]]:
        """(GGUF name, type name, elements, dims) of every tensor the loader loads (for the planner); not
        the tensors left in the file (mapped_tensor_bytes)."""
        return [
            (t.name, t.tensor_type.name, int(t.n_elements), len(t.shape))
            for t in self._reader.tensors
            if isinstance(self._hf_name(t.name), str) and t.name not in self._mapped_names
        ]

    @property
    def _mapped_names(self) -> tuple[str, ...]:
        return (gguf_qwen4.TABLE,) if self.architecture == gguf_qwen4.ARCH else ()

    @property
    def mapped_tensor_bytes(self) -> int:
        """Bytes of the tensors the model reads by row from the file, never loaded (qwen4exp's n-gram table)."""
        return sum(int(self._tensors[n].n_bytes) for n in self._mapped_names if n in self._tensors)

    @property
    def tensor_names(self) -> list[str]:
        return list(self._tensors)

    def __repr__(self) -> str:
        return (
            f"GGUFCheckpoint({self.path!r}, arch={self.architecture}, "
            f"params={self.num_parameters / 1e6:.1f}M, {self.tensor_bytes / 2**20:.1f} MiB)"
        )


# ---- file opening and integrity ---------------------------------------------------------


class _Truncated(Exception):
    def __init__(self, tensor: str, needed: int, size: int):
        super().__init__(tensor, needed, size)
        self.tensor, self.needed, self.size = tensor, needed, size


class _ArrayParts(Sequence):
    """The parts of one array field (gguf's ReaderField.parts: the key's length, the key, the value
    type, the item type, the count, then one part per scalar or two per string), made on demand
    from the mapped bytes. The stock reader keeps two numpy views per string: for a 248K-token
    vocabulary's tokens and merges that was ~370 MiB of Python objects for the whole load (measured
    on the Qwen3.5 GGUF files of `ember bench hybrid`); this keeps one offset per item."""

    def __init__(self, raw: memoryview, head: list, item_offsets: np.ndarray, dtype: np.dtype | None):
        self.raw, self.head, self.item_offsets, self.dtype = raw, head, item_offsets, dtype
        self.per_item = 1 if dtype is not None else 2

    def __len__(self) -> int:
        return len(self.head) + self.per_item * len(self.item_offsets)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        i = i + len(self) if i < 0 else i
        if not 0 <= i < len(self):
            raise IndexError(i)
        if i < len(self.head):
            return self.head[i]
        item, part = divmod(i - len(self.head), self.per_item)
        offs = int(self.item_offsets[item])
        if self.dtype is not None:
            return np.frombuffer(self.raw, self.dtype, 1, offs)
        if part == 0:
            return np.frombuffer(self.raw, "<u8", 1, offs)
        return np.frombuffer(self.raw, np.uint8, struct.unpack_from("<Q", self.raw, offs)[0], offs + 8)


class _CheckedReader(GGUFReader):
    """GGUFReader that checks every tensor's byte range against the file size before making
    views; the stock reader would fail inside numpy's reshape with no hint of truncation. It also
    reads string and scalar arrays (a tokenizer's tokens, merges, types: ~100k-250k items) in one
    pass over the mapped bytes, keeping their parts lazy (_ArrayParts): the stock reader's four numpy
    calls per string took 2.9 s of the default model's start on Zen3, this ~0.3 s; the fields read the
    same (tests/loader/test_gguf.py)."""

    def _lean_array(self, offs: int, raw_type: int):
        """(size, lazy parts, data indices, types) of a flat array field at offs, or None for the stock path."""
        if raw_type != GGUFValueType.ARRAY or self.byte_order != "I" or sys.byteorder != "little":
            return None
        raw = memoryview(self.data)
        item_type = GGUFValueType(struct.unpack_from("<I", raw, offs)[0])
        scalar = self.gguf_scalar_to_np.get(item_type)
        if item_type != GGUFValueType.STRING and scalar is None:  # nested arrays: the stock path
            return None
        count = struct.unpack_from("<Q", raw, offs + 4)[0]
        head = [np.frombuffer(raw, "<u4", 1, offs), np.frombuffer(raw, "<u8", 1, offs + 4)]
        start = offs + 12
        if scalar is not None:
            dtype = np.dtype(scalar).newbyteorder("<")
            item_offsets = start + dtype.itemsize * np.arange(count, dtype=np.int64)
            end = start + dtype.itemsize * count
        else:
            dtype, item_offsets, end = None, np.empty(count, dtype=np.int64), start
            for i in range(count):
                item_offsets[i] = end
                end += 8 + struct.unpack_from("<Q", raw, end)[0]
        return end - offs, (raw, head, item_offsets, dtype), [GGUFValueType.ARRAY, item_type]

    def _build_fields(self, offs: int, count: int) -> int:
        """gguf's own loop, with flat arrays' parts kept lazy."""
        for _ in range(count):
            orig_offs = offs
            kv_klen, kv_kdata = self._get_str(offs)
            offs += int(kv_klen.nbytes + kv_kdata.nbytes)
            raw_kv_type = self._get(offs, np.uint32)
            offs += int(raw_kv_type.nbytes)
            head = [kv_klen, kv_kdata, raw_kv_type]
            lean = self._lean_array(offs, int(raw_kv_type[0]))
            if lean is None:
                field_size, field_parts, field_idxs, field_types = self._get_field_parts(offs, raw_kv_type[0])
                parts, idxs = head + field_parts, [i + len(head) for i in field_idxs]
            else:
                field_size, (raw, array_head, item_offsets, dtype), field_types = lean
                parts = _ArrayParts(raw, head + array_head, item_offsets, dtype)
                first = len(head) + len(array_head) + (0 if dtype is not None else 1)
                idxs = range(first, first + parts.per_item * len(item_offsets), parts.per_item)
            name = str(bytes(kv_kdata), encoding="utf-8")
            self._push_field(ReaderField(orig_offs, name, parts, idxs, field_types), skip_sum=True)
            offs += field_size
        return offs

    def _build_tensors(self, start_offs: int, fields: list) -> None:
        size = len(self.data)
        for field in fields:
            if len(field.parts) != 6:  # a gguf release with another layout: _open_reader re-checks
                break
            _, name, _, dims, raw_type, offset = field.parts
            block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(int(raw_type[0]))]
            n_bytes = int(np.prod(dims.astype(np.uint64))) * type_size // block
            end = int(start_offs) + int(offset[0]) + n_bytes
            if end > size:
                raise _Truncated(bytes(name).decode("utf-8", "replace"), end, size)
        super()._build_tensors(start_offs, fields)


def _open_reader(path: str) -> GGUFReader:
    if not os.path.exists(path):
        raise ModelLoadError(f"{path} does not exist; check the model path.")
    if os.path.isdir(path):
        raise ModelLoadError(f"{path} is a directory; pass the .gguf file inside it.")
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        what = "is empty" if size == 0 else f"starts with {magic!r}, not b'GGUF'"
        raise ModelLoadError(f"{path} is not a GGUF file: it {what}. Pass a .gguf file or a Hugging Face model folder.")
    try:
        reader = _CheckedReader(path)
    except _Truncated as e:
        raise ModelLoadError(
            f"{path} is truncated: tensor {e.tensor} needs bytes up to {e.needed:,} but the file has "
            f"{e.size:,}; re-download or re-convert it."
        ) from None
    except Exception as e:  # a short or corrupt header fails in many ways inside numpy
        raise ModelLoadError(
            f"{path} is truncated or corrupt: its GGUF header cannot be parsed ({type(e).__name__}: {e}); "
            "re-download or re-convert it."
        ) from e
    for t in reader.tensors:  # the same check through the public fields, whatever the reader did
        if t.data_offset + t.n_bytes > size:
            raise ModelLoadError(
                f"{path} is truncated: tensor {t.name} needs bytes up to {t.data_offset + t.n_bytes:,} "
                f"but the file has {size:,}; re-download or re-convert it."
            )
    return reader


def _f32(value: float) -> float:
    """A float32 metadata value as the decimal it was written from (1e-05, not 9.99999974e-06)."""
    return float(str(np.float32(value)))


def _to_torch(t) -> torch.Tensor:
    """t's values as a torch tensor: a BF16 or F16 matrix in its own dtype (its values exactly, at half
    of float32's bytes: the Qwen3.5-0.8B-shaped bf16 file's 248K-row embedding went through a 970 MiB
    float32 copy that set the load's peak RSS, 3,165 MiB against 2,204 after it), the rest in float32."""
    if len(t.shape) >= 2 and t.tensor_type in (GGMLQuantizationType.BF16, GGMLQuantizationType.F16):
        raw = _copy_releasing(t.data)  # BF16: uint8 bytes, two per value
        return raw.view(torch.bfloat16) if t.tensor_type == GGMLQuantizationType.BF16 else raw
    try:
        arr = dequantize(t.data, t.tensor_type)
    except NotImplementedError:
        raise UnsupportedModelError(
            f"tensor {t.name} is stored as {t.tensor_type.name}, which the gguf package cannot dequantize."
        ) from None
    arr = np.asarray(arr, dtype=np.float32)
    if not arr.flags.writeable:  # F32 tensors come back as views of the read-only mmap
        arr = arr.copy()
    release_pages(t.data)  # copied: the map's pages need not stay resident beside the copy
    return torch.from_numpy(arr)


COPY_CHUNK_BYTES = 64 << 20
_TORCH_DTYPES = {np.dtype(np.uint8): torch.uint8, np.dtype(np.float16): torch.float16}  # BF16 comes as bytes


def _copy_releasing(data: np.ndarray) -> torch.Tensor:
    """A copy of `data` (a view of the file's map) in torch's memory, made COPY_CHUNK_BYTES at a time, each
    chunk's map pages dropped from the resident set once copied: the map and the copy are never both
    resident whole (the bf16 hybrid's 485 MiB embedding held both, which set a load's peak RSS). torch's,
    not numpy's: numpy advises huge pages for its large arrays, and the bf16 hybrid's kept ~200 MiB more
    resident than the same bytes in torch's."""
    out = torch.empty(data.shape, dtype=_TORCH_DTYPES[data.dtype])
    dst, step = out.numpy(), max(1, COPY_CHUNK_BYTES // max(1, data[:1].nbytes))
    for i in range(0, len(data), step):
        dst[i : i + step] = data[i : i + step]
        release_pages(data[i : i + step])
    return out


def _float_view(t) -> torch.Tensor:
    """A BF16 / F16 / F32 matrix as a view of the file's map in its own dtype (nothing read)."""
    view = map_view(t.data)
    return view.view(torch.bfloat16) if t.tensor_type == GGMLQuantizationType.BF16 else view


def _is_quantized_matrix(t) -> bool:
    return t.tensor_type not in FLOAT_TYPES and len(t.shape) >= 2


def _as_blocks(t) -> GGUFTensor:
    """The tensor's raw blocks, uint8 [all rows, bytes per row], as a view of the map; 3-D
    experts stack their rows ([E * out, in])."""
    cols = int(t.shape[0])  # ne[0] is the row length
    data = t.data.reshape(-1, t.data.shape[-1])
    return GGUFTensor(t.tensor_type, data, (data.shape[0], cols))


def _unpermute_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (formats.md 3.3): GGUF row (h, 2i+j) holds HF row
    (h, j*hd/2+i). Works for weights [rows, in] and biases [rows]."""
    rest = w.shape[1:]
    return w.reshape(heads, -1, 2, *rest).transpose(1, 2).reshape(w.shape).contiguous()


def _llama3_scaling_from_divisors(div: np.ndarray, theta: float, dim: int, path: str) -> dict[str, Any] | None:
    """Recover HF llama3 rope_scaling from llama.cpp's rope_freqs divisors.

    Divisors are 1 (short wavelengths), `factor` (long ones) and, in between,
    1/((1-s)/factor + s) with s = (L/wavelen - low)/(high - low). s is linear in 1/wavelen with
    slope a = L/(high-low) and intercept b = -low/(high-low); every (L, low, high) with the same
    a, b gives the same frequencies, so low = 1 (what Llama 3.x uses) pins them down.
    """
    factor = float(div.max())
    if factor <= 1.0 + 1e-6:
        return None
    wavelen = 2 * math.pi * theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    mid = (div > 1.0 + 1e-4) & (div < factor * (1 - 1e-4))
    if mid.sum() < 2:
        raise UnsupportedModelError(
            f"{path} has a rope_freqs tensor whose llama3 RoPE scaling cannot be recovered "
            "(fewer than two blended frequencies)."
        )
    s = (1 / div[mid] - 1 / factor) / (1 - 1 / factor)
    a, b = np.polyfit(1 / wavelen[mid], s, 1)
    high = 1 - 1 / b
    orig = -a / b
    scaling = {
        "rope_type": "llama3",
        "factor": round(factor, 4),
        "low_freq_factor": 1.0,
        "high_freq_factor": round(float(high), 4),
        "original_max_position_embeddings": int(round(orig)),
    }
    if not np.allclose(_llama3_divisors(scaling, wavelen), div, rtol=1e-3):
        raise UnsupportedModelError(f"{path} has a rope_freqs tensor that is not llama3 RoPE scaling.")
    return scaling


def _llama3_divisors(s: dict[str, Any], wavelen: np.ndarray) -> np.ndarray:
    """The divisors llama.cpp's converter writes for HF llama3 parameters `s`."""
    f, lo, hi, orig = s["factor"], s["low_freq_factor"], s["high_freq_factor"], s["original_max_position_embeddings"]
    smooth = (orig / wavelen - lo) / (hi - lo)
    blended = 1 / ((1 - smooth) / f + smooth)
    return np.where(wavelen < orig / hi, 1.0, np.where(wavelen > orig / lo, f, blended))


# ---- tokenizer builders --------------------------------------------------------------------


@functools.cache
def _byte_alphabet() -> tuple[dict[int, str], frozenset[str]]:
    """GPT-2's byte -> printable character table: printable Latin-1 bytes stand for
    themselves, the other 68 bytes take code points from 256 up, in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table, frozenset(table.values())


# Pre-tokenizer split patterns by tokenizer.ggml.pre. Other values (default, gpt2, smollm, ...)
# get GPT-2's own pattern, as transformers does when it loads a GGUF.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "dbrx", "falcon3"), _LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), _QWEN2_SPLIT),
}

# Values whose split pattern is GPT-2's own (or close enough that transformers uses it too).
_GPT2_SPLIT_PRES = {"default", "gpt2", "gpt-2", "smollm"}


def _byte_level_bpe(tokens: list[str], merges: list[str], pre: str):
    table, alphabet = _byte_alphabet()

    def spelled(tok: str) -> str:
        # Tokens outside the byte alphabet (rare, mostly added tokens) are stored as raw text
        return tok if set(tok) <= alphabet else "".join(table[b] for b in tok.encode("utf-8"))

    vocab = {spelled(t): i for i, t in enumerate(tokens)}
    tok = HFTokenizer(
        models.BPE(
            vocab=vocab,
            merges=[tuple(m.split(" ", 1)) for m in merges],
            dropout=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
        )
    )
    if pre in _SPLITS:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    else:
        if pre not in _GPT2_SPLIT_PRES:
            log.warning(
                "GGUF tokenizer pre-tokenizer %r is not one ember knows; splitting text with "
                "GPT-2's pattern, which may tokenize differently from llama.cpp",
                pre,
            )
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok, lambda t: set(t) <= alphabet and t in vocab


def _sentencepiece_bpe(tokens: list[str], scores: list[float], add_space_prefix: bool, unk_id: int | None):
    """SentencePiece BPE (Llama 2 style): '▁' for spaces, <0xNN> byte fallback, and merges
    recovered from the scores (a piece's score ranks the merge that makes it)."""
    vocab = {t: i for i, t in enumerate(tokens)}
    candidates = []
    for piece, score in zip(tokens, scores):
        splits = [(piece[:k], piece[k:]) for k in range(1, len(piece))]
        splits = [p for p in splits if p[0] in vocab and p[1] in vocab]
        splits.sort(key=lambda p: (vocab[p[0]], vocab[p[1]]))
        candidates += [(score, len(l), len(r), l, r) for l, r in splits]
    # Stable sort, best score first; ties prefer longer pieces
    candidates.sort(key=lambda c: c[:3], reverse=True)
    tok = HFTokenizer(
        models.BPE(
            vocab=vocab,
            merges=[(c[3], c[4]) for c in candidates],
            fuse_unk=True,
            byte_fallback=True,
            dropout=None,
            unk_token=tokens[unk_id] if unk_id is not None and 0 <= unk_id < len(tokens) else None,
        )
    )
    tok.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if add_space_prefix else "never", split=False
    )
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    tok.decoder = decoders.Sequence(steps)
    return tok, lambda t: t in vocab
