"""Evaluation verdicts on a small hand-checked set, and the pass@k estimator."""

import polars as pl
import pytest

from grpo_pipeline.run.evaluate import eval_metrics, judge, pass_at_k

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
    out = judge(df)
    assert out["accuracy"].to_list() == [c[2] for c in CASES]
    assert out["format"].to_list() == [c[3] for c in CASES]
    m = eval_metrics(out)
    assert m["accuracy"] == pytest.approx(4 / 8) and m["format"] == pytest.approx(3 / 8)
    assert m["truncated_share"] == pytest.approx(1 / 8) and m["prompts"] == 8


@pytest.mark.parametrize("n, c, k, expected", [(5, 0, 1, 0.0), (5, 5, 3, 1.0), (4, 1, 1, 0.25), (4, 1, 2, 0.5),
                                               (10, 3, 1, 0.3), (3, 1, 3, 1.0)])
def test_pass_at_k(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected)
