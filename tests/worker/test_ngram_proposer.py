"""The n-gram (prompt lookup) proposer."""

import numpy as np

from services.worker.ngram_proposer import NgramProposer
from shared.config import SpeculativeConfig


def propose(tokens, k=3, min_n=2, max_n=4):
    proposer = NgramProposer(SpeculativeConfig("ngram", k, min_n, max_n))
    return proposer.propose(np.array(tokens, dtype=np.int64)).tolist()


def test_the_tokens_after_an_earlier_occurrence_of_the_suffix_are_proposed():
    assert propose([1, 2, 3, 4, 5, 6, 9, 2, 3]) == [4, 5, 6]
    assert propose([1, 2, 3, 4, 9, 2, 3], k=5) == [4, 9, 2, 3]  # up to the end of the tokens


def test_the_longest_n_gram_wins_then_the_latest_occurrence():
    # "2 3" follows 8 at the start, "1 2 3" is followed by 5: the longer match decides.
    assert propose([2, 3, 8, 1, 2, 3, 5, 0, 1, 2, 3]) == [5, 0, 1]
    # The same bigram twice: the latest occurrence decides.
    assert propose([2, 3, 8, 8, 2, 3, 7, 7, 0, 2, 3], k=2) == [7, 7]


def test_nothing_is_proposed_without_a_match_or_below_min_n():
    assert propose([1, 2, 3, 4, 5]) == []
    assert propose([5, 1, 7, 9, 5]) == []  # a unigram match is below prompt_lookup_min
    assert propose([5, 1, 7, 9, 5], min_n=1) == [1, 7, 9]
    assert propose([4]) == [] and propose([]) == []
