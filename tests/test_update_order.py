"""Micro-batch order of the update (grpo_pipeline.update.batch_order): groups together, short rows first."""

from __future__ import annotations

import itertools

from hypothesis import given
from hypothesis import strategies as st

from grpo_pipeline.update import Rollout, batch_order


def _rows(lengths: list[list[int]]) -> list[Rollout]:
    return [Rollout([100 + g, 7], [1] * n, 0.0, f"{g}/{k}") for g, group in enumerate(lengths) for k, n in enumerate(group)]


def _padded_cells(rows: list[Rollout], order: list[int], size: int) -> int:
    chunks = [order[k: k + size] for k in range(0, len(order), size)]
    return sum(len(c) * max(len(rows[i].completion_ids) for i in c) for c in chunks)


@given(st.lists(st.lists(st.integers(1, 40), min_size=4, max_size=4), min_size=1, max_size=5),
       st.randoms(use_true_random=False))
def test_groups_stay_together_sorted_by_length_and_pad_no_more(lengths, rnd):
    rows = _rows(lengths)
    given_order = list(range(len(rows)))
    rnd.shuffle(given_order)
    order = batch_order(rows, given_order)
    assert sorted(order) == list(range(len(rows)))
    groups = [rows[i].prompt_ids[0] for i in order]
    assert groups == sorted(groups)                                   # each group contiguous
    for a, b in itertools.pairwise(order):
        if rows[a].prompt_ids == rows[b].prompt_ids:
            assert len(rows[a].completion_ids) <= len(rows[b].completion_ids)
    by_group = sorted(given_order, key=lambda i: (rows[i].prompt_ids, i))   # the previous order
    for size in (2, 4):
        assert _padded_cells(rows, order, size) <= _padded_cells(rows, by_group, size)


def test_a_subset_keeps_only_its_rows():
    rows = _rows([[5, 3, 9, 1], [2, 2, 8, 4]])
    assert batch_order(rows, [6, 0, 1, 3]) == [3, 1, 0, 6]


@given(st.lists(st.lists(st.integers(1, 40), min_size=4, max_size=4), min_size=1, max_size=6),
       st.integers(1, 8))
def test_largest_micro_batch_runs_first_and_none_is_lost(lengths, size):
    from grpo_pipeline.distributed import DistContext
    from grpo_pipeline.update import largest_first, micro_batches

    rows = [Rollout([100 + g] * (1 + g % 3), [1] * n, 0.0, f"{g}/{k}")
            for g, group in enumerate(lengths) for k, n in enumerate(group)]
    plan = micro_batches(batch_order(rows, range(len(rows))), DistContext(), size)
    out = largest_first(rows, plan)
    assert sorted(map(str, out)) == sorted(map(str, plan))           # the same micro-batches, reordered

    def cells(mb):
        prompts = {tuple(rows[i].prompt_ids) for i in mb[0]}
        return len(mb[0]) * max(len(rows[i].completion_ids) for i in mb[0]) + len(prompts) * max(map(len, prompts))

    sizes = [cells(mb) for mb in out]
    assert sizes == sorted(sizes, reverse=True)
    ties = [mb for mb in plan if cells(mb) == sizes[0]]
    assert out[0] == ties[0]                                          # equal ones keep batch order
