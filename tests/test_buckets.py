"""Length buckets (grpo_pipeline.buckets): the cheapest split of a micro-batch's rows into completion passes."""

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from grpo_pipeline.buckets import length_buckets, padded_cells, passes_for


def brute_force(lengths, max_buckets, overhead):
    """Least cost over every split of the length-sorted rows into at most ``max_buckets`` contiguous runs."""
    ls = sorted(lengths)
    best = float("inf")
    for k in range(1, min(max_buckets, len(ls)) + 1):
        for cuts in itertools.combinations(range(1, len(ls)), k - 1):
            bounds = [0, *cuts, len(ls)]
            best = min(best, sum((b - a) * ls[b - 1] for a, b in itertools.pairwise(bounds)) + overhead * k)
    return best


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 40), min_size=1, max_size=9), st.integers(1, 5), st.sampled_from([0, 3, 16, 64]))
def test_split_is_the_cheapest_and_a_partition(lengths, max_buckets, overhead):
    buckets = length_buckets(lengths, max_buckets, overhead)
    assert sorted(i for b in buckets for i in b) == list(range(len(lengths)))        # every row once
    assert 1 <= len(buckets) <= max_buckets
    longest = [max(lengths[i] for i in b) for b in buckets]
    assert all(lengths[i] <= lengths[j] for a, c in itertools.pairwise(buckets) for i in a for j in c)  # by length
    assert longest == sorted(longest)
    cost = padded_cells(lengths, buckets) + overhead * len(buckets)
    assert cost == brute_force(lengths, max_buckets, overhead)


def test_overhead_decides_whether_to_split():
    lengths = [10, 11, 12, 100]
    assert length_buckets(lengths, 4, overhead=0) == [[0], [1], [2], [3]]            # padding is all that counts
    assert length_buckets(lengths, 4, overhead=50) == [[0, 1, 2], [3]]               # 3 x 88 cells saved > 50
    assert length_buckets(lengths, 4, overhead=10_000) == [[0, 1, 2, 3]]             # one pass
    assert length_buckets(lengths, 1, overhead=0) == [[0, 1, 2, 3]]
    assert padded_cells(lengths, [[0, 1, 2], [3]]) == 3 * 12 + 100 < padded_cells(lengths, [[0, 1, 2, 3]]) == 400


def test_edge_cases():
    assert length_buckets([], 4, 8) == []
    assert length_buckets([5], 4, 0) == [[0]]
    assert length_buckets([3, 3, 3], 3, 0) == [[0, 1, 2]]                              # no gain: fewest passes
    with pytest.raises(ValueError, match="max_buckets"):
        length_buckets([1, 2], 0, 0)
    assert passes_for(None, "cpu") == 4 and passes_for(None, "cuda") == 1 and passes_for(2, "cuda") == 2
