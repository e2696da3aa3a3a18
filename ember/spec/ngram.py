"""N-gram (prompt lookup) proposer: no weights, drafts copied from the request's own tokens.

For n from prompt_lookup_max down to prompt_lookup_min, take the last n tokens of prompt +
output; if they occurred earlier, propose the tokens that followed their most recent earlier
occurrence (up to k). The longest n that matches wins: a longer context is a better guess.
Code, quoted documents and repetitive output are where this pays.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from ember.request import Draft
from ember.spec.proposer import Proposer

if TYPE_CHECKING:
    from ember.config.speculative import SpeculativeConfig
    from ember.spec.proposer import ProposerContext


def ngram_lookup(tokens: np.ndarray, k: int, n_min: int, n_max: int) -> list[int]:
    """Up to k tokens that followed the most recent earlier occurrence of the longest suffix n-gram."""
    L = len(tokens)
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        # Windows starting at 0..L-n-1: each is followed by at least one token, and none is the suffix itself.
        windows = sliding_window_view(tokens[: L - 1], n)
        hits = np.flatnonzero((windows == tokens[L - n :]).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            return tokens[start : start + k].tolist()
    return []


class NgramProposer(Proposer):
    def __init__(self, spec: SpeculativeConfig, ctx: ProposerContext | None = None):
        self.n_min = spec.prompt_lookup_min
        self.n_max = spec.prompt_lookup_max

    def propose(self, requests: Sequence[Any], max_tokens: Sequence[int]) -> list[Draft | None]:
        out: list[Draft | None] = []
        for req, k in zip(requests, max_tokens):
            ids = ngram_lookup(np.asarray(req.token_ids, dtype=np.int64), k, self.n_min, self.n_max)
            out.append(Draft(ids) if ids else None)
        return out
