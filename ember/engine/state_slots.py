"""Recurrent-state slots of a hybrid model, beside the KV blocks (plain Python, no torch).

Every running request holds one live slot (taken at admission, given back on finish, abort and
preemption), like the blocks it holds. The slots past the live ones hold prefix-cache snapshots:
the state after a block-aligned position p, named by the chained hash of the block that ends at p.
A prefix-cache hit may skip only tokens whose state it can restore, so a hit ends where a snapshot
is (KVCacheManager.find_cached_prefix asks `usable_hit`).

Which positions get a snapshot (bounded: the snapshot slots are few and evicted LRU):
- in a prompt, every `interval` tokens and the last block boundary before its end (a repeat of the
  prompt, or a longer one sharing it, resumes there);
- in decoding, the latest block boundary a step reaches (the next chat turn resumes there): each
  request keeps one such rolling snapshot and gives up its older one.
A snapshot is reserved when a step is scheduled (`plan`: "after t tokens of this step, copy the
state to slot s"), written by the model's linear-attention layers during the step (a verify step
only from the states of accepted tokens, at commit: a rejected draft never reaches a snapshot),
and named only after the step, once the tokens up to p are computed and known. Restores are copies
(snapshot -> live slot) that the runner makes before the step's forward, in the order recorded.
"""

from __future__ import annotations

from collections import OrderedDict

from ember.request import Request


class StateSlots:
    def __init__(self, num_live: int, num_snapshots: int, block_size: int, interval_blocks: int = 16):
        self.num_live, self.num_snapshots = num_live, num_snapshots
        self.block_size = block_size
        self.interval = interval_blocks * block_size
        self.free_live = list(range(num_live - 1, -1, -1))
        self.free_snap = list(range(num_live + num_snapshots - 1, num_live - 1, -1))
        self.named: OrderedDict[int, int] = OrderedDict()  # block hash -> snapshot slot, LRU first
        self.copies: list[tuple[int, int]] = []  # (src, dst) for the runner, before the next forward

    @property
    def num_free(self) -> int:
        return len(self.free_live)

    # -- live slots ---------------------------------------------------------------------------
    def acquire(self, req: Request) -> bool:
        if req.state_slot is not None:
            return True
        if not self.free_live:
            return False
        req.state_slot = self.free_live.pop()
        return True

    def release(self, req: Request) -> None:
        if req.state_slot is not None:
            self.free_live.append(req.state_slot)
            req.state_slot = None
        for _, slot in req.state_plan + req.unnamed_snapshots:
            self.free_snap.append(slot)
        req.state_plan, req.unnamed_snapshots = [], []
        req.rolling_snapshot = None

    # -- prefix hits ----------------------------------------------------------------------------
    def usable_hit(self, hit_hashes: list[int]) -> int:
        """How many of the hit blocks a request may skip: up to the last one that ends at a snapshot."""
        for n in range(len(hit_hashes), 0, -1):
            if hit_hashes[n - 1] in self.named:
                return n
        return 0

    def restore(self, req: Request, block_hash: int) -> None:
        slot = self.named[block_hash]
        self.named.move_to_end(block_hash)
        self.copies.append((slot, req.state_slot))

    # -- snapshots ------------------------------------------------------------------------------
    def plan(self, req: Request, start: int, num_tokens: int) -> None:
        """Reserve this step's snapshots for req, which runs positions start .. start + num_tokens."""
        req.state_plan = []
        if not self.num_snapshots:
            return
        bs, end = self.block_size, start + num_tokens
        last_prompt_boundary = (req.num_prompt_tokens - 1) // bs * bs
        for p in range((start // bs + 1) * bs, end + 1, bs):
            in_prompt = p <= last_prompt_boundary
            if (
                in_prompt
                and (p % self.interval == 0 or p == last_prompt_boundary)
                or not in_prompt
                and p == end - (end % bs)
            ):
                if not in_prompt and req.rolling_snapshot is not None:  # replaced, not kept beside the new one
                    self._drop(req.rolling_snapshot)
                    req.rolling_snapshot = None
                slot = self._take_snapshot_slot()
                if slot is None:
                    return
                req.state_plan.append((p, slot))

    def settle(self, req: Request, block_hashes: list[int]) -> None:
        """After the step: keep the planned snapshots whose position the request computed, name every
        kept one whose block is now named (block_hashes), give back the rest."""
        for p, slot in req.state_plan:
            if p <= req.num_computed_tokens:
                req.unnamed_snapshots.append((p, slot))
            else:  # past the accepted drafts: never written
                self.free_snap.append(slot)
        req.state_plan = []
        still = []
        for p, slot in req.unnamed_snapshots:
            i = p // self.block_size - 1
            if i >= len(block_hashes):
                still.append((p, slot))
                continue
            h = block_hashes[i]
            if h in self.named:  # another request named it first: ours is a duplicate
                self.free_snap.append(slot)
                continue
            self.named[h] = slot
            if p > (req.num_prompt_tokens - 1) // self.block_size * self.block_size:  # a decode position
                if req.rolling_snapshot is not None:
                    self._drop(req.rolling_snapshot)
                req.rolling_snapshot = h
        req.unnamed_snapshots = still

    def _drop(self, block_hash: int) -> None:
        slot = self.named.pop(block_hash, None)
        if slot is not None:
            self.free_snap.append(slot)

    def _take_snapshot_slot(self) -> int | None:
        if not self.free_snap and self.named:
            _, slot = self.named.popitem(last=False)  # the least recently used snapshot
            self.free_snap.append(slot)
        return self.free_snap.pop() if self.free_snap else None

    def take_copies(self) -> list[tuple[int, int]]:
        copies, self.copies = self.copies, []
        return copies

    def reset(self) -> None:
        """Forget every snapshot (reset_prefix_cache)."""
        for h in list(self.named):
            self._drop(h)
