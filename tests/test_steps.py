"""Tests for grpo_pipeline.rewards.steps: step spans, sentence splitting, arithmetic and plugged scorers."""

from __future__ import annotations

import sys
import types

import polars as pl
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from grpo_pipeline.config import RewardConfig
from grpo_pipeline.rewards import score_frame
from grpo_pipeline.rewards.steps import STEP_SCORERS, arithmetic_step_scorer, get_step_scorer, split_steps

TERMINATORS = set("。！？!?\n")


def frame(completions, answers=None) -> pl.DataFrame:
    n = len(completions)
    return pl.DataFrame({
        "prompt_id": [f"p{i}" for i in range(n)],
        "sample_idx": pl.Series(range(n), dtype=pl.Int32),
        "completion": pl.Series(completions, dtype=pl.Utf8),
        "answer": pl.Series(answers or ["1"] * n, dtype=pl.Utf8),
    })


def step_texts(completion: str, mode: str) -> list[str]:
    steps = split_steps(pl.Series([completion]), mode=mode)
    return [completion[s:e] for s, e in steps.select("start", "end").iter_rows()]


# --------------------------------------------------------------------------- splitting
@pytest.mark.parametrize(
    ("completion", "mode", "expected"),
    [
        ("<think>5 / 3 = 1.67\n所以每支约1.67元</think><answer>1.67</answer>", "lines", ["5 / 3 = 1.67", "所以每支约1.67元"]),
        ("前言<think>  每个苹果的价格：10 / 4 = 2.5\n\n 找回的钱：20 - 12 = 8 \n</think>", "lines",
         ["每个苹果的价格：10 / 4 = 2.5", "找回的钱：20 - 12 = 8"]),
        ("<think>5 / 3 = 1.67. So each costs 1.67! Done?</think>", "sentences",
         ["5 / 3 = 1.67.", "So each costs 1.67!", "Done?"]),
        ("<think>5元÷3支=1.67元。所以每支约1.67元！对吗？是</think>", "sentences",
         ["5元÷3支=1.67元。", "所以每支约1.67元！", "对吗？", "是"]),
        ("<think>It is 3.5.Then 2.25 more\nnext line</think>", "sentences", ["It is 3.5.", "Then 2.25 more", "next line"]),
        ("<think>unclosed 1 + 1 = 2\nstill thinking", "lines", ["unclosed 1 + 1 = 2", "still thinking"]),
        ("no think block 1 + 1 = 2", "lines", []),
        ("<think></think><answer>1</answer>", "lines", []),
    ],
)
def test_spans_index_the_completion(completion, mode, expected):
    assert step_texts(completion, mode) == expected


def _sentence_oracle(content: str) -> list[str]:
    """Cut after a run of 。！？!?\\n, and after a run of dots not followed by a digit or 。！？!?."""
    pieces, cur = [], ""
    for i, ch in enumerate(content):
        cur += ch
        nxt = content[i + 1] if i + 1 < len(content) else ""
        if (ch in TERMINATORS and nxt not in TERMINATORS) or (
            ch == "." and not (nxt.isdigit() or nxt in "。！？!?.")
        ):
            pieces.append(cur)
            cur = ""
    pieces.append(cur)
    return [p.strip() for p in pieces if p.strip()]


ALPHABET = st.sampled_from(list("ab 12.。！？!?\n中文") + ["1.67", "\t", "  "])


@settings(max_examples=200, deadline=None)
@given(st.lists(ALPHABET, max_size=20).map("".join), st.sampled_from(["", "前缀 ", "x"]), st.booleans())
def test_split_matches_python_oracle(content, prefix, closed):
    completion = f"{prefix}<think>{content}" + ("</think><answer>1</answer>" if closed else "")
    lines = [ln.strip() for ln in content.split("\n") if ln.strip()]
    assert step_texts(completion, "lines") == lines
    assert step_texts(completion, "sentences") == _sentence_oracle(content)
    steps = split_steps(pl.Series([completion]), mode="sentences")
    starts, ends = steps["start"].to_list(), steps["end"].to_list()
    assert all(a < b for a, b in zip(starts, ends, strict=True))
    assert all(e <= s for e, s in zip(ends, starts[1:], strict=False))  # ordered, non-overlapping
    assert all(s >= len(prefix) + len("<think>") for s in starts)


def test_unknown_split_lists_valid():
    with pytest.raises(ValueError, match="lines"):
        split_steps(pl.Series(["<think>a</think>"]), mode="paragraphs")


# --------------------------------------------------------------------------- arithmetic scorer
@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("5 / 3 = 1.67", 1.0),
        ("5 / 3 = 1.7", 1.0),  # rounded to c's one decimal
        ("5 / 3 = 1.6", 0.0),
        ("5 / 3 = 1.666...", 1.0),  # truncated, marked with ...
        ("5 ÷ 3 ≈ 1.67", 1.0),
        ("5元÷3支=1.67元", 1.0),
        ("2 + 2 = 5", 0.0),
        ("2 + 2 = 4 and 3 × 3 = 9", 1.0),
        ("2 + 2 = 4 and 3 × 3 = 10", 0.0),
        ("2 + 3 × 4 = 14", 1.0),  # chain, usual precedence
        ("2 + 3 × 4 = 20", 0.0),
        ("10 - 3 = 7", 1.0),
        ("20-12=8", 1.0),
        ("-3 + 5 = 2", 1.0),
        ("1,000 + 234 = 1,234", 1.0),
        ("7 / 2 = 3", 0.0),  # an integer result is checked exactly
        ("6 / 0 = 0", 0.0),
        ("1/2 + 1/3 = 5/6", 1.0),  # a fraction result, checked exactly
        ("1/2 + 1/3 = 5/7", 0.0),
        ("3x4=12", 1.0),
        ("３ × ５ ＝ １５", 1.0),
        ("$3 * $2 = $6", 1.0),
        ("1.5 * 2 = 3", 1.0),
        ("(2 + 3) × 4 = 20", None),  # parenthesised: not a claim
        ("I think so", None),
        ("x = 5", None),
    ],
)
def test_arithmetic_claims(text, expected):
    assert arithmetic_step_scorer([[text]]) == [[expected]]


def test_arithmetic_scorer_keeps_shape():
    steps = [["1 + 1 = 2", "no claim"], [], ["2 * 2 = 5"]]
    assert arithmetic_step_scorer(steps) == [[1.0, None], [], [0.0]]


def test_score_frame_steps_column():
    df = frame([
        "<think>10 / 4 = 2.5\n2.5 + 1 = 4\nso</think><answer>2.5</answer>",
        "no think",
        "<think>每个苹果的价格：10 / 4 = 2.5</think><answer>2.5</answer>",
    ])
    out, metrics = score_frame(df, RewardConfig())
    assert out.schema["steps"] == pl.List(pl.Struct({"start": pl.Int32, "end": pl.Int32, "reward": pl.Float64}))
    steps = out["steps"].to_list()
    acc = out["reward_accuracy"].to_list()
    assert [s["reward"] for s in steps[0]] == [1.0, 0.0, None, acc[0]]  # reasoning steps, then the answer
    assert steps[1] == [{"start": 8, "end": 8, "reward": acc[1]}]      # no <answer>: an empty answer step at the end
    c = df["completion"][2]
    assert [c[s["start"]:s["end"]] for s in steps[2]] == ["每个苹果的价格：10 / 4 = 2.5", "<answer>2.5</answer>"]
    assert metrics["steps/per_completion"] == pytest.approx(7 / 3)
    assert metrics["steps/null_share"] == pytest.approx(1 / 7)


def test_no_step_scorer_gives_empty_lists():
    out, _ = score_frame(frame(["<think>1 + 1 = 2</think>"]), RewardConfig(step_scorer=None))
    assert out["steps"].to_list() == [[]]


# --------------------------------------------------------------------------- plugged scorers
def _lengths(steps, *, completions, answers, **columns):
    assert len(steps) == len(completions) == len(answers) == len(columns["prompt_id"])
    return [[float(len(s)) for s in row] for row in steps]


def _picky(steps, *, completions, answers, **columns):
    if any("BAD" in c for c in completions):
        raise RuntimeError(f"model failed on {columns['prompt_id'][0]}")
    return [[1.0] * len(row) for row in steps]


def _misshapen(steps, **_):
    return [[1.0] for _ in steps]


@pytest.fixture
def prm_module(monkeypatch):
    mod = types.ModuleType("my_prm")
    for f in (_lengths, _picky, _misshapen):
        setattr(mod, f.__name__.lstrip("_"), f)
    monkeypatch.setitem(sys.modules, "my_prm", mod)
    return mod


def test_plugged_scorer_through_module_function(prm_module):
    df = frame(["<think>ab\n中文字</think>", "x", "<think>a\nbb\nccc</think>"])
    out, _ = score_frame(df, RewardConfig(step_scorer="my_prm:lengths"))
    reasoning = [[s["reward"] for s in row[:-1]] for row in out["steps"].to_list()]  # last: the answer step
    assert reasoning == [[2.0, 3.0], [], [1.0, 2.0, 3.0]]


def test_plugged_scorer_failures_are_isolated(prm_module):
    df = frame(["<think>a\nb</think>", "<think>BAD</think>", "<think>c</think>"])
    out, metrics = score_frame(df, RewardConfig(step_scorer="my_prm:picky", max_error_share=0.5))
    assert [[s["reward"] for s in row[:-1]] for row in out["steps"].to_list()] == [[1.0, 1.0], [None], [1.0]]
    assert out["reward_error"].to_list() == [None, "steps: RuntimeError: model failed on p1", None]
    assert metrics["steps/errors"] == 1


def test_plugged_scorer_wrong_shape_is_an_error(prm_module):
    df = frame(["<think>a\nb</think>", "<think>c</think>"])
    out, _ = score_frame(df, RewardConfig(step_scorer="my_prm:misshapen", max_error_share=0.5))
    assert out["reward_error"][0] == "steps: ValueError: returned 1 step rewards for 2 steps"
    assert out["steps"].to_list()[1][:-1] == [{"start": 7, "end": 8, "reward": 1.0}]


def test_unknown_step_scorer_lists_valid_names():
    with pytest.raises(ValueError, match=r"Unknown step scorer 'prm'.*\['arithmetic'\]"):
        get_step_scorer("prm")
    with pytest.raises(ValueError, match="cannot import module"):
        get_step_scorer("no_such_prm_module:score")
    assert "arithmetic" in STEP_SCORERS
