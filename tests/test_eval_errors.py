"""bench/eval_errors.py: each wrong answer lands in the class its mistake belongs to."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import polars as pl

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("bench_eval_errors", ROOT / "bench" / "eval_errors.py")
ee = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ee)

TWO_STEP = "Cupcakes bought: 4 * 5 = 20\nCupcakes left: 20 - 11 = 9"


def think(body: str, answer: str) -> str:
    return f"<think>{body}</think><answer>{answer}</answer>"


def test_each_kind_of_mistake_has_its_class():
    assert ee.classify(think(TWO_STEP, "9"), TWO_STEP, True) == "right"
    assert ee.classify(think("Cupcakes: 4 * 5 = 20", "20"), TWO_STEP, False) == "fewer_steps"
    assert ee.classify(think(TWO_STEP + "\nMore: 9 + 5 = 14", "14"), TWO_STEP, False) == "more_steps"
    assert ee.classify(think("4 * 5 = 20\n20 - 11 = 11", "11"), TWO_STEP, False) == "arithmetic"
    assert ee.classify(think("4 * 5 = 20\n20 - 12 = 8", "8"), TWO_STEP, False) == "other"  # true, wrong operand
    # Chinese text and full-width digits go through the step scorer's normalisation
    assert ee.classify(think("总价：８ * 9 = 72", "72"), "总价：8 * 9 = 72", False) == "other"
    assert ee.classify(think("总价：8 * 9 = 71", "71"), "总价：8 * 9 = 72", False) == "arithmetic"


def test_classes_join_prompts_and_refuse_rows_without_solutions(tmp_path):
    prompts = pl.DataFrame({"prompt_id": ["a", "b"], "solution": [TWO_STEP, TWO_STEP]})
    pl.DataFrame({"prompt_id": ["a", "b"], "accuracy": [1.0, 0.0],
                  "completion": [think(TWO_STEP, "9"), think("4 * 5 = 20", "20")]}).write_parquet(tmp_path / "e.parquet")
    out = ee.classes(tmp_path / "e.parquet", prompts)
    assert out["class"].to_list() == ["right", "fewer_steps"]
    bare = prompts.with_columns(solution=pl.lit(None, pl.Utf8))
    try:
        ee.classes(tmp_path / "e.parquet", bare)
    except SystemExit as e:
        assert "e.parquet" in str(e)
    else:
        raise AssertionError("rows without a reference solution were classified")
