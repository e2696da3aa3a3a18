"""KV block pool: free list, ref counts, and a prefix cache of full blocks (plain Python).

A full block is named by a chained hash (parent block's hash, its tokens), so equal prefixes
map to equal block chains. A freed block keeps its hash and sits in the free queue: it is
both free and a cache entry until it is handed out again. The free queue is LRU: blocks go
to its back when freed (the tail of a sequence first, so its head survives longer) and are
taken from its front.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from ember.engine.state_slots import StateSlots
from ember.request import Request


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
    def find_cached_prefix(self, request: Request) -> list[int]:
        """Blocks holding the longest cached prefix of the request's tokens (no refs taken).

        At most num_tokens - 1 tokens are served from cache: the last token must run through
        the model to produce logits.
        """
        if not self.enable_prefix_caching:
            return []
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
        if self.states is not None:  # skip only tokens whose recurrent state can be restored
            hits = hits[: self.states.usable_hit([self.block_hash[b] for b in hits])]
        self.stats.queries += request.num_tokens
        self.stats.hits += len(hits) * bs
        return hits

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
            self.states.settle(request, request.block_hashes)

    # -- allocation -----------------------------------------------------------------------
    def allocate_slots(self, request: Request, num_new_tokens: int, cached_blocks: list[int] = ()) -> bool:
        """Make room for num_new_tokens beyond the computed (and newly cached) tokens.

        Returns False, changing nothing, when the pool cannot supply the blocks.
        """
        total = request.num_computed_tokens + len(cached_blocks) * self.block_size + num_new_tokens
        have = len(request.block_ids) + len(cached_blocks)
        need_new = max(0, self.blocks_needed(total) - have)
        # Cached blocks that sit in the free queue stop being free once taken.
        revived = sum(1 for b in cached_blocks if self.ref_counts[b] == 0)
        if need_new + revived > self.num_free_blocks:
            return False
        if self.states is not None and not self.states.acquire(request):
            return False
        for b in cached_blocks:
            if self.ref_counts[b] == 0:
                del self.free_queue[b]
            self.ref_counts[b] += 1
            request.block_ids.append(b)
            request.block_hashes.append(self.block_hash[b])
        for _ in range(need_new):
            b, _ = self.free_queue.popitem(last=False)
            self._forget_hash(b)
            self.ref_counts[b] = 1
            request.block_ids.append(b)
        if self.states is not None:
            if cached_blocks:
                self.states.restore(request, self.block_hash[cached_blocks[-1]])
            start = total - num_new_tokens
            self.states.plan(request, start, num_new_tokens)
        return True

    def free(self, request: Request) -> None:
        for b in reversed(request.block_ids):
            self.ref_counts[b] -= 1
            assert self.ref_counts[b] >= 0, f"block {b} freed twice"
            if self.ref_counts[b] == 0:
                self.free_queue[b] = None
        request.block_ids = []
        request.block_hashes = []
        if self.states is not None:
            self.states.release(request)

    def _forget_hash(self, block: int) -> None:
        h = self.block_hash[block]
        if h is not None:
            self.block_hash[block] = None
            if self.hash_to_block.get(h) == block:
                del self.hash_to_block[h]

    def reset_prefix_cache(self) -> None:
        for b in range(self.num_blocks):
            if self.ref_counts[b] == 0:
                self._forget_hash(b)
        if self.states is not None:
            self.states.reset()
