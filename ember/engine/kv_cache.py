"""KV block pool: free list, ref counts, and a prefix cache of full blocks (plain Python).

A full block is named by a chained hash (parent block's hash, its tokens), so equal prefixes
map to equal block chains. A freed block keeps its hash and sits in the free queue: it is
both free and a cache entry until it is handed out again. The free queue is LRU: blocks go
to its back when freed (the tail of a sequence first, so its head survives longer) and are
taken from its front.

A hybrid model (states: ember.engine.state_slots) also names partial blocks: a recurrent-state
snapshot may end inside a block (the end of a prompt or of an answer), and is named by the hash of
that block's tokens up to it, chained to the block before. Such a block keeps its partial names
while it holds those tokens. A hit ending inside a block takes the block itself, once it is free:
the hit's tokens are in it, and the new request writes its own after them (no copy; the block's
other names, which its writes will break, are forgotten then). A name that leaves the cache (its
block handed out again) takes its snapshot with it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from ember.engine.state_slots import StateSlots
from ember.request import Request


@dataclass
class PrefixHit:
    """A cached prefix: its blocks (the last one only partly when num_tokens is not a multiple of the
    block size), and the name of the state snapshot to restore (hybrid models)."""

    blocks: list[int]
    num_tokens: int
    snapshot: int | None = None


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of them found in the cache


def hash_block(parent_hash: int | None, tokens: tuple[int, ...]) -> int:
    return hash((parent_hash, tokens))


class KVCacheManager:
    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, states: StateSlots | None = None
    ):
        """states: a hybrid model's recurrent-state slots, handed out and cached with the blocks."""
        self.states = states
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.hash_to_block: dict[int, int] = {}
        self.free_queue: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        # partial blocks (hybrid models): name -> (parent hash, block, tokens), and the names by parent and by block
        self.partial: dict[int, tuple[int | None, int, int]] = {}
        self.partial_by_parent: dict[int | None, set[int]] = {}
        self.partial_by_block: dict[int, set[int]] = {}
        self.stats = PrefixCacheStats()

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- prefix cache -------------------------------------------------------------------
    def find_cached_prefix(self, request: Request) -> PrefixHit:
        """The longest cached prefix of the request's tokens (no refs taken).

        At most num_tokens - 1 tokens are served from cache: the last token must run through
        the model to produce logits. A hybrid's hit ends where a state snapshot is: inside the
        block after the full ones (a free partial block with a snapshot), else at the deepest full
        block with one.
        """
        if not self.enable_prefix_caching:
            return PrefixHit([], 0)
        bs = self.block_size
        max_blocks = (request.num_tokens - 1) // bs
        hits: list[int] = []
        parent = None
        for i in range(max_blocks):
            parent = hash_block(parent, tuple(request.token_ids[i * bs : (i + 1) * bs]))
            block = self.hash_to_block.get(parent)
            if block is None:
                break
            hits.append(block)
        hit = PrefixHit(hits, len(hits) * bs)
        if self.states is not None:  # skip only tokens whose recurrent state can be restored
            hit = self._partial_hit(request, hits) or self._block_hit(hits)
        self.stats.queries += request.num_tokens
        self.stats.hits += hit.num_tokens
        return hit

    def _block_hit(self, hits: list[int]) -> PrefixHit:
        n = self.states.usable_hit([self.block_hash[b] for b in hits])
        return PrefixHit(hits[:n], n * self.block_size, self.block_hash[hits[n - 1]] if n else None)

    def _partial_hit(self, request: Request, hits: list[int]) -> PrefixHit | None:
        """The deepest free partial block with a snapshot that continues the full-block hits."""
        start = len(hits) * self.block_size
        parent = self.block_hash[hits[-1]] if hits else None
        best = None
        for name in self.partial_by_parent.get(parent, ()):
            _, block, n = self.partial[name]
            if (
                start + n < request.num_tokens
                and (best is None or n > best[1])
                and self.ref_counts[block] == 0
                and self.states.has(name)
                and hash_block(parent, tuple(request.token_ids[start : start + n])) == name
            ):
                best = (name, n, block)
        if best is None:
            return None
        name, n, block = best
        return PrefixHit([*hits, block], start + n, name)

    def prefix_name(self, request: Request, p: int) -> int | None:
        """The name of the request's first p computed tokens: its block hash at a block boundary, else
        the partial block's (registered here); None while they are not all computed and hashed."""
        bs = self.block_size
        if p < 1 or p > min(request.num_computed_tokens, request.num_tokens) or len(request.block_hashes) < p // bs:
            return None
        if p % bs == 0:
            return request.block_hashes[p // bs - 1]
        parent = request.block_hashes[p // bs - 1] if p >= bs else None
        name = hash_block(parent, tuple(request.token_ids[p - p % bs : p]))
        if name not in self.partial:
            block = request.block_ids[p // bs]
            self.partial[name] = (parent, block, p % bs)
            self.partial_by_parent.setdefault(parent, set()).add(name)
            self.partial_by_block.setdefault(block, set()).add(name)
        return name

    def cache_full_blocks(self, request: Request) -> None:
        """Name every block of the request whose tokens are all computed.

        Only positions below num_computed_tokens hold K/V of the request's real tokens: a
        rejected draft's K/V sits past it (and is overwritten later), so it is never named. An
        accepted draft counts as computed before it is appended to token_ids: its block is
        named on the next call."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        num_full = min(request.num_computed_tokens, request.num_tokens) // bs
        for i in range(len(request.block_hashes), num_full):
            parent = request.block_hashes[-1] if request.block_hashes else None
            h = hash_block(parent, tuple(request.token_ids[i * bs : (i + 1) * bs]))
            request.block_hashes.append(h)
            block = request.block_ids[i]
            if self.block_hash[block] is None and h not in self.hash_to_block:
                self.block_hash[block] = h
                self.hash_to_block[h] = block
        if self.states is not None:
            self.states.settle(request, lambda p: self.prefix_name(request, p))

    # -- allocation -----------------------------------------------------------------------
    def allocate_slots(self, request: Request, num_new_tokens: int, hit: PrefixHit | None = None) -> bool:
        """Make room for num_new_tokens beyond the computed (and newly cached: hit) tokens.

        Returns False, changing nothing, when the pool cannot supply the blocks.
        """
        cached_blocks = hit.blocks if hit is not None else []
        total = request.num_computed_tokens + (hit.num_tokens if hit is not None else 0) + num_new_tokens
        have = len(request.block_ids) + len(cached_blocks)
        need_new = max(0, self.blocks_needed(total) - have)
        # Cached blocks that sit in the free queue stop being free once taken.
        revived = sum(1 for b in cached_blocks if self.ref_counts[b] == 0)
        if need_new + revived > self.num_free_blocks:
            return False
        if self.states is not None and not self.states.acquire(request):
            return False
        partial = hit.num_tokens % self.block_size if hit is not None else 0
        for i, b in enumerate(cached_blocks):
            if self.ref_counts[b] == 0:
                del self.free_queue[b]
            self.ref_counts[b] += 1
            request.block_ids.append(b)
            if partial and i == len(cached_blocks) - 1:  # ours now: its tokens past the hit will be ours
                self._forget_hash(b, keep_up_to=partial)
            else:
                request.block_hashes.append(self.block_hash[b])
        for _ in range(need_new):
            b, _ = self.free_queue.popitem(last=False)
            self._forget_hash(b)
            self.ref_counts[b] = 1
            request.block_ids.append(b)
        if self.states is not None:
            if hit is not None and hit.snapshot is not None:
                self.states.restore(request, hit.snapshot)
            start = total - num_new_tokens
            self.states.plan(request, start, num_new_tokens)
        return True

    def free(self, request: Request) -> None:
        # a hybrid keeps the state after its computed tokens, named while its blocks still say what they hold
        end = self.prefix_name(request, request.num_computed_tokens) if self._keeps_ends() else None
        for b in reversed(request.block_ids):
            self.ref_counts[b] -= 1
            assert self.ref_counts[b] >= 0, f"block {b} freed twice"
            if self.ref_counts[b] == 0:
                self.free_queue[b] = None
        request.block_ids = []
        request.block_hashes = []
        if self.states is not None:
            self.states.release(request, end)

    def _keeps_ends(self) -> bool:
        return self.enable_prefix_caching and self.states is not None and self.states.num_snapshots > 0

    def _forget_hash(self, block: int, keep_up_to: int = 0) -> None:
        """The block is handed out again: its names (and their snapshots) leave the cache, all but the
        partial names of at most keep_up_to tokens (which its new owner leaves as they are)."""
        h = self.block_hash[block]
        if h is not None:
            self.block_hash[block] = None
            if self.hash_to_block.get(h) == block:
                del self.hash_to_block[h]
                if self.states is not None:
                    self.states.forget(h)
        for name in list(self.partial_by_block.get(block, ())):
            parent, _, n = self.partial[name]
            if n > keep_up_to:
                del self.partial[name]
                _discard(self.partial_by_block, block, name)
                _discard(self.partial_by_parent, parent, name)
                self.states.forget(name)

    def reset_prefix_cache(self) -> None:
        for b in range(self.num_blocks):
            if self.ref_counts[b] == 0:
                self._forget_hash(b)
        if self.states is not None:
            self.states.reset()


def _discard(index: dict, key, name: int) -> None:
    names = index[key]
    names.discard(name)
    if not names:
        del index[key]
