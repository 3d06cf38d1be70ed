"""score@itN: rule rewards for every completion, streamed by row groups to the scores Parquet."""

from __future__ import annotations

import polars as pl
import pyarrow as pa

from grpo_pipeline import schemas
from grpo_pipeline.config import RewardConfig
from grpo_pipeline.rewards import code, reward_metrics, score_frame
from grpo_pipeline.run import summary

SCORE_COLUMNS = ["iteration", "prompt_id", "sample_idx", "completion", "answer", "operation", "question"]


def run(cfg: RewardConfig, *, rollouts: str, out: str, metrics_path: str | None, batch_rows: int = 65536,
        prompts: str | None = None) -> dict:
    """Score ``rollouts``; ``prompts`` (the prompts file) gives coding rows their hidden ``tests``."""
    wanted = schemas.read_metadata(rollouts, "rollouts").get("groups_wanted")  # dynamic sampling's target
    meta = {"rollouts": rollouts, "reward": cfg.model_dump(), "groups_wanted": wanted}
    tests = _tests_table(prompts)
    batches = schemas.iter_batches(rollouts, "rollouts", batch_rows=batch_rows, columns=SCORE_COLUMNS)
    first = next(batches, None)
    if first is None or first.height == 0:
        raise ValueError(f"{rollouts}: no rollouts to score")
    scored = _score(first, cfg, tests, prompts)
    extra = [pa.field(c, pa.float64()) for c in scored.columns if c.startswith("reward_") and c != "reward_error"]
    extra += [f for f in code.EXTRA_FIELDS if f.name in scored.columns]
    with schemas.stream_writer(out, "scores", metadata=meta, extra_fields=extra) as write:
        write(scored)
        for batch in batches:
            write(_score(batch, cfg, tests, prompts))
    metrics = {**reward_metrics(pl.scan_parquet(out)), **code.reason_counts(pl.scan_parquet(out))}
    summary(f"score@{first['iteration'][0]}", metrics, path=metrics_path)
    return metrics


def _tests_table(prompts: str | None) -> pl.DataFrame | None:
    """prompt_id, tests, entry_point of a prompts file that has coding rows; None otherwise."""
    if prompts is None:
        return None
    table = schemas.read_table(prompts, "prompts", columns=["prompt_id", "tests", "entry_point"])
    return table if table["tests"].is_not_null().any() else None


def _score(batch: pl.DataFrame, cfg: RewardConfig, tests: pl.DataFrame | None = None,
           prompts: str | None = None) -> pl.DataFrame:
    if tests is not None:
        batch = code.attach_tests(batch, tests, source=str(prompts))
    scored, _ = score_frame(batch, cfg)
    return scored.with_columns(iteration=pl.lit(batch["iteration"][0]))
