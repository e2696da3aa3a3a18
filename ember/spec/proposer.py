"""The Proposer seam: after a step, propose up to k draft tokens per decoding request.

The scheduler only sees "request r has d pending draft tokens" (it schedules 1 + d); the runner
puts them into the step and the rejection sampler verifies them. A proposer never touches the
engine, the scheduler or the target's KV layers: it is built from a ProposerContext (what it may
read: the target model, the device, the engine's limits) and, if it keeps KV of its own, given a
KVSlots (its layers in the pool, same block ids). A new drafter is one Proposer subclass
registered in PROPOSERS (whose keys are ember.config.speculative.METHODS).

A step, for a proposer: after_step(step, drafting) with what the runner kept of the step it just ran
(StepRows: hidden states and/or the rows' layout, as the proposer's reads_step asks) and the ids of
the requests it will be asked to draft for, then propose(requests, max_tokens) for those.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch

from ember.kernels.cpu_kernels import CpuKernels
from ember.request import Draft, Request

if TYPE_CHECKING:
    from ember.config.speculative import SpeculativeConfig
    from ember.loader.model_loader import LoadedModel


@dataclass
class ProposerContext:
    """What a proposer may read when it is built: the target as loaded and the engine's limits."""

    target: LoadedModel  # the target as loaded: .model, .model_config, .path, .tokenizer, .weight_bytes
    device: torch.device
    dtype: torch.dtype
    kernels: CpuKernels  # the CPU kernels the target runs (a draft's layers use the same)
    attention_backend: str  # the target's backend, resolved (a draft model is built with the same)
    tokenizer: str | None  # --tokenizer: borrowed by a draft folder without tokenizer files
    block_size: int
    max_model_len: int
    max_num_seqs: int
    generators: dict[str, torch.Generator] = field(default_factory=dict)  # per-request seeded ones, the sampler's
    tensor_parallel: bool = False  # the target is sharded over ranks
    mirror: Callable[[Any], Any] = lambda module: module  # TP: wraps an MTP module so the workers replay its calls


@dataclass
class KVSlots:
    """A drafter's share of the KV pool: layers with the target's block ids (a block freed, preempted
    or prefix-cached is so for both), plus scratch blocks past the pool's that only it writes."""

    num_blocks: int  # the pool's blocks; scratch block ids start here
    allocate: Callable[[int, int, int], torch.Tensor]  # (kv heads, head_dim, extra blocks) -> a zeroed layer


@dataclass
class StepRows:
    """What the last executed step computed, for a drafter that reads the target's step.

    Request i of the step (entries[i] = (request, its first flat row, its first position, its
    row count)) wrote rows row0 .. row0 + n - 1 at positions start .. start + n - 1, into
    slot_mapping[row0 + j] through block table tables[i] (as the block ids stood at the step:
    a request finished since has released them, but nothing reuses a block before the next
    schedule)."""

    hidden: torch.Tensor | None  # [T, H] final-normed hidden state of every row (None: reads_step "rows")
    entries: list[tuple[Request, int, int, int]]
    slot_mapping: torch.Tensor  # [T] int64
    tables: list[list[int]]  # per entry, padded with 0 to one width


# make_executor(model, caches, row_inputs, what) -> a step executor of the engine's own kind (compiled
# or CUDA graphs) and sizes for another module, or None where the engine runs eagerly
ExecutorFactory = Callable[[torch.nn.Module, list, tuple, str], Any]


class Proposer:
    """Defaults for a drafter with no state of its own (n-gram); MTP and draft models override the hooks."""

    # Only read when the config leaves num_speculative_tokens open (MTP: its number of layers).
    num_speculative_tokens: int = 1
    # The cost of drafting one token relative to a plain decode step (adaptive k weighs it with
    # the verify cost); 0 = free, as for n-gram.
    draft_token_cost: float = 0.0
    # What it reads of each step (StepRows): "hidden" (every row's final hidden state: the last
    # layer then runs for every row), "rows" (the layout only), or None.
    reads_step: str | None = None

    def kv_bytes_per_token(self, elem_bytes: int) -> int:
        """Its own KV bytes per token in the pool (the engine sizes the pool with it)."""
        return 0

    def attach(self, slots: KVSlots) -> None:
        """Once the pool exists: allocate its layers there."""

    def prepare(self, make_executor: ExecutorFactory) -> None:
        """Once the engine's executor exists: build its own compiled / captured steps alike."""

    def after_step(self, step: StepRows | None, drafting: set[str] | None = None) -> None:
        """After every step, before propose: e.g. fill its KV from the step's rows. drafting: the ids of
        the requests propose will be asked about next (None: any); the others' work may wait."""

    def propose(self, requests: Sequence[Request], max_tokens: Sequence[int]) -> list[Draft | None]:
        """Per request, at most max_tokens[i] (>= 1) draft tokens following its token_ids
        (prompt + output), or None when it has no guess."""
        raise NotImplementedError


# method -> "module:Class"; imported on first use.
PROPOSERS: dict[str, str] = {
    "ngram": "ember.spec.ngram:NgramProposer",
    "mtp": "ember.spec.mtp_proposer:MTPProposer",
    "draft": "ember.spec.draft:DraftModelProposer",
}


def build_proposer(spec: SpeculativeConfig, ctx: ProposerContext) -> Proposer:
    module, _, cls = PROPOSERS[spec.method].partition(":")
    return getattr(importlib.import_module(module), cls)(spec, ctx)
