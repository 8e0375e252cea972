from kvyard.engine.request import Request
from kvyard.sampling_params import SamplingParams
from kvyard.spec.ngram import NgramProposer, lookup


def test_lookup_copies_what_followed_the_latest_match():
    assert lookup([1, 2, 3, 4, 5, 1, 2, 3], 1, 4, 3) == [4, 5, 1]
    # Two earlier occurrences of (7, 8): the later one is preferred.
    assert lookup([7, 8, 1, 7, 8, 2, 3, 4, 7, 8], 2, 2, 2) == [2, 3]


def test_lookup_prefers_longer_ngrams_and_falls_back_to_shorter():
    # The tail (2, 9) never occurred; its last token 9 did, followed by 5.
    assert lookup([9, 5, 6, 2, 9], 1, 3, 2) == [5, 6]
    # (1, 2) occurs followed by 3; the 1-gram (2) occurs later followed by 8, but the 2-gram wins.
    assert lookup([1, 2, 3, 0, 2, 8, 1, 2], 1, 2, 1) == [3]


def test_lookup_finds_nothing_or_a_short_continuation():
    assert lookup([1, 2, 3], 1, 4, 3) == []
    assert lookup([5], 1, 4, 3) == []
    assert lookup([1, 2, 9, 1, 2], 3, 4, 2) == []  # no 3-gram repeats
    # A match right before the tail has a short continuation; an earlier one continues for k tokens.
    assert lookup([4, 4, 4, 4], 1, 1, 3) == [4, 4, 4]


def test_proposer_respects_the_requested_length_per_request():
    p = NgramProposer(min_n=1, max_n=3)
    a = Request("a", [1, 2, 3, 4, 1, 2], SamplingParams())
    b = Request("b", [1, 2, 3, 4, 1, 2], SamplingParams())
    c = Request("c", [9, 8, 7], SamplingParams())
    out = p.propose([a, b, c], {"a": 2, "b": 0, "c": 3})
    assert out == {"a": [3, 4]}
