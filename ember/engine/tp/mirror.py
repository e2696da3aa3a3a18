"""Rank 0 calls the model through these wrappers; every call is first sent to the workers, which
replay it on their own shard and KV caches (Replayer), then rank 0 runs it too, and the collectives
inside the forward meet in the middle.

So the scheduler, the sampler and the drafter's bookkeeping run once, on rank 0; workers only ever
see the flattened step inputs (input_ids, positions, attention metadata, row selections) and the
hidden rows that logits or an MTP step are computed from -- never a request. Rank 0's KV caches
are replaced by each worker's own (its kv heads) on the way.
"""

from __future__ import annotations

import torch

from ember.distributed.comm import send_call


class MirroredModel:
    """The runner's model under TP (forward and compute_logits are replayed; the rest reads through)."""

    def __init__(self, model):
        self._model = model

    def __call__(self, input_ids, positions, kv_caches, meta, select=None):
        send_call("forward", input_ids, positions, meta, select)
        return self._model(input_ids, positions, kv_caches, meta, select)

    def compute_logits(self, hidden):
        send_call("logits", hidden)
        return self._model.compute_logits(hidden)

    def copy_states(self, states, copies):
        send_call("copy_states", copies)
        return self._model.copy_states(states, copies)

    def commit_states(self, states, accepted):
        send_call("commit_states", accepted)
        return self._model.commit_states(states, accepted)

    def __getattr__(self, name):
        return getattr(self._model, name)


class MirroredMTP:
    """An MTP proposer's MTPModule under TP: its forwards, heads and scratch-block copies are replayed."""

    def __init__(self, mtp):
        self._mtp = mtp

    def __call__(self, input_ids, positions, hidden, kv_caches, meta, step=0, select=None):
        send_call("mtp_forward", input_ids, positions, hidden, meta, step, select)
        return self._mtp(input_ids, positions, hidden, kv_caches, meta, step, select)

    def compute_logits(self, g, step=0):
        send_call("mtp_logits", g, step)
        return self._mtp.compute_logits(g, step)

    def compute_draft_logits(self, g, step=0):
        send_call("mtp_draft_logits", g, step)
        return self._mtp.compute_draft_logits(g, step)

    def propose_greedy(self, g, step=0):
        send_call("mtp_greedy", g, step)
        return self._mtp.propose_greedy(g, step)

    def copy_cache_blocks(self, caches, layers, src, dst):
        send_call("mtp_copy", list(layers), src, dst)
        return self._mtp.copy_cache_blocks(caches, layers, src, dst)

    def __getattr__(self, name):
        return getattr(self._mtp, name)


class Replayer:
    """A worker's side: the same calls on its shard, with its own caches."""

    def __init__(self, model, mtp, device: torch.device):
        self.model, self.mtp, self.device = model, mtp, device
        self.kv_caches: list[torch.Tensor] = []
        self.mtp_caches: list[torch.Tensor] = []

    @torch.inference_mode()
    def run(self, op: str, args: tuple) -> None:
        getattr(self, "op_" + op)(*args)

    def op_setup(self, main_shapes, extra_shapes, kv_dtype, state_slots: int = 0) -> None:
        """Allocate this rank's KV caches in rank 0's layout (same blocks, this rank's kv heads); a
        hybrid's linear-attention layers (shape None) get this rank's recurrent states."""
        alloc = lambda s: torch.zeros(s, dtype=kv_dtype, device=self.device)  # noqa: E731
        states = (
            self.model.make_recurrent_states(state_slots, self.device) if state_slots else [None] * len(main_shapes)
        )
        self.states = [st for st in states if st is not None]
        self.kv_caches = [st if s is None else alloc(s) for s, st in zip(main_shapes, states)]
        self.mtp_caches = [alloc(s) for s in extra_shapes]

    def op_copy_states(self, copies) -> None:
        self.model.copy_states(self.states, copies)

    def op_commit_states(self, accepted) -> None:
        self.model.commit_states(self.states, accepted)

    def op_profile(self, n: int, num_seqs: int, kv_heads: int, dtype) -> None:
        from ember.engine.startup.kv_pool import profile_forward

        profile_forward(self.model, n, num_seqs, kv_heads, dtype, self.device)

    def op_forward(self, input_ids, positions, meta, select):
        self.model(input_ids, positions, self.kv_caches, meta, select)

    def op_logits(self, hidden):
        self.model.compute_logits(hidden)

    def op_mtp_forward(self, input_ids, positions, hidden, meta, step, select):
        self.mtp(input_ids, positions, hidden, self.mtp_caches, meta, step, select)

    def op_mtp_logits(self, g, step):
        self.mtp.compute_logits(g, step)

    def op_mtp_draft_logits(self, g, step):
        self.mtp.compute_draft_logits(g, step)

    def op_mtp_greedy(self, g, step):
        self.mtp.propose_greedy(g, step)

    def op_mtp_copy(self, layers, src, dst):
        self.mtp.copy_cache_blocks(self.mtp_caches, layers, src, dst)
