"""Tests for grpo_pipeline.data: synthetic problems, user-file loading, train/eval split."""

from __future__ import annotations

import json
import re
from decimal import ROUND_HALF_UP, Decimal
from fractions import Fraction

import polars as pl
import pytest
from hypothesis import given
from hypothesis import strategies as st

from grpo_pipeline.data import (
    DIFFICULTIES,
    KINDS,
    LANGUAGES,
    OPERATIONS,
    PROBLEM_COLUMNS,
    build_problem,
    format_number,
    generate_problems,
    infer_operation,
    load_problems,
    split_train_eval,
)

NUMBER = re.compile(r"\d+(?:\.\d+)?")
NUM = r"\d+(?:\.\d+)?"
CLAIM = re.compile(rf"^(?P<label>\D+?)[:：] ?(?P<a>{NUM}) (?P<op>[-+*/]) (?P<b>{NUM}) = (?P<c>{NUM})$")
CJK = re.compile(r"[\u4e00-\u9fff]")
MONEY = {"unit_price", "total_cost", "change"}
OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b, "/": lambda a, b: a / b}


@pytest.fixture(scope="module")
def frames() -> dict[int, pl.DataFrame]:
    return {d: generate_problems(n=300, seed=7, difficulty=d) for d in DIFFICULTIES}


def _places(text: str) -> int:
    return len(text.split(".")[1]) if "." in text else 0


def _expected(kind: str, operation: str, nums: list[Fraction]) -> Fraction:
    """The answer recomputed from the numbers in the question, in the documented order."""
    if kind == "unit_price":
        total, count = nums
        return total / count
    if kind == "total_cost":
        count, price = nums
        return count * price
    if kind == "change":
        count, price, paid = nums
        return paid - count * price
    if kind == "sum":
        return sum(nums, Fraction(0))
    a, b, c = nums
    return (a + b) * c if operation == "add" else a * b - c


# ---------------------------------------------------------------- spec example and formatting
def test_spec_example_is_one_kind() -> None:
    problem = build_problem("unit_price", language="zh", values={"total": 5, "count": 3},
                            vocab={"name": "小明", "item": ("铅笔", "支"), "currency": "元"})
    assert problem["question"] == "小明用5元钱买了3支铅笔，每支铅笔多少钱？"
    assert problem["answer"] == "1.67"
    assert problem["operation"] == "div"
    assert problem["solution"].endswith("5 / 3 = 1.67")


def test_generator_produces_spec_shaped_questions() -> None:
    df = generate_problems(n=40, seed=3, languages=["zh"], kinds=["unit_price"])
    spec_shape = re.compile(r"^\w+?(用|花了)\d+元钱?买了\d+\w\w+，(平均)?每\w\w+多少钱？$")
    assert all(spec_shape.match(q) for q in df["question"]), df["question"].to_list()


@pytest.mark.parametrize(("value", "money", "expected"), [
    (Fraction(5, 3), True, "1.67"), (Fraction(12), True, "12"), (Fraction(9, 2), True, "4.5"),
    (Fraction(1, 200), True, "0.01"), (Fraction(25, 4), False, "6.25"), (Fraction(10, 3), False, "3.33"),
    ("12.0", False, "12"), (Fraction(-5, 3), True, "-1.67"), (Fraction(1, 64), False, "0.015625"),
])
def test_format_number_table(value: Fraction | str, money: bool, expected: str) -> None:
    assert format_number(value, money=money) == expected


@given(st.fractions(min_value=-10**6, max_value=10**6, max_denominator=10**4), st.booleans())
def test_format_number_close_and_canonical(value: Fraction, money: bool) -> None:
    text = format_number(value, money=money)
    shown = Fraction(text)
    if value.denominator == 1:
        assert text == str(value.numerator)
    assert abs(shown - value) <= Fraction(1, 200)  # at worst rounded to 2 decimals
    assert not text.endswith(".") and not (("." in text) and text.endswith("0"))
    if not money and (value * 10**6).denominator == 1:
        assert shown == value  # short terminating decimals are exact
    if money:
        assert _places(text) <= 2


# ---------------------------------------------------------------- generator
def test_same_seed_same_frame_and_different_seeds_differ() -> None:
    a = generate_problems(n=50, seed=11, difficulty=2)
    assert a.equals(generate_problems(n=50, seed=11, difficulty=2))
    assert not a["question"].equals(generate_problems(n=50, seed=12, difficulty=2)["question"])


@pytest.mark.parametrize("difficulty", DIFFICULTIES)
def test_answers_recomputed_from_question_numbers(frames: dict[int, pl.DataFrame], difficulty: int) -> None:
    for row in frames[difficulty].iter_rows(named=True):
        nums = [Fraction(x) for x in NUMBER.findall(row["question"])]
        exact = _expected(row["kind"], row["operation"], nums)
        answer = Fraction(row["answer"])
        if row["kind"] in MONEY:
            want = Decimal(exact.numerator) / Decimal(exact.denominator)
            assert Decimal(row["answer"]) == want.quantize(Decimal("0.01"), rounding=ROUND_HALF_UP), row
        else:
            assert answer == exact, row
        assert exact > 0, row


@pytest.mark.parametrize("difficulty", DIFFICULTIES)
def test_every_solution_line_is_a_correct_claim(frames: dict[int, pl.DataFrame], difficulty: int) -> None:
    symbol = {"add": "+", "sub": "-", "mul": "*", "div": "/"}
    for row in frames[difficulty].iter_rows(named=True):
        lines = row["solution"].split("\n")
        claims = [CLAIM.match(line) for line in lines]
        assert all(claims), lines
        for i, m in enumerate(claims):
            a, b, c = Fraction(m["a"]), Fraction(m["b"]), Fraction(m["c"])
            # correct to the shown rounding: within half a unit of c's last decimal place
            assert abs(OPS[m["op"]](a, b) - c) <= Fraction(1, 2 * 10 ** _places(m["c"])), lines
            assert _places(m["c"]) <= 2 or row["kind"] not in MONEY
            if i > 0:
                assert claims[i - 1]["c"] in (m["a"], m["b"]), lines  # steps chain
        assert claims[0]["op"] == symbol[row["operation"]]
        assert claims[-1]["c"] == row["answer"]
        assert bool(CJK.search(row["solution"])) == (row["language"] == "zh")


def test_columns_types_and_nulls(frames: dict[int, pl.DataFrame]) -> None:
    df = frames[1]
    assert df.columns == PROBLEM_COLUMNS
    assert all(dtype == pl.String for dtype in df.dtypes)
    assert df.null_count().sum_horizontal().item() == 0  # synthetic rows have every field
    assert set(df["operation"]) <= set(OPERATIONS)
    assert set(df["source"]) == {"synthetic"}
    assert set(df["kind"]) == set(KINDS) and set(df["language"]) == set(LANGUAGES)


def test_ids_unique_and_questions_distinct(frames: dict[int, pl.DataFrame]) -> None:
    for df in frames.values():
        assert df["prompt_id"].n_unique() == df.height
        assert df["question"].n_unique() == df.height
        assert all(re.fullmatch(r"syn-\d{6}", pid) for pid in df["prompt_id"])


def test_diverse_vocabulary(frames: dict[int, pl.DataFrame]) -> None:
    en = frames[1].filter(pl.col("language") == "en", pl.col("kind").is_in(list(MONEY)))["question"]
    assert any("$" in q for q in en) and any("yuan" in q for q in en)
    first_words = {q.split()[0] for q in frames[1].filter(pl.col("language") == "en")["question"]}
    assert len(first_words) >= 5


@pytest.mark.parametrize(("languages", "kinds"), [
    (["en"], ["change", "sum"]), (["zh"], ["two_step"]), (["en", "zh"], ["unit_price"]), (["zh"], None),
])
def test_filters_respected_and_balanced(languages: list[str], kinds: list[str] | None) -> None:
    df = generate_problems(n=37, seed=5, languages=languages, kinds=kinds)
    assert set(df["language"]) == set(languages)
    assert set(df["kind"]) == set(kinds or KINDS)
    assert all(bool(CJK.search(q)) == (lang == "zh") for q, lang in zip(df["question"], df["language"]))
    counts = df.group_by("kind", "language").len()["len"]
    assert counts.max() - counts.min() <= 1


@pytest.mark.parametrize(("kwargs", "allowed"), [
    ({"kinds": ["division"]}, KINDS), ({"languages": ["fr"]}, LANGUAGES), ({"difficulty": 4}, DIFFICULTIES),
    ({"kinds": []}, KINDS), ({"languages": []}, LANGUAGES),
])
def test_invalid_choices_name_allowed_values(kwargs: dict, allowed: tuple) -> None:
    with pytest.raises(ValueError, match="Allowed values") as err:
        generate_problems(n=5, **kwargs)
    assert all(str(value) in str(err.value) for value in allowed)


@pytest.mark.parametrize("n", [0, -3])
def test_invalid_n(n: int) -> None:
    with pytest.raises(ValueError, match="positive integer"):
        generate_problems(n=n)


# ---------------------------------------------------------------- user files
GSM8K_ROWS = [
    {"question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
                 "How many clips did Natalia sell altogether in April and May?",
     "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
               "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72"},
    {"question": "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. "
                 "How much did she earn?",
     "answer": "Weng earns 12/60 = $<<12/60=0.2>>0.2 per minute.\n"
               "Working 50 minutes, she earned 0.2 x 50 = $<<0.2*50=10>>10.\n#### 10"},
]


def _write_jsonl(path, rows) -> None:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")


def test_gsm8k_jsonl(tmp_path) -> None:
    path = tmp_path / "gsm8k_test.jsonl"
    _write_jsonl(path, GSM8K_ROWS)
    df = load_problems(path)
    assert df.columns == PROBLEM_COLUMNS
    assert df["answer"].to_list() == ["72", "10"]
    assert df["operation"].to_list() == ["div", "div"]
    assert df["question"].to_list() == [r["question"] for r in GSM8K_ROWS]
    solutions = df["solution"].to_list()
    assert solutions[0].split("\n") == [
        "Natalia sold 48/2 = 24 clips in May.", "Natalia sold 48+24 = 72 clips altogether in April and May."]
    assert all("<<" not in s and "####" not in s for s in solutions)
    assert set(df["source"]) == {"gsm8k_test.jsonl"} and set(df["language"]) == {"en"}
    assert df["prompt_id"].n_unique() == 2


def test_gsm8k_answer_commas_and_explicit_solution_field(tmp_path) -> None:
    path = tmp_path / "x.jsonl"
    _write_jsonl(path, [{"q": "多少?", "a": "3*4 = <<3*4=12>>12\n#### 1,072", "steps": "7 - 2 = 5", "id": "a1"}])
    df = load_problems(path, question_field="q", answer_field="a", solution_field="steps", id_field="id")
    row = df.row(0, named=True)
    assert (row["answer"], row["solution"], row["operation"]) == ("1072", "7 - 2 = 5", "sub")
    assert (row["prompt_id"], row["language"]) == ("a1", "zh")


def test_parquet_loading(tmp_path) -> None:
    path = tmp_path / "mine.parquet"
    pl.DataFrame({"problem": ["小明用5元钱买了3支铅笔，每支铅笔多少钱？", "What is 2 + 2?"],
                  "target": ["1.67", "4"], "uid": ["p-1", "p-2"]}).write_parquet(path)
    df = load_problems(path, question_field="problem", answer_field="target", id_field="uid")
    assert df["prompt_id"].to_list() == ["p-1", "p-2"]
    assert df["language"].to_list() == ["zh", "en"]
    assert df["answer"].to_list() == ["1.67", "4"]
    assert df["solution"].null_count() == 2 and df["operation"].null_count() == 2
    assert set(df["source"]) == {"mine.parquet"}


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_missing_column_names_column_and_file(tmp_path, suffix: str) -> None:
    path = tmp_path / f"data{suffix}"
    rows = [{"prompt": "1 + 1?", "answer": "2"}]
    _write_jsonl(path, rows) if suffix == ".jsonl" else pl.DataFrame(rows).write_parquet(path)
    with pytest.raises(ValueError, match="'question'") as err:
        load_problems(path)
    assert str(path) in str(err.value) and "'prompt'" in str(err.value)


@pytest.mark.parametrize("bad", [{"question": "", "answer": "3"}, {"question": "1 + 2?", "answer": None},
                                 {"question": "1 + 2?", "answer": "steps\n#### "}])
def test_empty_fields_name_file_and_row(tmp_path, bad: dict) -> None:
    path = tmp_path / "bad.jsonl"
    _write_jsonl(path, [GSM8K_ROWS[0], bad])
    with pytest.raises(ValueError, match="row 2") as err:
        load_problems(path)
    assert "bad.jsonl" in str(err.value)


def test_bad_extension_duplicate_ids_and_bad_json(tmp_path) -> None:
    with pytest.raises(ValueError, match=r"\.jsonl"):
        load_problems(tmp_path / "data.csv")
    path = tmp_path / "dup.jsonl"
    _write_jsonl(path, [{"id": "a", "question": "q", "answer": "1"}, {"id": "a", "question": "r", "answer": "2"}])
    with pytest.raises(ValueError, match="duplicate"):
        load_problems(path, id_field="id")
    path.write_text('{"question": "q", "answer": "1"}\n{oops\n', encoding="utf-8")
    with pytest.raises(ValueError, match="line 2"):
        load_problems(path)


@pytest.mark.parametrize(("text", "expected"), [
    ("Natalia sold 48/2 = <<48/2=24>>24 clips.", "div"), ("48 + 24 = 72", "add"), ("She paid $10 - $4 = $6", "sub"),
    ("0.2 x 50 = 10", "mul"), ("5÷3 = 1.67", "div"), ("3×4=12", "mul"), ("a 3-page letter: 3*2=<<3*2=6>>6", "mul"),
    ("no numbers here", None), (None, None),
])
def test_infer_operation(text: str | None, expected: str | None) -> None:
    assert infer_operation(text) == expected


def test_synthetic_operation_matches_inference(frames: dict[int, pl.DataFrame]) -> None:
    df = frames[2]
    assert [infer_operation(s) for s in df["solution"]] == df["operation"].to_list()


# ---------------------------------------------------------------- split
@pytest.mark.parametrize("n_eval", [1, 10, 49])
def test_split_sizes_disjoint_deterministic(n_eval: int) -> None:
    df = generate_problems(n=50, seed=0)
    train, evaluation = split_train_eval(df, n_eval=n_eval, seed=3)
    assert (train.height, evaluation.height) == (50 - n_eval, n_eval)
    assert set(train["prompt_id"]).isdisjoint(evaluation["prompt_id"])
    assert set(train["prompt_id"]) | set(evaluation["prompt_id"]) == set(df["prompt_id"])
    again = split_train_eval(df, n_eval=n_eval, seed=3)
    assert again[0].equals(train) and again[1].equals(evaluation)


def test_split_seed_changes_selection() -> None:
    df = generate_problems(n=60, seed=0)
    picks = {tuple(split_train_eval(df, n_eval=10, seed=s)[1]["prompt_id"]) for s in range(4)}
    assert len(picks) > 1


@pytest.mark.parametrize("n_eval", [20, 21, 0])
def test_split_rejects_bad_n_eval(n_eval: int) -> None:
    df = generate_problems(n=20, seed=0)
    with pytest.raises(ValueError, match=f"n_eval={n_eval}") as err:
        split_train_eval(df, n_eval=n_eval, seed=0)
    assert "len(df)=20" in str(err.value)
