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
    customs = [f"reward_{c.name}" for c in cfg.custom]
    valued = {c: scored[c].count() for c in customs}          # non-null values per custom reward
    n = scored.height
    with schemas.stream_writer(out, "scores", metadata=meta, extra_fields=extra) as write:
        write(scored)
        for batch in batches:
            part = _score(batch, cfg, tests, prompts)
            valued = {c: valued[c] + part[c].count() for c in customs}
            n += part.height
            write(part)
        _require_values(valued, cfg, rollouts, n)            # inside the writer: no file on failure
    metrics = {**reward_metrics(pl.scan_parquet(out)), **code.reason_counts(pl.scan_parquet(out))}
    summary(f"score@{first['iteration'][0]}", metrics, path=metrics_path)
    return metrics


def _require_values(valued: dict[str, int], cfg: RewardConfig, rollouts: str, n: int) -> None:
    """A custom reward that returned None for every completion is an error here, naming it (not at the update)."""
    for c in cfg.custom:
        if valued[f"reward_{c.name}"] == 0:
            msg = (f"{rollouts}: custom reward {c.name!r} ({c.function}) returned no value (None) for any of the {n} "
                   "completions, so every total reward is null. Hint: check the function on one row")
            raise ValueError(msg)


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
