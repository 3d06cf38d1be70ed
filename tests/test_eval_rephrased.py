"""bench/eval_rephrased.py: other words, the pipeline's numbers and answers, balanced kinds and languages."""
from __future__ import annotations

import importlib.util
import re
from collections import Counter
from pathlib import Path

from grpo_pipeline import data

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("bench_eval_rephrased", ROOT / "bench" / "eval_rephrased.py")
er = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(er)


def test_balanced_distinct_and_reproducible():
    df = er.rephrased_problems(100, seed=3)
    assert df.columns == data.PROBLEM_COLUMNS
    counts = Counter(zip(df["kind"], df["language"]))
    assert set(counts) == {(k, lang) for k in data.KINDS for lang in data.LANGUAGES}
    assert set(counts.values()) == {10}
    assert df["question"].n_unique() == 100
    assert df.equals(er.rephrased_problems(100, seed=3))
    assert not df.equals(er.rephrased_problems(100, seed=4))


def test_words_are_not_the_pipelines():
    for lang in data.LANGUAGES:
        assert not set(er.NAMES[lang]) & set(data._NAMES[lang])
        assert not {i[0] for i in er.ITEMS[lang]} & {i[0] for i in data._ITEMS[lang]}
        assert not set(er.DAYS[lang]) & set(data._DAYS[lang])
    pipeline = set(data.generate_problems(n=500, seed=0)["question"])
    assert not pipeline & set(er.rephrased_problems(500, seed=0)["question"])


def test_question_carries_the_numbers_of_the_reference_solution():
    df = er.rephrased_problems(200, seed=5)
    for row in df.iter_rows(named=True):
        first = row["solution"].splitlines()[0]
        a, b = re.search(r"([\d.]+) [-+*/] ([\d.]+) =", first).groups()
        nums = {float(x) for x in re.findall(r"\d+(?:\.\d+)?", row["question"])}
        assert float(a) in nums and float(b) in nums, (row["question"], first)
