"""The memory arithmetic of a MoE model's experts kept in host memory (--cpu-moe / --n-cpu-moe,
ember.layers.expert_placement), for ember.engine.planner: what the device no longer holds, what the host
holds instead, the hot-expert cache, and the smallest --n-cpu-moe that lets a model fit a card.

- Host experts are views of the checkpoint file's mapping: resident as far as steps touch them. A decode
  over a long prompt touches nearly every expert of every layer (top-10 of 512 over 2,000 tokens leaves
  ~0.00% untouched), so the plan counts them whole, at the file's bytes: on a CPU engine in the peak RSS,
  beside a card in the host's memory.
- The device holds the other MoE layers' experts as it holds every weight (the planner's weight bytes,
  whose experts' share is split evenly over the MoE layers, or a GGUF file's own expert tensors).
- The hot cache (ember.engine.startup.hot_cache): on CUDA the KV blocks beyond max_num_seqs sequences of
  max_model_len, at most every host expert as dense run-dtype copies; --moe-hot-cache-memory sets it.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

_EXPS = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight")
GiB = 1 << 30
# beside a card, what the host keeps for everything but ember's experts (the OS, the desktop or the server's
# other processes, the page cache the n-gram table's rows pass through): a plan's allowance, not a measurement
HOST_RESERVE_BYTES = 4 * GiB


def moe_layer_ids(mc) -> list[int]:
    return [i for i in range(mc.num_layers) if mc.num_experts > 0 and mc.is_moe_layer(i)]


def file_bytes(type_name: str, elements: int) -> int:
    """A GGUF tensor's bytes in the file."""
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    return elements // block * size


@dataclass
class ExpertSplit:
    moe_layers: int  # the model's MoE layers
    host_layers: int  # of them, the first ones whose experts stay in host memory
    layer_held_bytes: float  # one MoE layer's routed experts as the device would hold them
    host_bytes: int  # the host layers' experts as the file holds them (mapped; counted whole)
    host_ids: frozenset = frozenset()  # their decoder layer indices

    @property
    def device_saved_bytes(self) -> int:
        return int(self.host_layers * self.layer_held_bytes)


def expert_split(placement, src, quant: str, weights: int, expert_bytes: int, dtype_bytes: int) -> ExpertSplit:
    """placement: the PlacementConfig; weights / expert_bytes: the planner's weight bytes and the routed
    experts' share of them (as the device would hold them)."""
    mc = src.mc
    layers = moe_layer_ids(mc)
    host = placement.host_moe_layers(len(layers)) if layers else 0
    per_layer = expert_bytes / len(layers) if layers else 0.0
    if not host:
        return ExpertSplit(len(layers), 0, per_layer, 0)
    ids = set(layers[:host])
    if src.kind == "gguf" and src.gguf_tensors is not None:
        host_bytes = sum(
            file_bytes(t.type_name, t.elements)
            for t in src.gguf_tensors
            if (m := _EXPS.fullmatch(t.name)) and int(m[1]) in ids
        )
    else:
        elems = host * mc.num_experts * 3 * mc.hidden_size * mc.moe_intermediate_size
        # a folder's experts are mapped in the checkpoint's dtype; a what-if quantization at its held bytes
        checkpoint = 4 if str(mc.torch_dtype).removeprefix("torch.") == "float32" else 2
        per = checkpoint if quant in ("none", "half") else expert_bytes / max(1, _expert_elements(mc))
        host_bytes = math.ceil(elems * per)
    return ExpertSplit(len(layers), host, per_layer, host_bytes, frozenset(ids))


def _expert_elements(mc) -> int:
    return len(moe_layer_ids(mc)) * mc.num_experts * 3 * mc.hidden_size * mc.moe_intermediate_size


def resident_tensors(tensors: list, split: ExpertSplit | None) -> list:
    """A GGUF file's loaded tensors but the host layers' expert tensors (which stay mapped)."""
    if split is None or not split.host_layers:
        return tensors
    return [t for t in tensors if not ((m := _EXPS.fullmatch(t.name)) and int(m[1]) in split.host_ids)]


def layers_to_fit(split: ExpertSplit, shortfall: float) -> int | None:
    """The fewest first MoE layers whose experts, kept in host memory, free `shortfall` bytes of the device;
    None when even every layer's do not."""
    if shortfall <= 0:
        return 0
    if not split.layer_held_bytes:
        return None
    n = math.ceil(shortfall / split.layer_held_bytes)
    return n if n <= split.moe_layers else None


def hot_cache_bytes(
    placement, device: str, split: ExpertSplit, mc, spare_tokens: int, per_token: int, dtype_bytes: int
) -> int:
    """The hot-expert cache as start-up sizes it (ember.engine.startup.hot_cache); spare_tokens: the KV pool's
    tokens beyond max_num_seqs sequences of max_model_len."""
    if not split.host_layers or placement.moe_hot_cache_memory == 0:
        return 0
    every = split.host_layers * mc.num_experts * 3 * mc.hidden_size * mc.moe_intermediate_size * dtype_bytes
    if placement.moe_hot_cache_memory is not None:
        return int(min(placement.moe_hot_cache_memory * GiB, every))
    if device == "cpu":
        return 0
    return int(min(max(0, spare_tokens) * per_token, every))


def plan_fields(split: ExpertSplit, hot: int, host: tuple[int, bool], shortfall: float, slot_bytes: int) -> dict:
    """The planner's Plan fields of the split (shortfall: what the device lacks with the split as given)."""
    return dict(
        moe_layers=split.moe_layers,
        host_moe_layers=split.host_layers,
        host_expert_bytes=split.host_bytes,
        hot_cache_bytes=hot,
        host_memory_bytes=host[0],
        host_fits=host[1],
        n_cpu_moe_to_fit=layers_to_fit(split, shortfall + split.device_saved_bytes),
        hot_cache_slot_bytes=slot_bytes,
    )
