"""RecurrentState: one linear-attention layer's state for every slot of the engine's state pool.

A slot holds one sequence's conv window (the last K - 1 inputs of the causal conv, in the model
dtype) and its SSM state [value heads, dk, dv] in float32, whatever the model dtype (an fp16/bf16
state drifts: hybrid.md, pitfall 4). Slots past the live ones hold prefix-cache snapshots; the
engine copies between slots (snapshot, restore) with `copy`.

A speculative verify does not write its sequence's slot: the layer keeps the state after every
token it ran (`keep_verify`), and once the rejection sampler has decided, `commit` writes the
state after the last accepted token. So a rejected draft never reaches a slot, and nothing is
re-run.
"""

from __future__ import annotations

import torch


class RecurrentState:
    def __init__(
        self,
        num_slots: int,
        conv_dim: int,
        conv_kernel: int,
        num_heads: int,
        key_dim: int,
        value_dim: int,
        conv_dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ):
        self.conv = torch.zeros(num_slots, conv_dim, conv_kernel - 1, dtype=conv_dtype, device=device)
        self.ssm = torch.zeros(num_slots, num_heads, key_dim, value_dim, dtype=torch.float32, device=device)
        self.conv_kernel = conv_kernel
        self._pending: list[tuple[int, torch.Tensor, torch.Tensor, list[tuple[int, int]]]] = []

    # per tensor of tensors(): what its first dimension counts ("slots": the pool's slots; "slots+1": the
    # slots and a scratch row that a fixed-shape step's padding rows write, ember.layers.ple.PLEState)
    POOL_DIMS: tuple[str, ...] = ("slots", "slots")

    @classmethod
    def over(cls, tensors: tuple[torch.Tensor, ...], conv_kernel: int) -> "RecurrentState":
        """A state over existing pool tensors (no allocation; tensors() of one): what an ahead-of-time decode
        step, which takes tensors only, rebuilds from the tensors it is handed (ember.engine.executor.compiled)."""
        state = cls.__new__(cls)
        state._bind(tensors)
        state.conv_kernel = conv_kernel
        return state

    def _bind(self, tensors: tuple[torch.Tensor, ...]) -> None:
        self.conv, self.ssm = tensors
        self._pending = []

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The pool tensors a step reads and writes in place ((conv, ssm) here; a subclass adds its own)."""
        return self.conv, self.ssm

    @property
    def nbytes(self) -> int:
        return self.conv.nbytes + self.ssm.nbytes

    def keep_verify(
        self, slot: int, ssm_states: torch.Tensor, window: torch.Tensor, snapshots: list[tuple[int, int]] = ()
    ) -> None:
        """A verify step's states for `slot`: ssm_states [L, H, dk, dv] (after each of its L tokens),
        its conv window [C, K - 1 + L], and the snapshots planned inside it ((t, slot): after t tokens)."""
        self._pending.append((slot, ssm_states, window, list(snapshots)))

    def write(self, slot: int, ssm: torch.Tensor, conv: torch.Tensor) -> None:
        self.ssm[slot] = ssm
        self.conv[slot] = conv

    def commit(self, accepted: dict[int, int]) -> None:
        """slot -> drafts accepted (a): the state after a + 1 tokens (the last sampled one and a
        drafts) becomes the slot's state, and snapshots planned at or before it are written. Every
        pending verify must be named."""
        K = self.conv_kernel
        for slot, states, window, snapshots in self._pending:
            kept = accepted[slot] + 1
            for t, snap in snapshots:
                if t <= kept:
                    self.write(snap, states[t - 1], window[:, t : t + K - 1])
            self.write(slot, states[kept - 1], window[:, kept : kept + K - 1])
        self._pending.clear()

    def copy(self, src: int, dst: int) -> None:
        self.conv[dst] = self.conv[src]
        self.ssm[dst] = self.ssm[src]
