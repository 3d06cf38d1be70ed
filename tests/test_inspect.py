"""`grpo-pipeline inspect` over a small rollouts / scores / advantages tree."""

import polars as pl
import pytest
from rich.console import Console

from grpo_pipeline import schemas
from grpo_pipeline.cli import main
from grpo_pipeline.inspect import filtered, inspect, scan, summary_table

STEP = pl.List(pl.Struct({"start": pl.Int32, "end": pl.Int32, "reward": pl.Float64}))


@pytest.fixture()
def data(tmp_path):
    for it, n_prompts in (("it0", 2), ("it1", 1)):
        rows = []
        for p in range(n_prompts):
            for k in range(2):
                good = k == 0
                rows.append({
                    "iteration": it, "prompt_id": f"{it}-p{p}", "sample_idx": k, "question": f"Q{p}?",
                    "answer": "12", "operation": "mul", "prompt": "...", "prompt_token_ids": [1, 2],
                    "completion": "<think>3 * 4 = 12</think><answer>12</answer>" if good else "no idea " * 3,
                    "completion_token_ids": [3, 4], "completion_logprobs": [-1.0, -2.0], "completion_token_ends": [1, 2],
                    "finish_reason": "stop" if good else "length", "prompt_len": 2, "completion_len": 2,
                    "policy": "models/sft",
                })
        ro = pl.DataFrame(rows, schema_overrides={"sample_idx": pl.Int32})
        schemas.write_table(ro, tmp_path / f"rollouts/{it}/part-00000.parquet", "rollouts")
        acc = [1.0 if k == 0 else 0.0 for k in ro["sample_idx"]]
        sc = ro.select("iteration", "prompt_id", "sample_idx").with_columns(
            reward=pl.Series([2 * a for a in acc]), reward_error=pl.lit(None, pl.Utf8),
            steps=pl.Series([[]] * ro.height, dtype=STEP), reward_accuracy=pl.Series(acc), reward_format=pl.Series(acc))
        schemas.write_table(sc, tmp_path / f"scores/{it}.parquet", "scores")
        ad = ro.select("iteration", "prompt_id", "sample_idx").with_columns(
            advantage=pl.Series([1.0 if a else -1.0 for a in acc]), adv_mask=pl.lit(True),
            step_advantages=pl.lit(None, pl.List(pl.Struct({"end": pl.Int32, "value": pl.Float64}))))
        schemas.write_table(ad, tmp_path / f"advantages/{it}.parquet", "advantages")
    return tmp_path


def test_scan_joins_rewards_and_advantages(data):
    df = scan(data).collect()
    assert df.height == 6 and {"reward_accuracy", "reward", "advantage"} <= set(df.columns)
    assert df.filter(pl.col("sample_idx") == 0)["advantage"].to_list() == [1.0, 1.0, 1.0]


def test_filters(data):
    lf = scan(data)
    assert filtered(lf, iteration="it1").collect().height == 2
    assert filtered(lf, only_wrong=True).collect()["sample_idx"].to_list() == [1, 1, 1]
    assert filtered(lf, only_truncated=True).collect()["finish_reason"].unique().to_list() == ["length"]
    assert filtered(lf, prompt_id="it0-p1").collect().height == 2
    s = summary_table(lf)
    assert s["iteration"].to_list() == ["it0", "it1"] and s["completions"].to_list() == [4, 2]
    assert s["reward_accuracy"].to_list() == [0.5, 0.5]


def test_rich_output(data):
    console = Console(record=True, width=200)
    inspect(data_dir=data, iteration="it0", only_wrong=True, limit=1, console=console)
    text = console.export_text()
    assert "per iteration" in text and "it0 · it0-p0" in text and "it0-p1" not in text
    assert "no idea" in text and "-1.000" in text and "length" in text


def test_cli_errors_without_rollouts(tmp_path, capsys):
    with pytest.raises(SystemExit, match="no rollouts yet"):
        main(["inspect", "--data", str(tmp_path)])
