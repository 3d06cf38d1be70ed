"""Tests for grpo_pipeline.rewards: accuracy / format / reasoning rules, custom rewards, score_frame."""

from __future__ import annotations

import math
import sys
import types

import polars as pl
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from grpo_pipeline.config import CustomReward, RewardConfig
from grpo_pipeline.rewards import REWARD_RULES, RewardError, get_rule, score_frame
from grpo_pipeline.rewards.parse import extract_answer, normalize_series, normalize_text, number_fields, parse_number
from grpo_pipeline.rewards.rowwise import accuracy_row, format_row
from grpo_pipeline.rewards.rules import accuracy_fast, format_reward

NO_STEPS = {"step_scorer": None, "weights": {"accuracy": 1.0, "format": 1.0, "reasoning": 0.0}}


def frame(completions, answers=None, operations=None, **extra) -> pl.DataFrame:
    n = len(completions)
    data = {
        "prompt_id": pl.Series([f"p{i}" for i in range(n)], dtype=pl.Utf8),
        "sample_idx": pl.Series([0] * n, dtype=pl.Int32),
        "completion": pl.Series(completions, dtype=pl.Utf8),
        "answer": pl.Series(answers if answers is not None else ["12"] * n, dtype=pl.Utf8),
        "operation": pl.Series(operations if operations is not None else [None] * n, dtype=pl.Utf8),
        **extra,
    }
    return pl.DataFrame(data)


def wrap(pred: str) -> str:
    return f"<think>thinking</think><answer>{pred}</answer>"


def accuracy(completions, answers, *, rel_tol=1e-6) -> list[float | None]:
    values, _ = get_rule("accuracy")(frame(completions, answers), rel_tol=rel_tol)
    return values.to_list()


# --------------------------------------------------------------------------- accuracy
ACCURACY_CASES = [
    ("1.67", "1.67", 1.0),
    ("1.670", "1.67", 1.0),
    ("1.667", "1.67", 1.0),
    ("1.665", "1.67", 1.0),  # ties round away from zero
    ("1.675", "1.67", 0.0),
    ("1.7", "1.67", 0.0),
    ("约1.67元", "1.67", 1.0),
    ("$1.67", "1.67", 1.0),
    ("about 1.67 dollars", "1.67", 1.0),
    ("≈ 1.67", "1.67", 1.0),
    ("每支1.67元", "1.67", 1.0),
    ("1.67元/支", "1.67", 1.0),
    ("5/3", "1.67", 1.0),  # 5/3 = 1.666.. rounds to the reference's 2 decimals
    ("5 / 3", "1.67", 1.0),
    ("\\boxed{1.67}", "1.67", 1.0),
    ("\\frac{5}{3}", "\\frac{5}{3}", 1.0),
    ("\\frac{5}{3}", "1.67", 1.0),
    ("\\dfrac{5}{3}", "5/3", 1.0),
    ("1.67", "5/3", 0.0),  # a fraction reference is exact: rel_tol only
    ("1,234", "1234", 1.0),
    ("1，234", "1234", 1.0),
    ("１２", "12", 1.0),
    ("１２。", "12", 1.0),
    ("答：12", "12", 1.0),
    ("12 pencils", "12", 1.0),
    ("12块", "12", 1.0),
    ("¥12", "12", 1.0),
    ("12 yuan", "12", 1.0),
    ("12.4", "12", 0.0),  # integer reference: no rounding
    ("12.0", "12", 1.0),
    ("13", "12", 0.0),
    ("-12", "12", 0.0),
    ("−12", "-12", 1.0),
    ("0.5", "1/2", 1.0),
    ("50%", "50", 1.0),
    ("twelve", "12", 0.0),
    ("", "12", 0.0),
    ("Yes", "yes", 1.0),
    ("no", "yes", 0.0),
    ("\\sqrt{2}", "1.41", 1.0),  # math-verify path, then the tolerance rule
    ("\\sqrt{2}", "1.5", 0.0),
    ("2^{10}", "1024", 1.0),
    ("\\sqrt{2}", "\\sqrt{2}", 1.0),
    ("\\sqrt{2}", "2", 0.0),  # not read as the bare 2
]

# (gold, prediction, expected), in Math-Verify's style: no false positives, and the common right forms still score
NO_FALSE_POSITIVES = [
    # relations are compared as relations
    ("x > 5", "x < 5", 0.0), ("x > 5", "x > 5", 1.0), ("x > 5", "5 < x", 1.0), ("x \\ge 2", "x \\le 2", 0.0),
    ("x ≥ 2", "x \\ge 2", 1.0), ("5", "x < 5", 0.0), ("5", "x > 5", 0.0), ("5", "x ≠ 5", 0.0),
    # letters glued to a number make it something else
    ("2", "2x", 0.0), ("2", "v2", 0.0), ("2", "AZYUK2A", 0.0), ("2", "x2", 0.0), ("5", "5k", 0.0), ("12", "12e3", 0.0),
    ("5", "5kg", 1.0), ("3", "3rd", 1.0), ("2", "x = 2", 1.0),
    # integers are exact, whatever their size
    ("1000000", "1000001", 0.0), ("1000000", "999999", 0.0), ("123456789", "123456790", 0.0),
    ("1000000", "1,000,000", 1.0), ("1000000", "1000000.0", 1.0), ("1024", "2^{10}", 1.0), ("1024", "2^{10} + 1", 0.0),
    # tuples, intervals, sets and expressions are compared as structures
    ("(1, 2)", "(3, 2)", 0.0), ("(1, 2)", "(1, 2)", 1.0), ("(1, 2)", "(1,2)", 1.0), ("(1, 2)", "(2, 1)", 0.0),
    ("[1, 2)", "[1, 2]", 0.0), ("[1, 2)", "[1, 2)", 1.0), ("\\{1, 2\\}", "\\{2, 1\\}", 1.0),
    ("\\{1, 2\\}", "\\{1, 3\\}", 0.0), ("x^2 + 1", "1 + x^2", 1.0), ("x^2 + 1", "x^2 + 2", 0.0),
    ("2x + 1", "2x + 3", 0.0), ("(1, 2, 3)", "(1, 2, 4)", 0.0),
    # units do not block a right number
    ("1234", "1234 m^2", 1.0), ("1234", "1234 cm²", 1.0), ("1234", "1234 square meters", 1.0), ("1234", "1235 m^2", 0.0),
    ("12", "12 km/h", 1.0),
    # the common right forms
    ("12", "12", 1.0), ("12", "12.0", 1.0), ("12", "$12", 1.0), ("12", "12 apples", 1.0), ("12", "12元", 1.0),
    ("1234", "1,234", 1.0), ("12", "\\boxed{12}", 1.0), ("12", "The answer is 12", 1.0), ("12", "The answer is 12.", 1.0),
    ("0.75", "3/4", 1.0), ("3/4", "0.75", 1.0), ("3/4", "\\frac{3}{4}", 1.0), ("12", "答案是12", 1.0),
    ("12", "１２个", 1.0), ("12", "US$12", 1.0), ("-3", "−3", 1.0), ("12", "12 x", 1.0),
]


@pytest.mark.parametrize(("gold", "pred", "expected"), NO_FALSE_POSITIVES)
def test_no_false_positives_table(gold, pred, expected):
    assert accuracy([wrap(pred)], [gold]) == [expected]
    assert accuracy_row(wrap(pred), gold, rel_tol=1e-6) == expected


@pytest.mark.parametrize(("pred", "ref", "expected"), ACCURACY_CASES)
def test_accuracy_table(pred, ref, expected):
    assert accuracy([wrap(pred)], [ref]) == [expected]


@pytest.mark.parametrize(("pred", "ref", "expected"), ACCURACY_CASES)
def test_rowwise_twin_agrees(pred, ref, expected):
    assert accuracy_row(wrap(pred), ref, rel_tol=1e-6) == expected


@pytest.mark.parametrize(
    "completion",
    [
        "12",
        "<think>12</think>",
        "<answer>12",
        "12</answer>",
        "</answer>12<answer>",
        "<answer>12</answer><answer>12</answer>",
        "<answer>12</answer><answer>",
        "<think>x</think><answer></answer>",
    ],
)
def test_accuracy_missing_or_repeated_tags_is_zero(completion):
    assert accuracy([completion], ["12"]) == [0.0]


@pytest.mark.parametrize(("rel_tol", "expected"), [(1e-9, 0.0), (1e-4, 1.0)])
def test_accuracy_rel_tol(rel_tol, expected):
    assert accuracy([wrap("0.33334")], ["1/3"], rel_tol=rel_tol) == [expected]  # fraction reference: rel_tol
    assert accuracy([wrap("100.01")], ["100"], rel_tol=rel_tol) == [0.0]  # integer reference: exact


@pytest.mark.parametrize(
    ("pred", "ref"),
    [("12", "12"), ("1,234", "1234"), ("0.5", "1/2"), ("7", "8"), ("5/3", "5/3"), ("-4", "4"), ("3.14", "3.14"),
     ("12 pencils", "12"), ("2/4", "0.5"), ("100", "99")],
)
def test_fast_path_agrees_with_math_verify(pred, ref):
    from math_verify import parse, verify

    fast = accuracy_fast(frame([wrap(pred)], [ref]), rel_tol=1e-6)["acc"][0]
    assert fast is not None, "the fast path should decide plain numbers"
    assert fast == float(verify(parse(ref), parse(pred)))


def test_fast_path_leaves_latex_expressions_to_math_verify():
    acc = accuracy_fast(frame([wrap("\\sqrt{2}"), wrap("12"), wrap("1 2")], ["1.41", "12", "12"]), rel_tol=1e-6)["acc"]
    assert acc.to_list() == [None, 1.0, None]


@pytest.mark.parametrize(
    ("text", "value", "decimals"),
    [("1.67", 1.67, 2), ("-1,234.5元", -1234.5, 1), ("１２", 12.0, 0), ("\\frac{5}{3}", 5 / 3, None),
     ("$.5", 0.5, 1), ("5/0", None, None), ("1 2", None, None), ("\\sqrt{4}", None, None)],
)
def test_number_fields_and_python_twin(text, value, decimals):
    fields = number_fields(normalize_series(pl.Series([text]))).row(0)
    parsed = parse_number(text)
    if value is None:
        assert fields[0] is None and parsed is None
    else:
        assert fields[0] == pytest.approx(value) and fields[1] == decimals
        assert parsed is not None and parsed.value == pytest.approx(value) and parsed.decimals == decimals
    assert normalize_series(pl.Series([text]))[0] == normalize_text(text)


def test_extract_answer_strips_and_rejects():
    got = extract_answer(pl.Series(["<answer> 1.67 </answer>", "<answer>1</answer><answer>2</answer>", "x"]))
    assert got.to_list() == ["1.67", None, None]


# --------------------------------------------------------------------------- format
FORMAT_CASES = [  # completion, strict, partial
    ("<think>a</think><answer>b</answer>", 1.0, 1.0),
    ("  <think>a\nb</think>\n<answer>b</answer>\n", 1.0, 1.0),
    ("<think>a</think><answer>b</answer> trailing", 0.0, 0.75),
    ("x<think>a</think><answer>b</answer>", 0.0, 0.75),
    ("<think>a</think>x<answer>b</answer>", 0.0, 0.75),
    ("<think><think>a</think></think><answer>b</answer>", 0.0, 0.75),
    ("<think>a</think><think>b</think><answer>c</answer>", 0.0, 0.75),
    ("<think>a</think><answer>b</answer><answer>c</answer>", 0.0, 0.75),
    ("<answer>b</answer><think>a</think>", 0.0, 0.5),
    ("<think>a<answer>b</answer>", 0.0, 0.5),
    ("<think>a</think>", 0.0, 0.25),
    ("</think>a<think><answer>b</answer>", 0.0, 0.5),
    ("no tags at all", 0.0, 0.0),
    ("", 0.0, 0.0),
]


@pytest.mark.parametrize(("completion", "strict", "partial"), FORMAT_CASES)
def test_format_table(completion, strict, partial):
    assert format_reward(pl.Series([completion])).to_list() == [strict]
    assert format_reward(pl.Series([completion]), partial_credit=True).to_list() == [partial]
    assert (format_row(completion), format_row(completion, partial_credit=True)) == (strict, partial)


PIECES = ["<think>", "</think>", "<answer>", "</answer>", " ", "\n", "12", "1.67", "约", "元", "x", "5/3", "１２", "$"]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.sampled_from(PIECES), max_size=12).map("".join), st.sampled_from(["12", "1.67", "5/3", "yes"]))
def test_vectorised_rules_equal_rowwise_twins(completion, answer):
    strict = format_reward(pl.Series([completion]))[0]
    partial = format_reward(pl.Series([completion]), partial_credit=True)[0]
    assert strict == format_row(completion)
    assert partial == format_row(completion, partial_credit=True)
    assert (partial == 1.0) == (strict == 1.0)  # the four items hold together exactly when the format does
    assert accuracy([completion], [answer]) == [accuracy_row(completion, answer, rel_tol=1e-6)]


# --------------------------------------------------------------------------- reasoning
@pytest.mark.parametrize(
    ("completion", "op", "expected"),
    [
        ("<think>5 / 3 = 1.67</think>", "div", 1.0),
        ("<think>5÷3</think>", "div", 1.0),
        ("<think>Divide 5 by 3</think>", "div", 1.0),
        ("<think>5除以3</think>", "div", 1.0),
        ("<think>5 + 3</think><answer>5/3</answer>", "div", 0.0),  # only the think part counts
        ("<think>3 x 4 = 12</think>", "mul", 1.0),
        ("<think>3 × 4</think>", "mul", 1.0),
        ("<think>a box of apples</think>", "mul", 0.0),
        ("<think>3 times 4</think>", "mul", 1.0),
        ("<think>3乘4</think>", "mul", 1.0),
        ("<think>3 plus 4</think>", "add", 1.0),
        ("<think>3加4</think>", "add", 1.0),
        ("<think>3 + 4</think>", "add", 1.0),
        ("<think>10 - 3 = 7</think>", "sub", 1.0),
        ("<think>ten minus three</think>", "sub", 1.0),
        ("<think>10减3</think>", "sub", 1.0),
        ("<think>a well-known fact</think>", "sub", 0.0),
        ("5 / 3 without think", "div", 0.0),
        ("<think>5 / 3</think>", None, None),
    ],
)
def test_reasoning_table(completion, op, expected):
    values, _ = get_rule("reasoning")(frame([completion], operations=[op]))
    assert values.to_list() == [expected]


def test_reasoning_unknown_operation_names_value_and_row():
    with pytest.raises(ValueError, match=r"'pow'.*prompt_id='p1'.*valid: \['div'"):
        get_rule("reasoning")(frame(["a", "b"], operations=["add", "pow"]))


def test_unknown_rule_lists_valid_names():
    with pytest.raises(ValueError, match="accuracy"):
        get_rule("nope")
    assert {"accuracy", "format", "reasoning"} <= set(REWARD_RULES)


# --------------------------------------------------------------------------- score_frame
COMPLETIONS = [
    "<think>5 / 3 = 1.67</think><answer>1.67</answer>",
    "<think>5元÷3支=1.67元</think><answer>约1.67元</answer>",
    "<think>3 + 4</think><answer>1.7</answer>",
    "1.67",
]


def test_score_frame_columns_and_weighted_sum():
    df = frame(COMPLETIONS, ["1.67"] * 4, ["div", "div", "div", None])
    cfg = RewardConfig(weights={"accuracy": 2.0, "format": 0.5, "reasoning": 1.0})
    out, metrics = score_frame(df, cfg)
    assert out.columns == ["prompt_id", "sample_idx", "reward_accuracy", "reward_format", "reward_reasoning",
                           "reward", "reward_error", "steps"]
    assert out.schema["reward"] == pl.Float64 and out.schema["reward_error"] == pl.Utf8
    acc, fmt, rea = (out[f"reward_{k}"].to_list() for k in ("accuracy", "format", "reasoning"))
    assert acc == [1.0, 1.0, 0.0, 0.0] and fmt == [1.0, 1.0, 1.0, 0.0] and rea == [1.0, 1.0, 0.0, None]
    expected = [None if r is None else 2 * a + 0.5 * f + r for a, f, r in zip(acc, fmt, rea, strict=True)]
    assert out["reward"].to_list() == expected  # the weighted reasoning is null in the last row
    assert metrics["accuracy/mean"] == pytest.approx(0.5)
    assert metrics["reasoning/nulls"] == 1 and metrics["total/nulls"] == 1
    assert metrics["total/mean"] == pytest.approx(sum(expected[:3]) / 3)


def test_zero_weight_null_component_does_not_null_reward():
    out, _ = score_frame(frame(COMPLETIONS, ["1.67"] * 4), RewardConfig(**NO_STEPS))
    assert out["reward_reasoning"].null_count() == 4
    assert out["reward"].to_list() == [2.0, 2.0, 1.0, 0.0]


def test_empty_frame():
    out, metrics = score_frame(frame([]), RewardConfig())
    assert out.height == 0 and metrics["rows"] == 0 and metrics["total/mean"] is None


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda df: df.drop("answer"), r"missing columns \['answer'\]"),
        (lambda df: df.with_columns(completion=pl.Series([None, "x"], dtype=pl.Utf8)), r"'completion' is null.*prompt_id='p0'"),
        (lambda df: df.with_columns(answer=pl.lit(12)), r"'answer' must be"),
    ],
)
def test_bad_input_is_named(change, match):
    with pytest.raises(ValueError, match=match):
        score_frame(change(frame(["a", "b"])), RewardConfig())


def test_reasoning_weight_needs_operation_column():
    with pytest.raises(ValueError, match="operation"):
        score_frame(frame(["a"]).drop("operation"), RewardConfig(weights={"accuracy": 1.0, "reasoning": 1.0}))


# --------------------------------------------------------------------------- custom rewards
def _length(completions, answers, **columns):
    assert {"prompt_id", "sample_idx", "operation", "question"} <= set(columns)
    assert len(columns["prompt_id"]) == len(completions) == len(answers)
    return [len(c) / 10 for c in completions]


def _flaky(completions, answers, **columns):
    out = []
    for c, pid in zip(completions, columns["prompt_id"], strict=True):
        if "BAD" in c:
            raise ValueError(f"cannot score {pid}")
        out.append(1.0)
    return out


def _nan_or_none(completions, answers, **_):
    return [math.nan if "BAD" in c else (None if "SKIP" in c else 0.5) for c in completions]


def _short(completions, answers, **_):
    return [1.0] * max(len(completions) - 1, 1)  # wrong length for batches, right for single rows


@pytest.fixture
def user_module(monkeypatch):
    mod = types.ModuleType("user_rewards")
    for f in (_length, _flaky, _nan_or_none, _short):
        setattr(mod, f.__name__.lstrip("_"), f)
    monkeypatch.setitem(sys.modules, "user_rewards", mod)
    return mod


def custom_cfg(fn: str, *, share: float = 0.5, weight: float = 1.0) -> RewardConfig:
    return RewardConfig(custom=[CustomReward(name="mine", function=f"user_rewards:{fn}", weight=weight)],
                        max_error_share=share, **NO_STEPS)


def test_custom_reward_gets_columns_and_is_weighted(user_module):
    df = frame(COMPLETIONS, ["1.67"] * 4, question=["q"] * 4)
    out, metrics = score_frame(df, custom_cfg("length", weight=0.5))
    assert out["reward_mine"].to_list() == [len(c) / 10 for c in COMPLETIONS]
    base = out["reward_accuracy"] + out["reward_format"]
    assert out["reward"].to_list() == pytest.approx((base + 0.5 * out["reward_mine"]).to_list())
    assert metrics["rewards/mine/errors"] == 0


def test_failing_rows_are_recorded_not_fatal_under_threshold(user_module):
    df = frame(["ok", "BAD one", "ok", "ok"])
    out, metrics = score_frame(df, custom_cfg("flaky", share=0.3))
    assert out["reward_mine"].to_list() == [1.0, None, 1.0, 1.0]
    assert out["reward_error"].to_list() == [None, "mine: ValueError: cannot score p1", None, None]
    assert out["reward"][1] is None and metrics["rewards/mine/errors"] == 1


def test_failing_rows_over_threshold_are_fatal_and_named(user_module):
    df = frame(["ok", "BAD", "BAD", "ok"])
    with pytest.raises(RewardError, match=r"'mine'.*2 of 4.*50\.0%.*prompt_id='p1'.*cannot score p1"):
        score_frame(df, custom_cfg("flaky", share=0.25))


def test_nan_is_an_error_none_is_not_applicable(user_module):
    out, metrics = score_frame(frame(["ok", "BAD", "SKIP"]), custom_cfg("nan_or_none", share=0.5))
    assert out["reward_mine"].to_list() == [0.5, None, None]
    assert out["reward_error"].to_list() == [None, "mine: ValueError: returned nan", None]
    assert metrics["rewards/mine/errors"] == 1 and metrics["mine/nulls"] == 2


def test_wrong_batch_length_falls_back_per_row(user_module):
    out, _ = score_frame(frame(["a", "b", "c"]), custom_cfg("short"))
    assert out["reward_mine"].to_list() == [1.0, 1.0, 1.0]


@pytest.mark.parametrize(
    ("function", "match"),
    [("no_such_module_xyz:f", "cannot import module 'no_such_module_xyz'"),
     ("user_rewards:missing", r"no function 'missing'.*'length'")],
)
def test_bad_module_function_is_a_clear_error(user_module, function, match):
    cfg = RewardConfig(custom=[CustomReward(name="mine", function=function)])
    with pytest.raises(ValueError, match=match):
        score_frame(frame(["a"]), cfg)


def test_custom_name_clash_with_builtin():
    cfg = RewardConfig(custom=[CustomReward(name="format", function="math:sqrt")])
    with pytest.raises(ValueError, match="clash"):
        score_frame(frame(["a"]), cfg)
