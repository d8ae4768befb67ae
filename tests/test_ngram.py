"""The n-gram matcher on plain token lists."""

import pytest

from verispec import InvalidRequest, NgramDrafter


def test_longest_suffix_match_wins():
    d = NgramDrafter(min_n=1, max_n=3)
    #      0  1  2  3  4  5  6  7  8  9
    ctx = [5, 1, 2, 9, 7, 2, 8, 1, 2]  # suffix (1, 2) occurred at 1..2 -> continuation 9, 7, ...
    assert d.match(ctx, 3) == (2, [9, 7, 2])


def test_most_recent_occurrence_is_preferred():
    d = NgramDrafter(min_n=1, max_n=2)
    ctx = [3, 4, 10, 3, 4, 11, 3, 4]
    assert d.match(ctx, 1) == (2, [11])


def test_continuation_is_capped_at_k_and_at_the_end_of_context():
    d = NgramDrafter(min_n=1, max_n=2)
    assert d.match([1, 2, 3, 4, 5, 1, 2], 10) == (2, [3, 4, 5, 1, 2])
    d.reset()
    assert d.match([1, 2, 3, 4, 5, 1, 2], 2) == (2, [3, 4])


def test_no_match_proposes_nothing():
    d = NgramDrafter(min_n=2, max_n=3)
    assert d.match([1, 2, 3, 4], 5) == (0, [])
    assert len(d.propose([1, 2, 3, 4], 5)) == 0
    # a 1-gram match exists but min_n=2 ignores it
    assert d.match([1, 2, 3, 1], 5) == (0, [])
    d1 = NgramDrafter(min_n=1, max_n=3)
    assert d1.match([1, 2, 3, 1], 5) == (1, [2, 3, 1])


def test_incremental_growth_matches_a_fresh_index():
    ctx = [7, 1, 2, 3, 7, 1, 2, 4, 7, 1]
    grown = NgramDrafter(min_n=1, max_n=3)
    for end in range(1, len(ctx) + 1):
        fresh = NgramDrafter(min_n=1, max_n=3)
        assert grown.match(ctx[:end], 4) == fresh.match(ctx[:end], 4)


def test_context_that_is_not_an_extension_rebuilds_the_index():
    d = NgramDrafter(min_n=1, max_n=2)
    assert d.match([1, 2, 3, 1, 2], 2) == (2, [3, 1])
    assert d.match([4, 5, 6, 4], 2) == (1, [5, 6])


def test_confidence_grows_with_the_match_length():
    d = NgramDrafter(min_n=1, max_n=3)
    short = d.propose([7, 1, 9, 8, 1], 2)  # only the 1-gram "1" matched
    long = d.propose([5, 6, 7, 1, 5, 6, 7], 2)  # the 3-gram "5 6 7" matched
    assert short.tokens == [9, 8] and long.tokens == [1, 5]
    assert short.confidence == [0.5, 0.5] and long.confidence == [0.75, 0.75]


def test_reset_forgets_the_sequence():
    d = NgramDrafter()
    d.match([1, 2, 3, 1, 2], 2)
    d.reset()
    assert d.match([9, 8], 2) == (0, [])


@pytest.mark.parametrize("kwargs", [dict(min_n=0), dict(min_n=3, max_n=2), dict(min_n=1.5), dict(max_n="4")])
def test_bad_configuration_is_rejected(kwargs):
    with pytest.raises(InvalidRequest):
        NgramDrafter(**kwargs)


def test_branches_merge_several_earlier_continuations_into_one_tree():
    d = NgramDrafter(min_n=1, max_n=2, branches=3)
    ctx = [1, 2, 3, 9, 1, 2, 4, 9, 1, 2, 5, 1, 2]
    assert d.continuations(ctx, 2) == [[5, 1], [4, 9], [3, 9]]  # the most recent match first
    draft = d.propose(ctx, 5)
    assert draft.tokens == [5, 1, 2, 4, 9] and draft.parents == [-1, 0, 1, -1, 3] and draft.probs is None
    shared = NgramDrafter(min_n=1, max_n=1, branches=2).propose([7, 8, 9, 7, 8, 6, 7], 4)
    assert shared.tokens == [8, 6, 7, 9] and shared.parents == [-1, 0, 1, 0]  # the common first token is one node
    with pytest.raises(InvalidRequest, match="branches"):
        NgramDrafter(branches=0)


def test_follow_matches_past_the_context_without_indexing_the_tail():
    """``follow`` (the engine's padding filler): the longest suffix n-gram of context + tail, looked up in the
    context's index; the tail is never indexed, so the next call on the grown context indexes it normally."""
    d = NgramDrafter(min_n=1, max_n=3)
    ctx = [5, 1, 2, 9, 7, 2, 8, 4]
    assert d.follow(ctx, [], 2) == []  # 4 never occurred before
    assert d.follow(ctx, [1, 2], 3) == [9, 7, 2]  # (1, 2) after the tail: what followed it at 1..2
    assert d.follow(ctx, [7], 2) == [2, 8]  # a 1-gram
    assert d.follow(ctx, [3], 2) == []
    grown = [*ctx, 1, 2]
    assert d.match(grown, 3) == NgramDrafter(min_n=1, max_n=3).match(grown, 3) == (2, [9, 7, 2])
