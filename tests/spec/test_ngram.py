"""Prompt lookup: the longest suffix n-gram seen before, its most recent occurrence, up to k tokens."""

import numpy as np

from ember.config.speculative import SpeculativeConfig
from ember.request import Request
from ember.spec.ngram import NgramProposer, ngram_lookup


def look(tokens, k=3, lo=1, hi=3):
    return ngram_lookup(np.array(tokens), k, lo, hi)


def test_proposes_what_followed_the_suffix():
    assert look([1, 2, 3, 4, 5, 1, 2]) == [3, 4, 5]
    assert look([1, 2, 3, 4, 5, 1, 2], k=2) == [3, 4]
    assert look([1, 2, 3, 1, 2], k=5) == [3, 1, 2]  # the continuation may run into the suffix itself


def test_longest_ngram_wins_over_a_more_recent_shorter_one():
    # suffix "8 9 2": the 3-gram occurred at the start (-> 7); "9 2" alone more recently (-> 5)
    toks = [8, 9, 2, 7, 0, 9, 2, 5, 8, 9, 2]
    assert look(toks, k=1) == [7]
    assert look(toks, k=1, hi=2) == [5]  # capped at 2-grams: the most recent "9 2"


def test_most_recent_occurrence_of_the_same_ngram():
    assert look([4, 6, 1, 4, 6, 2, 4, 6], k=1, lo=2, hi=2) == [2]


def test_no_match_below_min_or_in_a_short_sequence():
    assert look([1, 2, 3, 4], lo=1) == []
    assert look([1, 2, 9, 5, 2], lo=2, hi=3) == []  # only the 1-gram "2" matches
    assert look([7]) == []
    assert look([7, 7]) == [7]


def test_proposer_per_request():
    spec = SpeculativeConfig("ngram", 4, prompt_lookup_min=2, prompt_lookup_max=4)
    a = Request("a", [5, 6, 7, 8, 5, 6], None)
    b = Request("b", [1, 2, 3], None)
    drafts = NgramProposer(spec).propose([a, b], [2, 4])
    assert drafts[0].token_ids == [7, 8] and drafts[0].probs is None
    assert drafts[1] is None
