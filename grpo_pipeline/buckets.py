"""Length buckets: which rows of a micro-batch run their completions together, to cut right padding.

A micro-batch's completions are right-padded to its longest one, and every padded cell costs a full
token of decoder compute (and memory) in forward and backward.  The shared-prompt forward
(``policy._shared_prompt_hidden``) runs the distinct prompts once and can then run the completions
in several passes on the same prompt keys/values, each padded only to its own longest row.  More
passes cost a fixed amount each (kernel launches, weight casts under autocast, smaller matrix
products), so the split is the one that minimises

    cost = sum_b  n_b * C_b  +  overhead * K          (n_b rows of longest length C_b, K passes)

over contiguous runs of the rows sorted by length, K <= ``max_buckets``: exact, by dynamic
programming, O(K B^2) for B rows (B is a micro-batch: tens at most).
"""

from __future__ import annotations

from collections.abc import Sequence


def length_buckets(lengths: Sequence[int], max_buckets: int, overhead: float) -> list[list[int]]:
    """Row indices of ``lengths`` in buckets (each sorted by length, buckets by length): the cheapest split.

    ``overhead``: a pass's fixed cost in padded-token cells.  ``max_buckets = 1`` or one row: one bucket.
    """
    if max_buckets < 1:
        raise ValueError(f"max_buckets must be >= 1, got {max_buckets}")
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    B = len(order)
    if B == 0:
        return []
    K = min(max_buckets, B)
    ls = [lengths[i] for i in order]                                   # ascending
    inf = float("inf")
    # best[k][j]: least cost of the first j rows in k buckets; cut[k][j]: where the last bucket starts
    best = [[inf] * (B + 1) for _ in range(K + 1)]
    cut = [[0] * (B + 1) for _ in range(K + 1)]
    best[0][0] = 0.0
    for k in range(1, K + 1):
        for j in range(1, B + 1):
            for i in range(k - 1, j):                                  # last bucket: rows i .. j-1
                c = best[k - 1][i] + (j - i) * ls[j - 1] + overhead
                if c < best[k][j]:
                    best[k][j], cut[k][j] = c, i
    k = min(range(1, K + 1), key=lambda k: (best[k][B], k))           # fewest passes among the cheapest
    out, j = [], B
    while k:
        i = cut[k][j]
        out.append(order[i:j])
        j, k = i, k - 1
    return out[::-1]


def passes_for(setting: int | None, device_type: str) -> int:
    """The most completion passes per micro-batch: ``update.length_buckets``, or for null 4 on CPU and 1 on
    a GPU (where a pass's fixed cost, many small kernel launches, outweighs the padding it saves)."""
    if setting is not None:
        return setting
    return 1 if device_type == "cuda" else 4


def padded_cells(lengths: Sequence[int], buckets: Sequence[Sequence[int]]) -> int:
    """Completion cells the passes compute: sum over buckets of rows x the bucket's longest length."""
    return sum(len(b) * max(lengths[i] for i in b) for b in buckets if b)
