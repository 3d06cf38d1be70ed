"""Checks on the real data copies in ../shared/data (skipped where absent): GSM8K answers as a model
writes them score 1 and gold +- 1 score 0; HumanEval canonical solutions pass, `return None` earns nothing."""

from __future__ import annotations

import ast
import os
from pathlib import Path

import polars as pl
import pytest

from grpo_pipeline.coding import load_tasks
from grpo_pipeline.config import RewardConfig
from grpo_pipeline.data import load_problems
from grpo_pipeline.rewards import score_frame
from grpo_pipeline.sandbox import Limits, Program, run_programs

DATA = Path(os.environ.get("GRPO_SHARED_DATA", Path(__file__).resolve().parents[2] / "shared" / "data"))
if not DATA.is_dir():
    DATA = Path("/work/shared/data")
ACC = RewardConfig(weights={"accuracy": 1.0, "format": 0.0}, step_scorer=None)


def _need(name: str) -> Path:
    path = DATA / name
    if not path.exists():
        pytest.skip(f"{path} not here")
    return path


def test_gsm8k_gold_scores_one_and_off_by_one_scores_zero():
    df = load_problems(_need("gsm8k_test.jsonl"))
    assert df.height == 1319
    gold = df["answer"].to_list()
    forms = [lambda a: f"The answer is {a}.", lambda a: f"\\boxed{{{a}}}", lambda a: f"${a}", lambda a: f"{a} apples",
             lambda a: f"答案是{a}元", lambda a: f"{a}.0", lambda a: f"{int(a):,}" if a.lstrip("-").isdigit() else a]
    for k, form in enumerate(forms):
        texts = [f"<think>x</think><answer>{form(g)}</answer>" for g in gold]
        out, _ = score_frame(pl.DataFrame({"prompt_id": df["prompt_id"], "sample_idx": [0] * df.height,
                                           "completion": texts, "answer": gold}), ACC)
        bad = out.filter(pl.col("reward_accuracy") != 1.0)
        assert bad.height == 0, (k, bad.head(5))
    for delta in (1, -1):
        texts = [f"<answer>{_shift(g, delta)}</answer>" for g in gold]
        out, _ = score_frame(pl.DataFrame({"prompt_id": df["prompt_id"], "sample_idx": [0] * df.height,
                                           "completion": texts, "answer": gold}), ACC)
        wrong = out.filter(pl.col("reward_accuracy") != 0.0)
        assert wrong.height == 0, (delta, wrong.head(5))


def _shift(gold: str, delta: int) -> str:
    v = float(gold.replace(",", ""))
    return str(int(v) + delta) if v == int(v) else str(v + delta)


@pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="Linux sandbox")
def test_humaneval_canonical_pass_and_return_none_earns_nothing():
    df = load_tasks(_need("HumanEval.jsonl"), tests_field="test", reference_field="canonical_solution",
                    id_field="task_id")
    assert df.height == 164
    rows = list(df.select("answer", "tests", "entry_point").iter_rows())
    lim = Limits(timeout_s=5.0)
    vs = run_programs([Program(a, tuple(t), e) for a, t, e in rows], limits=lim)
    assert [(pid, v) for pid, v in zip(df["prompt_id"], vs) if v.reason != "ok"] == []
    nones = run_programs([Program(_none_body(a, e), tuple(t), e) for a, t, e in rows], limits=lim)
    assert [pid for pid, v in zip(df["prompt_id"], nones) if v.passed == v.total] == []  # all or nothing: 0 on all
    # share passed: only the tests whose expected result is None or falsy
    assert sum(v.passed for v in nones) < 0.05 * sum(v.total for v in nones)


def _none_body(code: str, entry: str) -> str:
    tree = ast.parse(code)
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == entry:
            node.body = [ast.Return(ast.Constant(None))]
    return ast.unparse(tree)
