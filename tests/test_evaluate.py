"""Evaluation verdicts on a small hand-checked set, and the pass@k estimator."""

import polars as pl
import pytest

from grpo_pipeline import config
from grpo_pipeline.config import RewardConfig
from grpo_pipeline.run.evaluate import eval_metrics, eval_rewards, judge, pass_at_k

# (completion, reference, accuracy, format) — checked by hand
CASES = [
    ("<think>5 / 3 = 1.67</think><answer>1.67</answer>", "1.67", 1.0, 1.0),
    ("<think>5 / 3 = 1.67</think>\n<answer>约1.67元</answer>\n", "1.67", 1.0, 1.0),
    ("<think>3 * 4 = 12</think><answer>12</answer> extra text", "12", 1.0, 0.0),
    ("<answer>12</answer>", "12", 1.0, 0.0),
    ("<think>3 + 4 = 7</think><answer>8</answer>", "7", 0.0, 1.0),
    ("The answer is 7.", "7", 0.0, 0.0),
    ("<think>a</think><answer>7</answer><answer>7</answer>", "7", 0.0, 0.0),
    ("<think>10 - 4 = 6</think><answer>6", "6", 0.0, 0.0),
]


def test_judge_matches_hand_checked_verdicts():
    df = pl.DataFrame({"prompt_id": [f"p{i}" for i in range(len(CASES))], "sample_idx": [0] * len(CASES),
                       "completion": [c[0] for c in CASES], "answer": [c[1] for c in CASES],
                       "operation": [None] * len(CASES), "completion_len": [10] * len(CASES),
                       "finish_reason": ["stop"] * (len(CASES) - 1) + ["length"]},
                      schema_overrides={"sample_idx": pl.Int32, "operation": pl.Utf8})
    out = judge(df, RewardConfig())
    assert out["accuracy"].to_list() == [c[2] for c in CASES]
    assert out["format"].to_list() == [c[3] for c in CASES]
    m = eval_metrics(out)
    assert m["accuracy"] == pytest.approx(4 / 8) and m["format"] == pytest.approx(3 / 8)
    assert m["truncated_share"] == pytest.approx(1 / 8) and m["prompts"] == 8


@pytest.mark.parametrize("n, c, k, expected", [(5, 0, 1, 0.0), (5, 5, 3, 1.0), (4, 1, 1, 0.25), (4, 1, 2, 0.5),
                                               (10, 3, 1, 0.3), (3, 1, 3, 1.0)])
def test_pass_at_k(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected)


def test_judge_coding_rows_run_the_hidden_tests_all_or_nothing():
    """A coding prompt is accurate only when its code passes every test (real sandbox); math rows unchanged."""
    tests = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0"]
    rows = [  # (completion, tests, accuracy, format)
        ("<think>sum</think><answer>def add(a, b):\n    return a + b</answer>", tests, 1.0, 1.0),
        ("<think>half</think><answer>def add(a, b):\n    return 3</answer>", tests, 0.0, 1.0),   # passes 1 of 2
        ("<answer>```python\ndef add(a, b):\n    return a + b\n```</answer>", tests, 1.0, 0.0),
        ("def add(a, b): return a + b", tests, 0.0, 0.0),                                       # no answer block
        ("<think>3 + 4 = 7</think><answer>7</answer>", None, 1.0, 1.0),                           # a math row
    ]
    df = pl.DataFrame({"prompt_id": [f"p{i}" for i in range(len(rows))], "sample_idx": [0] * len(rows),
                       "completion": [r[0] for r in rows], "answer": ["def add(a, b): return a + b"] * 4 + ["7"],
                       "operation": [None] * len(rows), "tests": [r[1] for r in rows],
                       "entry_point": ["add"] * 4 + [None]},
                      schema_overrides={"sample_idx": pl.Int32, "operation": pl.Utf8, "tests": pl.List(pl.Utf8)})
    out = judge(df, RewardConfig())
    assert out["accuracy"].to_list() == [r[2] for r in rows]
    assert out["format"].to_list() == [r[3] for r in rows]


def test_evaluate_takes_the_reward_config():
    """reward.tests limits and reward.rel_tol reach the judge; tests stay all or nothing."""
    cfg = RewardConfig(rel_tol=0.01, tests=config.TestsRewardConfig(timeout_s=7.0, memory_mb=512))
    judged = eval_rewards(cfg, coding=True)
    assert judged.tests.timeout_s == 7.0 and judged.tests.memory_mb == 512 and judged.tests.all_or_nothing
    assert judged.rel_tol == 0.01 and judged.step_scorer is None and judged.weights["tests"] == 1.0
    df = pl.DataFrame({"prompt_id": ["p"], "sample_idx": [0], "completion": ["<think>x</think><answer>1.51</answer>"],
                       "answer": ["3/2"], "operation": [None]}, schema_overrides={"sample_idx": pl.Int32,
                                                                               "operation": pl.Utf8})
    assert judge(df, cfg)["accuracy"].item() == 1.0 and judge(df, RewardConfig())["accuracy"].item() == 0.0
