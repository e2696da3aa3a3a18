"""A device cache of the hottest routed experts of the layers whose experts stay in host memory
(--cpu-moe / --n-cpu-moe: ember.layers.expert_placement), FreeToken's per-(layer, expert) LRU.

Routing is skewed: a few experts of each layer take most tokens of a conversation, and the same ones
again on the next step. A slot holds one (layer, expert) as dense matrices in the run dtype on the
device (gate;up [2I, H], down [H, I]), filled from the host copy; a step's expert that has a slot runs
on the device (a hit), the others on the host (misses), and after the step each miss takes a slot, the
least recently used one when none is free. One cache serves every host layer (the experts of a model's
MoE layers share one shape), sized in bytes: from what the KV cache leaves of the device, or
--moe-hot-cache-memory (ember.engine.startup.start).

Counting: a lookup is one (layer, expert) a step chooses, however many of the step's tokens chose it;
it is a hit when the expert had a slot when the step reached the layer. /metrics reads hits, misses and
their rate (ember.server.metrics).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable

import torch

from ember.layers.activation import silu_and_mul
from ember.layers.linear import dense_linear

Fill = Callable[[int], tuple[torch.Tensor, torch.Tensor]]  # expert -> (gate;up [2I, H], down [H, I]) on the host


class HotExpertCache:
    def __init__(self, hidden_size: int, intermediate_size: int, dtype: torch.dtype, device, fused_act: bool = True):
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.dtype, self.device, self.fused_act = dtype, torch.device(device), fused_act
        self.capacity = 0
        self.w13: torch.Tensor | None = None  # [slots, 2I, H]
        self.w2: torch.Tensor | None = None  # [slots, H, I]
        self.slots: OrderedDict[tuple[int, int], int] = OrderedDict()  # (layer, expert) -> slot, oldest use first
        self.free: list[int] = []
        self.hits = self.misses = self.fills = self.evictions = 0

    @property
    def expert_bytes(self) -> int:
        """One slot's bytes: gate, up and down of one expert in the run dtype."""
        return 3 * self.hidden_size * self.intermediate_size * self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        return self.capacity * self.expert_bytes

    def resize(self, nbytes: float) -> int:
        """As many slots as nbytes holds (emptied); returns their count."""
        self.capacity = max(0, int(nbytes // self.expert_bytes))
        H, I, n = self.hidden_size, self.intermediate_size, self.capacity
        self.w13 = torch.empty(n, 2 * I, H, dtype=self.dtype, device=self.device) if n else None
        self.w2 = torch.empty(n, H, I, dtype=self.dtype, device=self.device) if n else None
        self.slots.clear()
        self.free = list(range(n))
        return n

    @property
    def hit_rate(self) -> float:
        looked = self.hits + self.misses
        return self.hits / looked if looked else 0.0

    def lookup(self, layer: int, experts: list[int]) -> dict[int, int]:
        """The slots of the experts (of `layer`) that have one: expert -> slot. Counts each expert once, a hit
        or a miss, and makes the hits the most recently used."""
        found = {}
        for e in experts:
            slot = self.slots.get((layer, e))
            if slot is None:
                self.misses += 1
                continue
            self.hits += 1
            self.slots.move_to_end((layer, e))
            found[e] = slot
        return found

    def admit(self, layer: int, experts: list[int], fill: Fill) -> None:
        """Give each expert a slot (evicting the least recently used), filled from the host copy. With more
        experts than slots only the last ones are kept (the others would be evicted by them at once)."""
        for e in experts[max(0, len(experts) - self.capacity) :]:
            if (layer, e) in self.slots:
                continue
            if self.free:
                slot = self.free.pop()
            else:
                _, slot = self.slots.popitem(last=False)
                self.evictions += 1
            w13, w2 = fill(e)
            self.w13[slot].copy_(w13, non_blocking=True)
            self.w2[slot].copy_(w2, non_blocking=True)
            self.slots[(layer, e)] = slot
            self.fills += 1

    def expert_forward(self, slot: int, x: torch.Tensor) -> torch.Tensor:
        """The slot's expert on its tokens x [n, H] (on the device) -> [n, H]."""
        return dense_linear(silu_and_mul(dense_linear(x, self.w13[slot]), self.fused_act), self.w2[slot])

    def stats(self) -> dict[str, float]:
        return {
            "slots": self.capacity,
            "hits": self.hits,
            "misses": self.misses,
            "hit_rate": self.hit_rate,
            "fills": self.fills,
            "evictions": self.evictions,
        }
