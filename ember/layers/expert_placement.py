"""Where a MoE model's routed experts and qwen4_exp's n-gram table live: llama.cpp's --cpu-moe / --n-cpu-moe
and --ple-offload, written device-generically (on a CPU machine the "device" is the CPU itself, so the
same code runs and is tested here).

- The experts of the first N MoE layers (every MoE layer with --cpu-moe) stay in host memory, as views
  of the checkpoint file's mapping (ember.quant.mapped_experts: never read whole), and run on the host's
  C++ kernels: HostExperts takes the place of the layer's experts module, moves a step's rows to the
  host and its output back. The other MoE layers' experts are resident on the device, as without the flag.
- A hot-expert cache (ember.layers.hot_experts) keeps device copies of the host layers' most recently
  used experts; HostExperts runs a step's cached experts on the device and the rest on the host, then
  admits the misses.
- --ple-offload: the n-gram table stays in host memory (the file), and each step's gathered rows are
  copied into its input (ember.layers.ple.NGramTable.gather); without it the table is read onto the
  device whole at load. The default is to offload whenever the table would not fit the device.

A model is built inside `building(placement)` (as tensor parallelism's `sharding`): the layers read
`current_placement()` when they are constructed, and a model built outside it (the tests', a drafter's,
an MTP layer's) keeps everything on its device. The placement carries the storage's constructor
(`make_host`), since the layers package may not import the quantization package that holds it.
"""

from __future__ import annotations

import re
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from ember.layers.hot_experts import HotExpertCache
from ember.layers.moe_compute import experts_forward, grouped_experts, in_graph, register_experts

HOST = torch.device("cpu")
_LAYER = re.compile(r"layers\.(\d+)\.")


def layer_index(prefix: str) -> int | None:
    """The decoder layer a module prefix ("model.layers.3.mlp") names, or None."""
    m = _LAYER.search(prefix + ".")
    return int(m[1]) if m else None


@dataclass
class ExpertPlacement:
    """host_layers: decoder layer indices whose routed experts stay in host memory; make_host(num_experts,
    hidden, intermediate, dtype, kernels) -> their storage module; hot_cache: the device cache of their
    experts (None: none); ple_offload: the n-gram table stays in host memory (None: where it does not fit the
    device, ember.layers.ple)."""

    host_layers: frozenset[int] = frozenset()
    make_host: Callable[..., nn.Module] | None = None
    hot_cache: HotExpertCache | None = None
    ple_offload: bool | None = None
    hot_cache_gib: float | None = None  # --moe-hot-cache-memory (None: what the KV cache leaves, on CUDA)
    host_kernels: object | None = None  # the CPU kernels host experts run (None: the model's own, on a CPU)

    def on_host(self, layer: int | None) -> bool:
        return layer is not None and layer in self.host_layers

    def host_experts(self, layer: int, num_experts: int, hidden: int, intermediate: int, dtype, device, kernels):
        """The experts module of a host layer: its storage in host memory behind HostExperts."""
        storage = self.make_host(num_experts, hidden, intermediate, dtype, self.host_kernels or kernels)
        return HostExperts(storage, layer, self.hot_cache, device)

    def mapped_names(self) -> Callable[[str], bool]:
        """A checkpoint name -> whether it is a routed-expert tensor of a host layer (kept as a view of the map)."""

        def picks(name: str) -> bool:
            return ".mlp.experts." in name and layer_index(name) in self.host_layers

        return picks


_building: ExpertPlacement | None = None


def current_placement() -> ExpertPlacement | None:
    """The placement of the model being built now (None outside `building`)."""
    return _building


@contextmanager
def building(placement: ExpertPlacement | None):
    """Build a model's layers for `placement` inside this block."""
    global _building
    saved, _building = _building, placement
    try:
        yield
    finally:
        _building = saved


class HostExperts(nn.Module):
    """A MoE layer's routed experts kept in host memory (the module docstring). `host` is the storage (its
    placeholders are the layer's w13 / w2 for the model's loader); a step's experts run on the host, but
    those with a slot in the hot cache, which run on the device."""

    def __init__(self, storage: nn.Module, layer: int, cache: HotExpertCache | None, device):
        super().__init__()
        self.host = storage
        self.num_experts = storage.num_experts
        self.layer, self.cache, self.device = layer, cache, torch.device(device)
        self.graph_key = register_experts(self)  # a compiled step calls ember::moe_experts, which calls run

    def load_weight(self, name: str, tensor, shard_id=None):
        param, shard = self.host.load_weight(name, tensor, shard_id)
        return f"host.{param}", shard

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        if in_graph(x):
            return experts_forward(self, x, topk_ids, topk_weights)
        return self.run(x, topk_ids, topk_weights)

    def run(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """The step's experts: each cached one on the device, the rest on the host; then the misses are cached."""
        cache = self.cache if self.cache is not None and self.cache.capacity else None
        if cache is None:
            y = self.host(x.to(HOST), topk_ids.to(HOST), topk_weights.to(HOST))
            return y.to(x.device)
        chosen = torch.unique(topk_ids).tolist()
        hits = cache.lookup(self.layer, chosen)

        def expert(e: int, xe: torch.Tensor) -> torch.Tensor:
            return cache.expert_forward(hits[e], xe) if e in hits else self.expert_forward(e, xe)

        y = grouped_experts(x, topk_ids, topk_weights, self.num_experts, expert)
        cache.admit(self.layer, [e for e in chosen if e not in hits], self._fill)
        return y

    def expert_forward(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert e on the host, its tokens moved there and the result back."""
        return self.host.expert_forward(e, x.to(HOST)).to(x.device)

    def _fill(self, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.host.dense_expert(e, self.cache.dtype)


def moe_layers(mc) -> list[int]:
    """The decoder layers of a ModelConfig that have routed experts, in order."""
    return [i for i in range(mc.num_layers) if mc.num_experts > 0 and mc.is_moe_layer(i)]


def resolve_placement(
    config, mc, device, dtype, make_host, fused_act: bool = True, host_kernels=None
) -> ExpertPlacement | None:
    """The placement a model config gets from a PlacementConfig (--cpu-moe, --n-cpu-moe, --moe-hot-cache-memory,
    --ple-offload), or None where nothing is placed apart. A flag the model has nothing for is refused.
    host_kernels: the CpuKernels host experts run beside a GPU (whose model's own are none)."""
    from ember.errors import ConfigError

    layers = moe_layers(mc)
    if config.keeps_experts_on_host and not layers:
        flag = "--cpu-moe" if config.cpu_moe else f"--n-cpu-moe {config.n_cpu_moe}"
        raise ConfigError(f"{flag} keeps MoE experts in host memory, but {mc.architecture} has no MoE layers: drop it")
    if config.ple_offload is not None and mc.ple is None:
        flag = "--ple-offload" if config.ple_offload else "--no-ple-offload"
        raise ConfigError(f"{flag} places qwen4_exp's n-gram table, which {mc.architecture} does not have: drop it")
    host = frozenset(layers[: config.host_moe_layers(len(layers))])
    if not host and config.ple_offload is None:
        return None
    cache = None
    if host and config.moe_hot_cache_memory != 0:
        cache = HotExpertCache(mc.hidden_size, mc.moe_intermediate_size, dtype, device, fused_act)
    return ExpertPlacement(host, make_host, cache, config.ple_offload, config.moe_hot_cache_memory, host_kernels)
