"""StepMasks: one step's grammar bitmasks, applied to the logits before anything samples.

The runner lays its logit rows out per request (one row, or 1 + d consecutive verify rows);
`apply` sets every token the grammar forbids to -inf in those rows, in place, so the sampler's
temperature, top-k/p, penalties and seeds act on what the grammar allows, greedy takes the
allowed argmax, the rejection sampler's target gives a forbidden draft probability 0, and
logprobs are those of the distribution sampled from.
"""

from __future__ import annotations

import time

import torch

from ember.kernels import cpu_row_top


class StepMasks:
    def __init__(self, rows: dict[str, torch.Tensor], fill_seconds: float):
        self.rows = rows  # request id -> int32 bitmask [1 + d, ceil(V / 32)]
        self.seconds = fill_seconds  # filling, then applying

    def apply(self, logits: torch.Tensor, layout: list[tuple[str, int]]) -> None:
        """layout: (request id, its first logit row) for the rows of `logits`, in order."""
        t0 = time.perf_counter()
        picked, indices = [], []
        for rid, first in layout:
            bits = self.rows.get(rid)
            if bits is not None:
                picked.append(bits)
                indices.extend(range(first, first + bits.shape[0]))
        if picked:
            cpu_row_top.mask_rows(logits, torch.cat(picked), indices)
        self.seconds += time.perf_counter() - t0
