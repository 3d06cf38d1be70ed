"""Tests for grpo_pipeline.advantages against the spec's numbers and straightforward loop references."""

from __future__ import annotations

import math

import numpy as np
import polars as pl
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from grpo_pipeline.advantages import (
    ESTIMATORS,
    NORMALISERS,
    compute_advantages,
    group_codes,
    normalise_grouped,
    pad_step_advantages,
    token_advantages_batched,
    token_advantages_from_steps,
)
from grpo_pipeline.config import AdvantageConfig

STDS = ["population", "sample", "batch", "none"]
STEP = pl.Struct({"start": pl.Int32, "end": pl.Int32, "reward": pl.Float64})


def frame(groups: dict[str, list[float | None]]) -> pl.DataFrame:
    """One row per reward, groups written contiguously, sample_idx 0..G-1."""
    rows = [(pid, i, r) for pid, rs in groups.items() for i, r in enumerate(rs)]
    return pl.DataFrame(rows, schema={"prompt_id": pl.String, "sample_idx": pl.Int32, "reward": pl.Float64},
                        orient="row")


def advantages(groups: dict[str, list[float | None]], **cfg) -> dict[str, list[float]]:
    out, _ = compute_advantages(frame(groups), AdvantageConfig(**cfg))
    return {pid: out.filter(pl.col("prompt_id") == pid)["advantage"].to_list() for pid in groups}


def reference(df: pl.DataFrame, std: str, delta: float) -> list[float]:
    """Row-by-row reference written with plain Python loops."""
    rows = df.rows(named=True)
    groups: dict[str, list[float]] = {}
    for row in rows:
        if row["reward"] is not None:
            groups.setdefault(row["prompt_id"], []).append(row["reward"])
    everything = [r for rs in groups.values() for r in rs]
    batch_mean = sum(everything) / len(everything) if everything else 0.0
    batch_std = math.sqrt(sum((r - batch_mean) ** 2 for r in everything) / len(everything)) if everything else 0.0
    out = []
    for row in rows:
        rs = groups.get(row["prompt_id"], [])
        if row["reward"] is None or len(set(rs)) <= 1:
            out.append(0.0)
            continue
        m = sum(rs) / len(rs)
        ss = sum((r - m) ** 2 for r in rs)
        divisor = {"population": math.sqrt(ss / len(rs)) + delta, "sample": math.sqrt(ss / (len(rs) - 1)) + delta,
                   "batch": batch_std + delta, "none": 1.0}[std]
        out.append((row["reward"] - m) / divisor)
    return out


# --------------------------------------------------------------------------- the spec's example
def test_spec_worked_example():
    r = np.array([2.0, 2.0, 2.0, 1.0])
    adv, g = normalise_grouped(r, np.zeros(4, np.int64), np.ones(4, bool), 1, std="population", delta=1e-8)
    assert g.mean[0] == pytest.approx(1.75)
    assert math.sqrt(np.mean(g.dev**2)) == pytest.approx(0.433, abs=1e-3)  # spec: sqrt(0.1875) ~ 0.43
    assert adv.tolist() == pytest.approx([0.577, 0.577, 0.577, -1.732], abs=1e-3)  # spec: 0.58, -1.74 (rounded std)
    assert advantages({"q": [2, 2, 2, 1]}, delta=1e-8)["q"] == pytest.approx(adv.tolist())


# --------------------------------------------------------------------------- properties
group_rewards = st.lists(st.integers(-8, 8).map(lambda k: k / 4), min_size=2, max_size=10)


@settings(max_examples=60, deadline=None)
@given(rs=group_rewards, delta=st.sampled_from([0.0, 1e-4, 1e-2]))
def test_mean_zero_population_std_one(rs, delta):
    assume(len(set(rs)) > 1)
    a = np.array(advantages({"q": rs}, delta=delta)["q"])
    std = float(np.std(rs))
    assert abs(a.mean()) < 1e-12
    assert a.std() == pytest.approx(std / (std + delta), rel=1e-12)  # = 1 up to the delta shrinkage
    assert abs(a.std() - 1) <= delta / std + 1e-12


@settings(max_examples=60, deadline=None)
@given(rs=group_rewards, a=st.floats(0.01, 100), b=st.floats(-100, 100), std=st.sampled_from(["population", "sample"]))
def test_affine_invariance(rs, a, b, std):
    before = advantages({"q": rs}, std=std, delta=0.0)["q"]
    after = advantages({"q": [a * r + b for r in rs]}, std=std, delta=0.0)["q"]
    assert after == pytest.approx(before, abs=1e-9)


@settings(max_examples=40, deadline=None)
@given(g1=group_rewards, g2=group_rewards, g2_new=group_rewards, std=st.sampled_from(["population", "sample", "none"]))
def test_groups_are_independent(g1, g2, g2_new, std):
    first = advantages({"a": g1, "b": g2}, std=std)["a"]
    again = advantages({"a": g1, "b": g2_new}, std=std)["a"]
    assert first == again  # bit for bit


@settings(max_examples=40, deadline=None)
@given(rs=group_rewards, data=st.data(), std=st.sampled_from(STDS))
def test_permutation_within_group_permutes_advantages(rs, data, std):
    perm = data.draw(st.permutations(range(len(rs))))
    a = advantages({"q": rs, "other": [0.0, 1.0]}, std=std)["q"]
    b = advantages({"q": [rs[i] for i in perm], "other": [0.0, 1.0]}, std=std)["q"]
    assert b == pytest.approx([a[i] for i in perm], abs=1e-12)


# --------------------------------------------------------------------------- edge cases
@pytest.mark.parametrize("std", STDS)
@pytest.mark.parametrize("delta", [0.0, 1e-4])
@pytest.mark.parametrize("value", [0.1, 1.0, -3.7, 0.0])
def test_all_equal_group_is_zero_never_nan(std, delta, value):
    # 0.1 * 3 / 3 != 0.1 in floats: a std computed from the mean would be tiny, not 0
    groups = {"q": [value] * 3, "with_nulls": [value, None, value, value, None], "all_equal_too": [5.0, 5.0]}
    out = advantages(groups, std=std, delta=delta)
    assert out == {"q": [0.0] * 3, "with_nulls": [0.0] * 5, "all_equal_too": [0.0, 0.0]}


@pytest.mark.parametrize("std", STDS)
def test_null_rewards_masked_and_left_out(std):
    df = frame({"q": [1.0, None, 3.0, None], "all_null": [None, None], "single": [None, 4.0], "r": [0.0, 1.0]})
    out, metrics = compute_advantages(df, AdvantageConfig(std=std, delta=0.0))
    assert out["adv_mask"].to_list() == [True, False, True, False, False, False, False, True, True, True]
    assert out["advantage"].to_list() == pytest.approx(reference(df, std, 0.0))
    adv = out["advantage"].to_list()
    assert adv[1] == adv[3] == adv[4] == adv[5] == adv[6] == adv[7] == 0.0
    if std in ("population", "none"):  # stats over [1, 3] only: mean 2, population std 1
        assert adv[0] == -1.0 and adv[2] == 1.0
    assert metrics["advantage/masked_rows"] == 5
    assert metrics["advantage/groups"] == 4
    assert metrics["advantage/zero_std_group_share"] == 0.5  # all_null and single


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nan_reward_names_the_row(bad):
    df = frame({"q0": [1.0, None], "q1": [0.0, 1.0, bad, bad]})
    with pytest.raises(ValueError, match=r"prompt_id='q1', sample_idx=2"):
        compute_advantages(df, AdvantageConfig())


@pytest.mark.parametrize(
    ("df", "match"),
    [
        (pl.DataFrame({"prompt_id": ["a"], "sample_idx": [0]}), "lacks column 'reward'"),
        (pl.DataFrame({"prompt_id": ["a"], "sample_idx": [0], "reward": ["1"]}), "'reward' must be numeric"),
        (pl.DataFrame({"prompt_id": [None, "a"], "sample_idx": [0, 1], "reward": [1.0, 2.0]},
                      schema_overrides={"prompt_id": pl.String}), "'prompt_id' is null at row 0"),
    ],
)
def test_bad_frames_name_the_column(df, match):
    with pytest.raises((ValueError, TypeError), match=match):
        compute_advantages(df, AdvantageConfig())


def test_unknown_names_list_valid_ones():
    with pytest.raises(ValueError, match=r"Unknown advantage estimator: 'gae'.*\['grpo', 'process'\]"):
        compute_advantages(frame({"q": [1.0]}), AdvantageConfig.model_construct(estimator="gae", std="none", delta=0))
    with pytest.raises(ValueError, match=r"Unknown advantage std option: 'mad'.*'batch'"):
        normalise_grouped(np.ones(1), np.zeros(1, np.int64), np.ones(1, bool), 1, std="mad", delta=0.0)
    assert sorted(NORMALISERS) == sorted(STDS) and sorted(ESTIMATORS) == ["grpo", "process"]


# --------------------------------------------------------------------------- against the loop reference
def random_scores(seed: int, *, shuffle: bool) -> pl.DataFrame:
    rng = np.random.default_rng(seed)
    sizes = rng.integers(1, 9, size=30)
    pid = np.repeat([f"p{i}" for i in range(sizes.size)], sizes)
    reward = rng.choice([0.0, 0.5, 1.0, 2.0, np.nan], size=pid.size, p=[0.3, 0.1, 0.3, 0.2, 0.1])
    reward[np.repeat(sizes, sizes) == 3] = 1.25  # some constant groups
    df = pl.DataFrame({"prompt_id": pid, "sample_idx": np.concatenate([np.arange(s) for s in sizes]).astype(np.int32),
                       "reward": reward}).with_columns(pl.col("reward").fill_nan(None))
    return df.sample(fraction=1.0, shuffle=True, seed=seed) if shuffle else df


@pytest.mark.parametrize("std", STDS)
@pytest.mark.parametrize("delta", [0.0, 1e-4, 0.3])
@pytest.mark.parametrize("shuffle", [False, True], ids=["contiguous", "interleaved"])
@pytest.mark.parametrize("seed", [0, 1])
def test_matches_loop_reference(std, delta, shuffle, seed):
    df = random_scores(seed, shuffle=shuffle)
    out, metrics = compute_advantages(df, AdvantageConfig(std=std, delta=delta))
    assert out["prompt_id"].to_list() == df["prompt_id"].to_list()  # row order kept
    assert out["advantage"].to_list() == pytest.approx(reference(df, std, delta), abs=1e-12)
    assert out["adv_mask"].to_list() == df["reward"].is_not_null().to_list()
    mask = out["adv_mask"].to_numpy()
    assert metrics["advantage/abs_mean"] == pytest.approx(np.abs(out["advantage"].to_numpy()[mask]).mean())


@pytest.mark.parametrize(
    "keys",
    [["a", "a", "b", "b", "b"], ["a", "b", "a", "c", "b"], ["x"], ["b", "a", "b"], []],
)
def test_group_codes_are_dense_and_exact(keys):
    codes, n = group_codes(pl.Series(keys, dtype=pl.String))
    assert n == len(set(keys)) and sorted(set(codes.tolist())) == list(range(n))
    for i in range(len(keys)):
        for j in range(len(keys)):
            assert (codes[i] == codes[j]) == (keys[i] == keys[j])


# --------------------------------------------------------------------------- process supervision
def process_frame() -> pl.DataFrame:
    return pl.DataFrame(
        {
            "prompt_id": ["q", "q", "other"],
            "sample_idx": [0, 1, 0],
            "reward": [1.0, 0.0, 1.0],
            "steps": [
                [{"start": 0, "end": 6, "reward": 1.0}, {"start": 6, "end": 14, "reward": 1.0}],
                [{"start": 0, "end": 5, "reward": 0.0}, {"start": 5, "end": 9, "reward": None},
                 {"start": 9, "end": 13, "reward": 0.0}],
                None,
            ],
        },
        schema_overrides={"sample_idx": pl.Int32, "steps": pl.List(STEP)},
    )


def test_process_hand_example():
    # Group "q": output 0 has 2 steps (rewards 1, 1), output 1 has 3 steps (0, null, 0).
    # R = {1, 1, 0, 0} (the null is left out): mean(R) = 0.5, population std(R) = 0.5.
    # With delta = 0: r~ = (r - 0.5) / 0.5 -> output 0: [+1, +1]; output 1: [-1, 0 (null), -1].
    # First-token advantages: output 0: 1 + 1 = 2; output 1: -1 + 0 - 1 = -2.
    # Group "other" has steps = null: advantage 0, masked.
    out, metrics = compute_advantages(process_frame(), AdvantageConfig(estimator="process", delta=0.0))
    assert out["advantage"].to_list() == [2.0, -2.0, 0.0]
    assert out["adv_mask"].to_list() == [True, True, False]
    steps = out["step_advantages"].to_list()
    assert steps[0] == [{"end": 6, "value": 1.0}, {"end": 14, "value": 1.0}]
    assert steps[1] == [{"end": 5, "value": -1.0}, {"end": 9, "value": 0.0}, {"end": 13, "value": -1.0}]
    assert steps[2] == []
    assert metrics["advantage/steps"] == 5 and metrics["advantage/masked_rows"] == 1

    # Token expansion, output 0: token ends [4, 8, 14, 20] -> token starts [0, 4, 8, 14].
    #   token 0 (start 0 < 6 and < 14): 1 + 1 = 2; token 1 (start 4 < 6, straddles step 1's end): 2;
    #   token 2 (start 8, only < 14): 1; token 3 (start 14, after the last step, e.g. <answer>): 0.
    assert token_advantages_from_steps([6, 14], [1.0, 1.0], np.array([4, 8, 14, 20])).tolist() == [2, 2, 1, 0]
    # Output 1: token ends [5, 9, 13, 18] -> starts [0, 5, 9, 13]:
    #   token 0: -1 + 0 - 1 = -2; token 1 (start 5: steps ending at 9, 13): 0 - 1 = -1; token 2: -1; token 3: 0.
    assert token_advantages_from_steps([5, 9, 13], [-1.0, 0.0, -1.0], np.array([5, 9, 13, 18])).tolist() == [
        -2, -1, -1, 0]
    # The same through the batched path, straight from the output column.
    ends, vals, mask = pad_step_advantages(out["step_advantages"])
    tok = np.array([[4, 8, 14, 20], [5, 9, 13, 18], [3, 6, 9, 12]])
    got = token_advantages_batched(ends, vals, tok, step_mask=mask)
    assert got.tolist() == [[2, 2, 1, 0], [-2, -1, -1, 0], [0, 0, 0, 0]]


def test_process_without_any_step_rewards():
    df = process_frame().with_columns(pl.Series("steps", [None, [], None], dtype=pl.List(STEP)))
    out, metrics = compute_advantages(df, AdvantageConfig(estimator="process", delta=0.0))
    assert out["advantage"].to_list() == [0.0, 0.0, 0.0] and not out["adv_mask"].any()
    assert out["step_advantages"].to_list() == [[], [], []] and metrics["advantage/steps"] == 0


@pytest.mark.parametrize(("std", "divisor"), [("population", 0.5 + 1e-4), ("sample", math.sqrt(1 / 3) + 1e-4),
                                              ("none", 1.0)])
def test_process_std_options(std, divisor):
    out, _ = compute_advantages(process_frame(), AdvantageConfig(estimator="process", std=std))
    # R = {1, 1, 0, 0}: deviations +-0.5; sample std = sqrt(4 * 0.25 / 3)
    assert out["advantage"].to_list() == pytest.approx([1.0 / divisor, -1.0 / divisor, 0.0])


def test_process_bad_step_reward_names_row_and_bad_span():
    df = process_frame().with_columns(
        pl.Series("steps", [[{"start": 0, "end": 3, "reward": float("nan")}], None, None], dtype=pl.List(STEP)))
    with pytest.raises(ValueError, match=r"step reward is nan .*prompt_id='q', sample_idx=0"):
        compute_advantages(df, AdvantageConfig(estimator="process"))
    df = process_frame().with_columns(
        pl.Series("steps", [None, [{"start": 4, "end": 3, "reward": 1.0}], None], dtype=pl.List(STEP)))
    with pytest.raises(ValueError, match=r"bad span \[start=4, end=3\).*sample_idx=1"):
        compute_advantages(df, AdvantageConfig(estimator="process"))


def loop_token_advantages(step_ends, step_values, token_ends):
    """The documented rule, literally: token t counts step j iff start_t < end_j."""
    out = []
    for t in range(len(token_ends)):
        start = token_ends[t - 1] if t else 0
        out.append(sum(v for e, v in zip(step_ends, step_values) if start < e))
    return out


completions = st.tuples(
    st.lists(st.tuples(st.integers(0, 40), st.integers(-3, 3).map(float)), max_size=5),
    st.lists(st.integers(0, 6), min_size=1, max_size=12).map(lambda d: np.cumsum(d).tolist()),
)


@settings(max_examples=60, deadline=None)
@given(batch=st.lists(completions, min_size=1, max_size=5))
def test_token_expansion_matches_rule_and_batched(batch):
    k = max(len(s) for s, _ in batch)
    t = max(len(tok) for _, tok in batch)
    ends, vals, mask = np.zeros((len(batch), k), int), np.zeros((len(batch), k)), np.zeros((len(batch), k), bool)
    toks = np.zeros((len(batch), t), int)
    for b, (steps, tok) in enumerate(batch):
        ends[b, : len(steps)] = [e for e, _ in steps]
        vals[b, : len(steps)] = [v for _, v in steps]
        mask[b, : len(steps)] = True
        toks[b, : len(tok)] = tok
        toks[b, len(tok):] = tok[-1]
    got = token_advantages_batched(ends, vals + np.where(mask, 0, 99.0), toks, step_mask=mask)  # padding ignored
    for b, (steps, tok) in enumerate(batch):
        want = loop_token_advantages([e for e, _ in steps], [v for _, v in steps], tok)
        single = token_advantages_from_steps([e for e, _ in steps], [v for _, v in steps], np.array(tok))
        assert single.tolist() == pytest.approx(want)
        assert got[b, : len(tok)].tolist() == pytest.approx(want)


def test_token_expansion_rejects_decreasing_token_ends():
    with pytest.raises(ValueError, match="non-decreasing; first drop at token 2"):
        token_advantages_from_steps([3], [1.0], np.array([2, 5, 4]))
