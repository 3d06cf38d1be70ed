"""advantage@itN: group-relative advantages from the scores Parquet."""

from __future__ import annotations

import polars as pl

from grpo_pipeline import schemas
from grpo_pipeline.advantages import compute_advantages
from grpo_pipeline.config import AdvantageConfig
from grpo_pipeline.run import summary


def run(cfg: AdvantageConfig, *, scores: str, out: str, metrics_path: str | None) -> dict:
    cols = ["iteration", "prompt_id", "sample_idx", "reward"] + (["steps"] if cfg.estimator == "process" else [])
    df = schemas.read_table(scores, "scores", columns=cols)
    if df.height == 0:
        raise ValueError(f"{scores}: no scored completions")
    adv, metrics = compute_advantages(df, cfg)
    adv = adv.with_columns(iteration=pl.lit(df["iteration"][0]))
    if "step_advantages" not in adv.columns:
        adv = adv.with_columns(step_advantages=None)
    schemas.write_table(adv, out, "advantages", metadata={"scores": scores, "advantage": cfg.model_dump()})
    metrics = {k: (round(v, 6) if isinstance(v, float) else v) for k, v in metrics.items()}
    summary(f"advantage@{df['iteration'][0]}", metrics, path=metrics_path)
    return metrics
