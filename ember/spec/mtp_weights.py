"""Find and load MTP weights straight from safetensors (transformers drops them on load).

The weights live either in the main checkpoint folder or in a separate folder
(`--speculative-model DIR`, with its own config.json). Three published layouts, detected from the
tensor names (formats.md §4):

- "deepseek" (DeepSeek-V3/R1, GLM-4.5): any `model.layers.{N}.{enorm,hnorm,eh_proj,shared_head}.*`.
  Layer j is `model.layers.{num_hidden_layers + j}.*`, num_hidden_layers being the model's (a
  separate folder that numbers its layers from lower: j = N - smallest N). Per layer: enorm, hnorm, eh_proj, shared_head.norm, an
  optional shared_head.head (then used instead of the main LM head), an optional embed_tokens
  copy (ignored: the embedding is shared) and a normal block under the same prefix.
  Layer count: config `num_nextn_predict_layers`.
  A reduced draft vocabulary (FR-Spec / EAGLE-3 style; `ember train-mtp` writes one) is the tensor
  `shared_head.draft_vocab` (int64 [V_draft]: the token id of each head row, distinct, < vocab_size)
  with `shared_head.head.weight` [V_draft, H]; without that head, the main LM head's rows at those
  ids are used. The draft then proposes only tokens in draft_vocab (MTPModule.compute_draft_logits).
- "mimo" (MiMo-7B): any `model.mtp_layers.{j}.*`: token_layernorm, hidden_layernorm, input_proj,
  final_layernorm plus a block under the same prefix; hidden state first in the concat.
  Layer count: `num_nextn_predict_layers`.
- "qwen3_next" (Qwen3-Next, Qwen3.5): any `mtp.*`: mtp.fc, mtp.pre_fc_norm_embedding,
  mtp.pre_fc_norm_hidden, mtp.norm (shared by every block) and blocks `mtp.layers.{j}.*`; every
  norm zero-centred. Layer count: `mtp_num_hidden_layers` (else `num_nextn_predict_layers`).
  A GGUF file of these models written by llama.cpp's converter carries them too (blk.N.nextn.* and
  blocks past num_hidden_layers, unless converted with --no-mtp); the loader reads them back under
  these names (ember.loader.gguf_hybrid), so they load the same way.

Block names go through the main model's own routing (LlamaForCausalLM.route_weight: q/k/v into
qkv_proj, gate/up into gate_up_proj, MoE experts into the stacked experts, FP8 KV scales into the
attention), so the block loads exactly like a main layer.

A separate folder must say, in its config.json `architectures`, either the main model's own
architecture (a full checkpoint of this model that carries its MTP layers) or ember's MTP class
for it, `<Stem>MTP` with Stem the architecture without "ForCausalLM" (Qwen3MTP, Qwen3MoeMTP,
Qwen2MTP, LlamaMTP; what `ember train-mtp` writes). Other MTP classes (DeepSeekMTPModel,
MiMoMTPModel, Glm4MoeMTPModel, Qwen3NextMTP, ...) belong to model families whose blocks ember
does not run, so they are refused. Missing config keys (heads, intermediate size, rope ...) are
taken from the main model's config, so a small MTP config need only state what differs; its
vocab_size and hidden_size, when given, must equal the model's.

A model whose MTP layer is its own kind (qwen4_exp: build_mtp) reads a separate folder's mtp.* tensors
(what `ember train-mtp` writes for it, config.json naming the model's architecture) whether the model is
a Hugging Face folder or a GGUF file, which carries none (llama.cpp's converter writes no qwen4exp MTP
layer). That layer is built from the model's config, so a folder whose config.json sizes it otherwise
(the model's shape_of) is refused, naming the values.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch
from tqdm import tqdm

from ember.config.model_config import ModelConfig
from ember.errors import ModelLoadError
from ember.loader import weights as weights_io
from ember.models.llama import load_routed
from ember.models.mtp import MTPModule

log = logging.getLogger(__name__)

LAYOUT_NAMES = {"deepseek": "DeepSeek-V3/GLM", "mimo": "MiMo", "qwen3_next": "Qwen3-Next/Qwen3.5"}

# checkpoint sub-name (after the layer prefix) -> MTPLayer module
SPECIAL = {
    "deepseek": {
        "enorm": "enorm",
        "hnorm": "hnorm",
        "eh_proj": "eh_proj",
        "shared_head.norm": "final_norm",
        "shared_head.head": "head",
    },
    "mimo": {
        "token_layernorm": "enorm",
        "hidden_layernorm": "hnorm",
        "input_proj": "eh_proj",
        "final_layernorm": "final_norm",
    },
    "qwen3_next": {
        "pre_fc_norm_embedding": "enorm",
        "pre_fc_norm_hidden": "hnorm",
        "fc": "eh_proj",
        "norm": "final_norm",
    },
}
COUNT_KEYS = {
    "deepseek": ("num_nextn_predict_layers",),
    "mimo": ("num_nextn_predict_layers",),
    "qwen3_next": ("mtp_num_hidden_layers", "num_nextn_predict_layers"),
}
LOOKED_FOR = (
    "model.layers.{N}.enorm / hnorm / eh_proj / shared_head.norm with N >= num_hidden_layers (DeepSeek-V3/GLM)",
    "model.mtp_layers.{j}.token_layernorm / hidden_layernorm / input_proj / final_layernorm (MiMo)",
    "mtp.fc / mtp.pre_fc_norm_embedding / mtp.pre_fc_norm_hidden / mtp.norm / mtp.layers.{j}.* (Qwen3-Next/Qwen3.5)",
)
DRAFT_VOCAB = "shared_head.draft_vocab"  # reduced draft vocabulary (DeepSeek layout): int64 [V_draft]
_DEEPSEEK = re.compile(r"^model\.layers\.(\d+)\.(?:enorm|hnorm|eh_proj|shared_head)\.")
_MIMO = re.compile(r"^model\.mtp_layers\.(\d+)\.")
_QWEN3_NEXT_BLOCK = re.compile(r"^mtp\.layers\.(\d+)\.")
# ember param (fused) -> checkpoint part, for naming what a checkpoint lacks
_UNFUSE = {
    "qkv_proj": {"q": "q_proj", "k": "k_proj", "v": "v_proj"},
    "gate_up_proj": {"gate": "gate_proj", "up": "up_proj"},
}


def accepted_architectures(main_architecture: str) -> list[str]:
    """What a separate MTP folder's config.json `architectures` may say for this model."""
    stem = main_architecture.removesuffix("ForCausalLM")
    return [f"{stem}MTP", main_architecture]


@dataclass
class MTPCheckpoint:
    """Where the MTP layers of a model are and how they are named."""

    folder: str
    layout: str  # "deepseek" | "mimo" | "qwen3_next"
    num_layers: int
    prefixes: list[str]  # checkpoint prefix of each layer's block (and, but for qwen3_next, of its norms/proj)
    tensors: dict[str, str]  # every checkpoint tensor name of the MTP layers -> its file
    own_heads: list[bool]
    block_cfg: ModelConfig
    separate: bool
    draft_vocab_sizes: list[int | None] = field(default_factory=list)  # per layer (DeepSeek layout only)
    ignored: list[str] = field(default_factory=list)
    gguf: bool = False  # folder is a GGUF file (tensors name its HF names, experts as one {e} name)

    def module_name(self, name: str) -> str | None:
        """checkpoint name -> MTPModule parameter name (before fusing), or None if unused."""
        special = SPECIAL[self.layout]
        if self.layout == "qwen3_next":
            m = _QWEN3_NEXT_BLOCK.match(name)
            if m:
                j = int(m[1])
                return f"layers.{j}.block.{name[m.end() :]}" if j < self.num_layers else None
            rest = name.removeprefix("mtp.")
            for ck, mod in special.items():
                if rest.startswith(ck + "."):
                    return f"layers.0.{mod}.{rest[len(ck) + 1 :]}"
            return None  # e.g. mtp.embed_tokens (dedicated embeddings are refused earlier)
        for j, prefix in enumerate(self.prefixes):
            if name.startswith(prefix):
                rest = name[len(prefix) :]
                for ck, mod in special.items():
                    if rest.startswith(ck + "."):
                        return f"layers.{j}.{mod}.{rest[len(ck) + 1 :]}"
                if rest.startswith("embed_tokens."):
                    return None  # DeepSeek keeps a copy of the shared embedding in each MTP layer
                if rest == DRAFT_VOCAB and self.layout == "deepseek":
                    return f"layers.{j}.draft_vocab"
                return f"layers.{j}.block.{rest}"
        return None

    def checkpoint_name(self, param: str, shard=None) -> str:
        """MTPModule parameter (and fused shard) -> the checkpoint tensor that should fill it."""
        _, j, rest = param.split(".", 2)
        if rest.startswith("block."):
            ck = self.prefixes[int(j)] + rest.removeprefix("block.")
        else:
            mod, _, local = rest.partition(".")
            ck_mod = {v: k for k, v in SPECIAL[self.layout].items()}[mod]
            ck = ("mtp." if self.layout == "qwen3_next" else self.prefixes[int(j)]) + f"{ck_mod}.{local}"
        for fused, parts in _UNFUSE.items():
            if f".{fused}." in ck and shard in parts:
                return ck.replace(f".{fused}.", f".{parts[shard]}.")
        if ".mlp.experts." in ck:  # stacked experts: w13 shard (e, "gate"|"up"), w2 shard e
            head = ck.rsplit(".experts.", 1)[0] + ".experts"
            if isinstance(shard, tuple):
                return f"{head}.{shard[0]}.{shard[1]}_proj.weight"
            if shard is not None:
                return f"{head}.{shard}.down_proj.weight"
        return ck if shard is None else f"{ck} (shard {shard!r})"


def _same_path(a: str, b: str) -> bool:
    return os.path.realpath(os.path.expanduser(a)) == os.path.realpath(os.path.expanduser(b))


def _read_separate_config(folder: str, main_cfg: ModelConfig) -> dict:
    if not os.path.isdir(folder):
        raise ModelLoadError(
            f"--speculative-model {folder!r} is not a folder; give the folder that holds the MTP "
            "weights (*.safetensors) and their config.json"
        )
    path = os.path.join(folder, "config.json")
    accepted = accepted_architectures(main_cfg.architecture)
    if not os.path.exists(path):
        raise ModelLoadError(
            f"{folder} has no config.json; an MTP folder needs one with architectures "
            f"[{accepted[0]!r}], vocab_size and hidden_size of the model it drafts for"
        )
    try:
        with open(path) as f:
            raw = json.load(f)
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{path} is not valid JSON: {e}") from None
    archs = raw.get("architectures") or []
    if not any(a in accepted for a in archs):
        raise ModelLoadError(
            f"{path} says architectures {archs}, which is not an MTP model for this {main_cfg.architecture} model; "
            f"ember accepts {' or '.join(accepted)} there. If these are MTP weights trained for this model, set "
            f'"architectures": ["{accepted[0]}"]; a plain draft model goes with speculative method "draft", not "mtp"'
        )
    for key, want in (("vocab_size", main_cfg.vocab_size), ("hidden_size", main_cfg.hidden_size)):
        got = raw.get(key)
        if got is not None and int(got) != want:
            raise ModelLoadError(
                f"the MTP weights in {folder} have {key} {got} but the model has {want}; MTP layers must be made for "
                "this model (same tokenizer and width): use its own MTP weights, or train some with "
                "`ember train-mtp MODEL --out DIR`"
            )
    return raw


def _tensor_files(folder: str) -> dict[str, str]:
    """checkpoint tensor name -> file, from the safetensors headers (no tensor is read)."""
    out = {}
    for path in weights_io.safetensors_files(folder):
        with weights_io._open(path) as h:
            for name in h.keys():
                out[name] = path
    return out


def _no_weights(where: str, hint: str) -> ModelLoadError:
    return ModelLoadError(
        f"MTP speculative decoding was asked for, but {where} holds no MTP weights; looked for "
        + "; ".join(LOOKED_FOR)
        + f". {hint}"
    )


def _layer_count(raw: dict, layout: str) -> int | None:
    for key in COUNT_KEYS[layout]:
        if raw.get(key):
            return int(raw[key])
    return None


def find_mtp_weights(main_cfg: ModelConfig, model_path: str, speculative_model: str | None = None) -> MTPCheckpoint:
    """Locate the MTP layers (main folder, or speculative_model when it is another folder) and
    check them against the model; raises ModelLoadError saying what to change."""
    separate = speculative_model is not None and not _same_path(speculative_model, model_path)
    folder = speculative_model if separate else model_path
    hint = (
        "Give a folder with MTP weights made for this model with --speculative-model DIR (for example one "
        "written by `ember train-mtp MODEL --out DIR`), or turn MTP off"
    )
    if separate:
        raw = _read_separate_config(folder, main_cfg)
        merged = {**main_cfg.raw, **raw, "architectures": [main_cfg.architecture]}
        block_cfg = ModelConfig.from_dict(merged)
    else:
        if os.path.isfile(model_path) and not model_path.endswith(".safetensors"):
            return _find_gguf_mtp(main_cfg, model_path)
        raw, block_cfg = main_cfg.raw, main_cfg
    names = _tensor_files(folder)
    layout, numbers = _detect_layout(folder, names, main_cfg, separate, hint)
    present, prefix_of = _present_layers(folder, names, layout, numbers, main_cfg, raw)
    n = _layers_to_use(folder, layout, raw, present, prefix_of)
    prefixes = [present[j] for j in range(n)]
    mine = _layer_tensor_names(names, layout, prefixes, n)
    own_heads = [layout == "deepseek" and f"{p}shared_head.head.weight" in names for p in prefixes]
    draft_vocab_sizes = [
        _draft_vocab_size(folder, names, p, main_cfg.vocab_size) if layout == "deepseek" else None for p in prefixes
    ]
    log.info(
        "MTP: %d layer(s) in %s layout from %s%s",
        n,
        LAYOUT_NAMES[layout],
        folder,
        " (separate folder)" if separate else "",
    )
    return MTPCheckpoint(
        folder, layout, n, prefixes, {k: names[k] for k in mine}, own_heads, block_cfg, separate, draft_vocab_sizes
    )


def _find_gguf_mtp(main_cfg: ModelConfig, path: str) -> MTPCheckpoint:
    """The MTP layers of a GGUF file: a Qwen3.5 / Qwen3-Next converted by llama.cpp's converter keeps them
    (blk.N.nextn.* and the blocks past num_hidden_layers), unless it ran with --no-mtp."""
    from ember.loader.gguf import GGUFCheckpoint

    names = dict.fromkeys(GGUFCheckpoint(path).mtp_tensor_names(), path)
    if not names:
        raise ModelLoadError(
            f"MTP speculative decoding was asked for, but {path} holds no MTP layer (no blk.N.nextn.* tensors "
            "and no nextn_predict_layers). llama.cpp's converter keeps a Qwen3.5 / Qwen3-Next model's MTP layer "
            "unless run with --no-mtp, and other architectures have none in GGUF: re-convert the model without "
            "--no-mtp, serve its Hugging Face folder, or turn MTP off (n-gram speculation needs no weights)"
        )
    layout = "qwen3_next"
    present, prefix_of = _present_layers(path, names, layout, [], main_cfg, main_cfg.raw)
    n = _layers_to_use(path, layout, main_cfg.raw, present, prefix_of)
    prefixes = [present[j] for j in range(n)]
    mine = _layer_tensor_names(names, layout, prefixes, n)
    log.info("MTP: %d layer(s) in %s layout from the GGUF file %s", n, LAYOUT_NAMES[layout], path)
    return MTPCheckpoint(path, layout, n, prefixes, {k: path for k in mine}, [False] * n, main_cfg, False, gguf=True)


def _detect_layout(
    folder: str, names: dict[str, str], main_cfg: ModelConfig, separate: bool, hint: str
) -> tuple[str, list[int]]:
    """The one layout the folder's MTP tensors use, and the layer numbers its names carry (DeepSeek and
    MiMo; Qwen3-Next's are read by _present_layers). Raises when there are none, or two layouts."""
    deepseek = sorted({int(m[1]) for n in names if (m := _DEEPSEEK.match(n))})
    mimo = sorted({int(m[1]) for n in names if (m := _MIMO.match(n))})
    qnext = any(n.startswith("mtp.") for n in names)
    if not separate:  # in the main checkpoint, MTP layers come after the decoder's
        deepseek = [n for n in deepseek if n >= main_cfg.num_layers]
    found = [k for k, hit in (("deepseek", deepseek), ("mimo", mimo), ("qwen3_next", qnext)) if hit]
    if not found:
        if separate:
            hint = (
                'If this folder is a small draft model rather than MTP layers, use speculative method "draft"; '
                "otherwise give a folder with MTP weights made for this model"
            )
        raise _no_weights(folder, hint)
    if len(found) > 1:
        layouts = ", ".join(LAYOUT_NAMES[k] for k in found)
        raise ModelLoadError(
            f"{folder} holds MTP tensors in more than one layout ({layouts}); keep one set of MTP weights per folder"
        )
    layout = found[0]
    return layout, {"deepseek": deepseek, "mimo": mimo, "qwen3_next": []}[layout]


def _present_layers(
    folder: str, names: dict[str, str], layout: str, numbers: list[int], main_cfg: ModelConfig, raw: dict
) -> tuple[dict[int, str], Callable[[int], str]]:
    """MTP layer index (0 = the first MTP layer) -> the name prefix of its tensors, for the layers present;
    and the prefix any index would have (to name the missing ones)."""
    if layout == "deepseek":  # numbered after the decoder's layers, in the decoder's namespace
        base = main_cfg.num_layers if all(n >= main_cfg.num_layers for n in numbers) else numbers[0]
        if base != main_cfg.num_layers:
            log.info(
                "MTP layers in %s are numbered from %d (the model has %d layers)", folder, base, main_cfg.num_layers
            )
        present = {n - base: f"model.layers.{n}." for n in numbers}
        return present, lambda j: f"model.layers.{base + j}."
    if layout == "mimo":
        return {j: f"model.mtp_layers.{j}." for j in numbers}, lambda j: f"model.mtp_layers.{j}."
    if raw.get("mtp_use_dedicated_embeddings"):
        raise ModelLoadError(
            f"{folder}: config mtp_use_dedicated_embeddings=true (an MTP embedding of its own) is "
            "not supported; ember's MTP layers share the model's embedding"
        )
    present = {int(m[1]): f"mtp.layers.{m[1]}." for n in names if (m := _QWEN3_NEXT_BLOCK.match(n))}
    return present, lambda j: f"mtp.layers.{j}."


def _layers_to_use(
    folder: str, layout: str, raw: dict, present: dict[int, str], prefix_of: Callable[[int], str]
) -> int:
    """How many MTP layers run: the config's count, else all present; raises when one of them is missing."""
    count = _layer_count(raw, layout)
    n = count if count is not None else (max(present) + 1 if present else 1)
    lacking = [j for j in range(n) if j not in present]
    if lacking:
        said = (
            f"config says {COUNT_KEYS[layout][0]}={count}"
            if count is not None
            else f"{len(present)} MTP layer(s) found"
        )
        raise ModelLoadError(
            f"{folder}: {said}, but MTP layer(s) {lacking} are missing (no tensors named "
            f"{', '.join(prefix_of(j) + '*' for j in lacking)}, {LAYOUT_NAMES[layout]} layout); give the complete "
            f"MTP weights, or set {COUNT_KEYS[layout][0]} to the number of layers present"
        )
    if max(present) >= n:
        log.info("using %d of the %d MTP layers in %s (%s=%s)", n, len(present), folder, COUNT_KEYS[layout][0], count)
    return n


def _layer_tensor_names(names: dict[str, str], layout: str, prefixes: list[str], n: int) -> list[str]:
    """The checkpoint names of the n layers' tensors (Qwen3-Next's shared mtp.* ones included)."""
    if layout == "qwen3_next":
        return [k for k in names if k.startswith("mtp.") and not ((m := _QWEN3_NEXT_BLOCK.match(k)) and int(m[1]) >= n)]
    return [k for k in names if any(k.startswith(p) for p in prefixes)]


def _draft_vocab_size(folder: str, names: dict[str, str], prefix: str, vocab_size: int) -> int | None:
    """Rows of the layer's reduced draft vocabulary (from the safetensors header), or None."""
    name = prefix + DRAFT_VOCAB
    if name not in names:
        return None
    with weights_io._open(names[name]) as h:
        shape = h.get_slice(name).get_shape()
        head = prefix + "shared_head.head.weight"
        head_shape = h.get_slice(head).get_shape() if names.get(head) == names[name] else None
    if head_shape is None and head in names:
        with weights_io._open(names[head]) as h:
            head_shape = h.get_slice(head).get_shape()
    if len(shape) != 1 or not 0 < shape[0] <= vocab_size:
        raise ModelLoadError(
            f"{name} in {folder} has shape {list(shape)}; a draft vocabulary is one list of 1.."
            f"{vocab_size} token ids (int64)"
        )
    if head_shape is not None and head_shape[0] != shape[0]:
        raise ModelLoadError(
            f"{name} in {folder} lists {shape[0]} token ids but {head} has {head_shape[0]} rows; "
            "the reduced head needs one row per draft-vocabulary token"
        )
    return int(shape[0])


def iter_mtp_tensors(ckpt: MTPCheckpoint, progress: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint name, CPU tensor) for the MTP tensors only: each file opened once, nothing else read."""
    if ckpt.gguf:
        yield from _iter_gguf_mtp_tensors(ckpt, progress)
        return
    from ember.quant.fp8 import dequantized_stream  # an FP8 checkpoint's MTP layers run dense, as a GGUF's do

    yield from dequantized_stream(ckpt.folder, _iter_safetensors_mtp_tensors(ckpt, progress))


def _iter_safetensors_mtp_tensors(ckpt: MTPCheckpoint, progress: bool) -> Iterator[tuple[str, torch.Tensor]]:
    by_file: dict[str, list[str]] = defaultdict(list)
    for name, path in ckpt.tensors.items():
        by_file[path].append(name)
    with tqdm(
        total=len(ckpt.tensors), desc="Loading MTP weights", unit="tensor", disable=None if progress else True
    ) as bar:
        for path, names in by_file.items():
            with weights_io._open(path) as h:
                for name in names:
                    yield name, h.get_tensor(name)
                    bar.update(1)


def _iter_gguf_mtp_tensors(ckpt: MTPCheckpoint, progress: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """The GGUF file's MTP tensors of the layers in use, dequantized to float32 (MTP layers run dense)."""
    from ember.loader.gguf import GGUFCheckpoint

    with tqdm(desc="Loading MTP weights", unit="tensor", disable=None if progress else True) as bar:
        for name, tensor in GGUFCheckpoint(ckpt.folder).iter_weights(mtp=True):
            if (m := _QWEN3_NEXT_BLOCK.match(name)) is None or int(m[1]) < ckpt.num_layers:
                yield name, tensor
            bar.update(1)


@torch.no_grad()
def load_mtp_weights(mtp: MTPModule, ckpt: MTPCheckpoint, progress: bool = True) -> None:
    """Fill mtp from the checkpoint; ModelLoadError names (in checkpoint terms) every missing piece."""
    params = dict(mtp.named_parameters())
    modules = dict(mtp.named_modules())
    got: dict[str, set] = defaultdict(set)
    ignored = []
    cfg = ckpt.block_cfg
    for name, tensor in iter_mtp_tensors(ckpt, progress):
        local_name = ckpt.module_name(name)
        if local_name is not None and local_name.endswith(".draft_vocab"):
            _load_draft_vocab(
                modules[local_name.rpartition(".")[0]], name, tensor, ckpt.folder, mtp._lm_head.vocab_size
            )
            continue
        route = mtp.route_weight(local_name, params, modules) if local_name is not None else None
        if route is None:
            ignored.append(name)
            continue
        if (
            ckpt.layout == "qwen3_next"
            and not cfg.is_hybrid
            and name.endswith("self_attn.q_proj.weight")
            and tensor.shape[0] == 2 * cfg.num_heads * cfg.head_dim
        ):
            raise ModelLoadError(
                f"{name} in {ckpt.folder} has {tensor.shape[0]} rows, twice num_heads * head_dim: a Qwen3-Next gated "
                "attention block, which ember's MTP layer (a Qwen3-style block) does not run; use MTP weights whose "
                "block matches this model's decoder layers"
            )
        try:
            key, shards = load_routed(modules, route, tensor)
        except ModelLoadError as e:
            raise ModelLoadError(f"MTP tensor {name} in {ckpt.folder}: {e}") from None
        got[key] |= shards
    ckpt.ignored = ignored
    if ignored:
        log.info("MTP: ignored %d tensors ember does not use (e.g. %s)", len(ignored), ignored[0])
    for j, layer in enumerate(mtp.layers):  # a draft vocabulary without its own head: the main head's rows
        if layer.draft_vocab is not None and f"layers.{j}.head.weight" not in got:
            layer.head.weight.copy_(main_head_rows(mtp, layer.draft_vocab))
            got[f"layers.{j}.head.weight"] = {None}
    missing = []
    for pname in params:
        mod_path, _, local = pname.rpartition(".")
        module = modules[mod_path]
        want = module.expected_shards(local) if hasattr(module, "expected_shards") else {None}
        for shard in sorted(want - got.get(pname, set()), key=str):
            missing.append(ckpt.checkpoint_name(pname, shard))
    if missing:
        shown = ", ".join(missing[:12]) + (f", ... ({len(missing)} in all)" if len(missing) > 12 else "")
        unused = f" (present but not used: {', '.join(ignored[:6])})" if ignored else ""
        raise ModelLoadError(
            f"the MTP layer(s) in {ckpt.folder} ({LAYOUT_NAMES[ckpt.layout]} layout) lack {shown}{unused}. An MTP "
            "layer needs its two input norms, its projection, its final norm and a whole decoder block shaped like "
            "the model's layers; give the complete MTP weights"
        )


def _load_draft_vocab(layer, name: str, tensor: torch.Tensor, folder: str, vocab_size: int) -> None:
    if tensor.is_floating_point() or tensor.is_complex() or tensor.dim() != 1:
        raise ModelLoadError(
            f"{name} in {folder} is {tensor.dtype} with shape {list(tensor.shape)}; a draft "
            "vocabulary is a 1-D integer tensor of token ids"
        )
    ids = tensor.to(torch.int64)
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise ModelLoadError(
            f"{name} in {folder} holds token ids outside 0..{vocab_size - 1}; it was not made "
            "for this model's vocabulary"
        )
    if ids.unique().numel() != ids.numel():
        raise ModelLoadError(f"{name} in {folder} repeats token ids; each draft-vocabulary token must appear once")
    layer.draft_vocab = ids.to(layer.draft_vocab.device)


@torch.no_grad()
def main_head_rows(mtp: MTPModule, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of the main model's LM head as a dense [len(ids), H] tensor (a packed tied head is
    read through its embedding lookup, which dequantizes just those rows)."""
    head = mtp._lm_head
    if head.quant_method is None:
        return head.weight.index_select(0, ids.to(head.weight.device))
    if head.tied:
        return mtp._embed(ids)
    eye = torch.eye(mtp.cfg.hidden_size, dtype=mtp.dtype, device=mtp.device)
    return head(eye)[:, ids].T.to(mtp.dtype)  # the head applied to unit vectors: its rows, transposed


def export_deepseek_tensors(mtp: MTPModule, num_hidden_layers: int) -> dict[str, torch.Tensor]:
    """An MTPModule's weights under DeepSeek-V3 checkpoint names (`model.layers.{num_hidden_layers + j}.*`,
    q/k/v and gate/up unfused), what load_mtp reads back; CPU tensors in the module's dtype.
    Dense blocks only (a MoE block's experts are not exported)."""
    if mtp.layout != "deepseek":
        raise ValueError(f"export_deepseek_tensors takes a DeepSeek-layout MTP module, not {mtp.layout!r}")
    out: dict[str, torch.Tensor] = {}
    mods = dict(mtp.named_modules())
    for pname, p in mtp.named_parameters():
        _, j, rest = pname.split(".", 2)
        prefix = f"model.layers.{num_hidden_layers + int(j)}."
        mod_path, _, local = pname.rpartition(".")
        module = mods[mod_path]
        if rest.startswith("block."):
            base = prefix + rest.removeprefix("block.")
            if ".experts." in base:
                raise ValueError(f"cannot export {pname}: only dense MTP blocks are exported")
            if hasattr(module, "shard_ids") and len(module.shard_ids) > 1:
                for sid in module.shard_ids:
                    part = _UNFUSE["qkv_proj" if ".qkv_proj." in base else "gate_up_proj"][sid]
                    name = base.replace(".qkv_proj.", f".{part}.").replace(".gate_up_proj.", f".{part}.")
                    out[name] = module.shard_view(p, sid).detach().cpu().clone()
                continue
            out[base] = p.detach().cpu().clone()
        else:
            mod, _, tail = rest.partition(".")
            ck = {v: k for k, v in SPECIAL["deepseek"].items()}[mod]
            out[f"{prefix}{ck}.{tail}"] = p.detach().cpu().clone()
    for j, layer in enumerate(mtp.layers):
        if layer.draft_vocab is not None:
            out[f"model.layers.{num_hidden_layers + j}.{DRAFT_VOCAB}"] = layer.draft_vocab.detach().cpu().clone()
    return out


def _check_made_for(theirs: dict[str, int], ours: dict[str, int], folder: str) -> None:
    """A separate folder's MTP layer of a model's own kind is built from the model's config: refuse one whose
    config.json sizes it otherwise (made for another model), naming the values, before any tensor is read."""
    differ = [f"{k} {theirs[k]} (the model: {ours[k]})" for k in ours if theirs.get(k) != ours[k]]
    if differ:
        raise ModelLoadError(
            f"the MTP layer in {folder} was made for another model: its config.json says {', '.join(differ)}. "
            "An MTP layer must match the model it drafts for; give one made for this model, e.g. written by "
            "`ember train-mtp MODEL --out DIR`"
        )


def load_mtp(
    main, model_path: str, speculative_model: str | None = None, *, attn_backend=None, progress: bool = True
) -> MTPModule:
    """The MTP module for a loaded ember model (main: LlamaForCausalLM or a subclass), from
    model_path's checkpoint or from speculative_model when that is another folder."""
    ckpt = find_mtp_weights(main.cfg, model_path, speculative_model)
    if hasattr(main, "build_mtp"):  # a model whose MTP layer is its own kind of layer (qwen4_exp)
        mtp = main.build_mtp(ckpt.num_layers, attn_backend)
        if ckpt.separate:
            _check_made_for(mtp.shape_of(ckpt.block_cfg), mtp.shape_of(main.cfg), ckpt.folder)
        mtp.load_mtp_weights(iter_mtp_tensors(ckpt, progress), ckpt.folder)
        return mtp.eval()
    mtp = MTPModule(
        main,
        ckpt.num_layers,
        ckpt.layout,
        block_cfg=ckpt.block_cfg,
        own_heads=ckpt.own_heads,
        attn_backend=attn_backend,
        draft_vocab_sizes=ckpt.draft_vocab_sizes or None,
    )
    load_mtp_weights(mtp, ckpt, progress)
    return mtp.eval()
