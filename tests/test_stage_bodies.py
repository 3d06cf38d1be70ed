"""The score and advantage stage bodies on real Parquet files: streaming equals all-at-once, bad input is named."""

import json

import numpy as np
import polars as pl
import pytest

from grpo_pipeline import schemas
from grpo_pipeline.advantages import compute_advantages
from grpo_pipeline.config import AdvantageConfig, RewardConfig
from grpo_pipeline.run import advantage, score
from grpo_pipeline.run.advantage import whole_groups


def rollouts(n_prompts=7, g=4, seed=0) -> pl.DataFrame:
    rng = np.random.default_rng(seed)
    rows = []
    for p in range(n_prompts):
        for k in range(g):
            ok = rng.random() < 0.5
            ans = "12" if ok else str(rng.integers(0, 30))
            comp = f"<think>3 * 4 = 12</think><answer>{ans}</answer>" if rng.random() < 0.7 else f"answer {ans}"
            rows.append({"iteration": "it0", "prompt_id": f"p{p:03d}", "sample_idx": k, "question": "3*4?",
                         "answer": "12", "operation": "mul", "prompt": "q", "prompt_token_ids": [1],
                         "completion": comp, "completion_token_ids": [2, 3], "completion_logprobs": [-1.0, -1.0],
                         "completion_token_ends": [1, len(comp)],
                         "finish_reason": "stop", "prompt_len": 1, "completion_len": 2, "policy": "m"})
    return pl.DataFrame(rows, schema_overrides={"sample_idx": pl.Int32})


@pytest.fixture()
def scored(tmp_path):
    schemas.write_table(rollouts(), tmp_path / "ro/part-00000.parquet", "rollouts")
    score.run(RewardConfig(weights={"accuracy": 1.0, "format": 1.0}), rollouts=str(tmp_path / "ro"), out=str(tmp_path / "scores.parquet"),
              metrics_path=str(tmp_path / "score.json"), batch_rows=5)
    return tmp_path


def test_score_stage_streams_and_reports(scored):
    sc = schemas.read_table(scored / "scores.parquet", "scores")
    assert sc.height == 28 and sc["iteration"].unique().to_list() == ["it0"]
    assert (sc["reward"] - sc["reward_accuracy"] - sc["reward_format"]).abs().max() < 1e-12
    m = json.loads((scored / "score.json").read_text())
    assert m["completions"] == 28 and m["total/mean"] == pytest.approx(sc["reward"].mean())


@pytest.mark.parametrize("batch_rows", [1, 3, 5, 1000])
def test_advantage_stage_streaming_equals_all_at_once(scored, batch_rows):
    out = scored / f"adv{batch_rows}.parquet"
    cfg = AdvantageConfig(filter_groups=False)
    m = advantage.run(cfg, scores=str(scored / "scores.parquet"), out=str(out),
                      metrics_path=None, batch_rows=batch_rows)
    got = schemas.read_table(out, "advantages")
    want, wm = compute_advantages(schemas.read_table(scored / "scores.parquet", "scores"), cfg)
    assert got["prompt_id"].to_list() == want["prompt_id"].to_list()
    np.testing.assert_allclose(got["advantage"].to_numpy(), want["advantage"].to_numpy(), atol=1e-12)
    assert m["advantage/groups"] == 7 and m["advantage/abs_mean"] == pytest.approx(wm["advantage/abs_mean"], abs=1e-6)


def test_whole_groups_rejects_interleaved_groups():
    df = pl.DataFrame({"prompt_id": ["a", "a", "b", "b", "a"]})
    with pytest.raises(ValueError, match="not contiguous"):
        list(whole_groups(iter([df[:2], df[2:4], df[4:]]), source="s.parquet"))
    with pytest.raises(ValueError, match="not contiguous"):
        list(whole_groups(iter([df]), source="s.parquet"))


def test_empty_and_corrupt_inputs_write_nothing(tmp_path):
    schemas.write_table(rollouts().head(0), tmp_path / "ro/part-00000.parquet", "rollouts")
    with pytest.raises(ValueError, match="no rollouts to score"):
        score.run(RewardConfig(weights={"accuracy": 1.0, "format": 1.0}), rollouts=str(tmp_path / "ro"), out=str(tmp_path / "s.parquet"), metrics_path=None)
    (tmp_path / "bad.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(schemas.SchemaError, match="bad.parquet"):
        advantage.run(AdvantageConfig(), scores=str(tmp_path / "bad.parquet"), out=str(tmp_path / "a.parquet"),
                      metrics_path=None)
    assert not (tmp_path / "s.parquet").exists() and not (tmp_path / "a.parquet").exists()


def test_nan_reward_is_named(tmp_path):
    sc = pl.DataFrame({"iteration": ["it0"] * 2, "prompt_id": ["p", "p"], "sample_idx": [0, 1],
                       "reward": [1.0, float("nan")], "reward_error": [None, None], "steps": [[], []]},
                      schema_overrides={"sample_idx": pl.Int32, "reward_error": pl.Utf8,
                                        "steps": pl.List(pl.Struct({"start": pl.Int32, "end": pl.Int32,
                                                                    "reward": pl.Float64}))})
    schemas.write_table(sc, tmp_path / "s.parquet", "scores")
    with pytest.raises(ValueError, match="sample_idx"):
        advantage.run(AdvantageConfig(), scores=str(tmp_path / "s.parquet"), out=str(tmp_path / "a.parquet"),
                      metrics_path=None)
    assert not (tmp_path / "a.parquet").exists()
