"""Recurrent-state slots of a hybrid model, beside the KV blocks (plain Python, no torch).

Every running request holds one live slot (taken at admission, given back on finish, abort and
preemption), like the blocks it holds. The other slots hold prefix-cache snapshots (which slot
is which changes as a request's live slot becomes its end snapshot, below):
the state after p tokens, named by the prefix it ends (KVCacheManager.prefix_name: the chained hash
of the block ending at p, or of the partial block's tokens when p is inside a block). A prefix-cache
hit may skip only tokens whose state it can restore, so a hit ends where a snapshot is.

Which positions get a snapshot (llama-server's `--ctx-checkpoints`, at positions known in advance):
- in a prompt, every `interval` tokens (block boundaries: a longer prompt sharing the start resumes
  there) and at its end less one token, P - 1 (the same prompt again runs one token; a prompt
  shorter than one block hits too);
- at the end of a request (finished, aborted or preempted): the state after its computed tokens,
  where the next chat turn resumes. Its live slot becomes that snapshot (no copy) and a snapshot
  slot becomes live in its place, so the pool sizes never change.
A prompt snapshot is reserved when a step is scheduled (`plan`: "after t tokens of this step, copy
the state to slot s"), written by the model's linear-attention layers during the step (a verify step
only from the states of accepted tokens, at commit: a rejected draft never reaches a snapshot), and
named only after the step, once the tokens up to p are computed and known (`settle`). Restores are
copies (snapshot -> live slot) that the runner makes before the step's forward, in the order recorded.

Which snapshots are kept (the pool is fixed; a burst of new prompts must not flush a conversation):
  Each named snapshot has a credit: the clock when it was last named or restored, plus the tokens
  it saves (p), or plus nothing once the request that named or restored it has named a deeper one
  (superseded: then it serves only a prompt that branches off there). The snapshot with the lowest
  credit is evicted (the least recently used on a tie), and the clock rises to its credit.
So a chain's deepest snapshot outlives its shallow ones, a deep snapshot outlives shallower ones of
the same age (a 4K-token conversation's end outlives a burst of 1K-token prompts), and whatever
stays unused goes once the clock has passed its credit (GreedyDual-Size, Cao & Irani 1997, with the
tokens a hit saves as the cost and every snapshot of one size). A snapshot whose own block (the
one its name names) is handed out again is dropped at once (`forget`): nothing could hit it.
"""

from __future__ import annotations

from dataclasses import dataclass

from ember.request import Request


@dataclass
class Snapshot:
    slot: int
    tokens: int  # the state after this many tokens: what a hit on it saves
    last_use: int  # the clock when it was named or last restored
    order: int  # a counter at the same moments: ties go to the least recently used
    superseded: bool = False  # its request has named a deeper snapshot

    @property
    def credit(self) -> int:
        return self.last_use + (0 if self.superseded else self.tokens)


class StateSlots:
    def __init__(self, num_live: int, num_snapshots: int, block_size: int, interval_blocks: int = 16):
        self.num_live, self.num_snapshots = num_live, num_snapshots
        self.block_size = block_size
        self.interval = interval_blocks * block_size
        self.free_live = list(range(num_live - 1, -1, -1))
        self.free_snap = list(range(num_live + num_snapshots - 1, num_live - 1, -1))
        self.named: dict[int, Snapshot] = {}  # prefix name -> its snapshot
        self.clock = 0
        self._uses = 0
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

    def release(self, req: Request, end_name: int | None = None) -> None:
        """Give back req's slots. end_name: the name of its computed prefix (None: keep no snapshot);
        its live slot, which holds the state after num_computed_tokens, becomes that snapshot."""
        for _, slot in req.state_plan + req.unnamed_snapshots:
            self.free_snap.append(slot)
        req.state_plan, req.unnamed_snapshots = [], []
        live, req.state_slot = req.state_slot, None
        if live is not None:
            self.free_live.append(live)
            if end_name is not None and req.num_computed_tokens > 0:
                self._keep_end(req, end_name)
        req.snapshot_head = None

    def _keep_end(self, req: Request, name: int) -> None:
        """The live slot just given back (the last of free_live) becomes the snapshot `name`, and a
        snapshot slot takes its place among the live ones."""
        if name in self.named:  # already kept (the same prefix ran before): refresh it
            self._use(req, name)
            return
        spare = self._take_snapshot_slot()
        if spare is None:
            return
        live = self.free_live.pop()
        self.free_live.append(spare)
        self._name(req, name, live, req.num_computed_tokens)

    # -- prefix hits ----------------------------------------------------------------------------
    def has(self, name: int) -> bool:
        return name in self.named

    def usable_hit(self, hit_hashes: list[int]) -> int:
        """How many of the hit blocks a request may skip: up to the last one that ends at a snapshot."""
        for n in range(len(hit_hashes), 0, -1):
            if hit_hashes[n - 1] in self.named:
                return n
        return 0

    def restore(self, req: Request, name: int) -> None:
        self.copies.append((self.named[name].slot, req.state_slot))
        self._use(req, name)

    # -- snapshots ------------------------------------------------------------------------------
    def plan(self, req: Request, start: int, num_tokens: int) -> None:
        """Reserve this step's snapshots for req, which runs positions start .. start + num_tokens:
        the prompt's interval positions and its end less one token."""
        req.state_plan = []
        if not self.num_snapshots:
            return
        end, prompt_end = start + num_tokens, req.num_prompt_tokens - 1
        wanted = [
            p for p in range((start // self.interval + 1) * self.interval, end + 1, self.interval) if p < prompt_end
        ]
        if start < prompt_end <= end:
            wanted.append(prompt_end)
        for p in wanted:
            slot = self._take_snapshot_slot()
            if slot is None:
                return
            req.state_plan.append((p, slot))

    def settle(self, req: Request, name_of) -> None:
        """After the step: keep the planned snapshots whose position the request computed, name each
        kept one whose prefix can be named now (name_of(p) -> name, or None while its tokens are not
        all known), give back the rest."""
        for p, slot in req.state_plan:
            if p <= req.num_computed_tokens:
                req.unnamed_snapshots.append((p, slot))
            else:  # past the accepted drafts: never written
                self.free_snap.append(slot)
        req.state_plan = []
        still = []
        for p, slot in req.unnamed_snapshots:
            name = name_of(p)
            if name is None:
                still.append((p, slot))
            elif name in self.named:  # another request named it first: ours is a duplicate
                self.free_snap.append(slot)
                self._use(req, name)
            else:
                self._name(req, name, slot, p)
        req.unnamed_snapshots = still

    def forget(self, name: int) -> None:
        """The KV of the prefix `name` left the cache: its snapshot can never be hit."""
        snap = self.named.pop(name, None)
        if snap is not None:
            self.free_snap.append(snap.slot)

    def _name(self, req: Request, name: int, slot: int, tokens: int) -> None:
        self._uses += 1
        self.named[name] = Snapshot(slot, tokens, self.clock, self._uses)
        self._make_head(req, name)

    def _use(self, req: Request, name: int) -> None:
        snap = self.named[name]
        self._uses += 1
        snap.last_use, snap.order, snap.superseded = self.clock, self._uses, False
        self._make_head(req, name)

    def _make_head(self, req: Request, name: int) -> None:
        """name is now req's deepest snapshot; the one it had before is superseded."""
        old = self.named.get(req.snapshot_head)
        if old is not None and req.snapshot_head != name and old.tokens <= self.named[name].tokens:
            old.superseded = True
        req.snapshot_head = name

    def _take_snapshot_slot(self) -> int | None:
        if not self.free_snap and self.named:
            name = min(self.named, key=lambda h: (self.named[h].credit, self.named[h].order))
            self.clock = max(self.clock, self.named[name].credit)
            self.forget(name)
        return self.free_snap.pop() if self.free_snap else None

    def take_copies(self) -> list[tuple[int, int]]:
        copies, self.copies = self.copies, []
        return copies

    def reset(self) -> None:
        """Forget every snapshot (reset_prefix_cache)."""
        for name in list(self.named):
            self.forget(name)
