"""``grpo-pipeline inspect``: rollouts per group, with their reward components and advantages.

Built on polars lazy scans over ``data/rollouts/*/*.parquet`` joined with
``data/scores/*.parquet`` and ``data/advantages/*.parquet``: filters are pushed down, so
only the groups printed are materialised, even over millions of rows.
"""

from __future__ import annotations

from pathlib import Path

import polars as pl
from rich.console import Console
from rich.table import Table

KEY = ["iteration", "prompt_id", "sample_idx"]


def scan(data_dir: str | Path = "data") -> pl.LazyFrame:
    """All iterations' rollouts, left-joined with their scores and advantages where present."""
    d = Path(data_dir)
    if not list(d.glob("rollouts/*/*.parquet")):
        raise FileNotFoundError(f"{d}/rollouts/*/*.parquet: no rollouts yet. Hint: dvc repro sample@it0")
    lf = pl.scan_parquet(d / "rollouts/*/*.parquet").drop(
        "prompt_token_ids", "completion_token_ids", "completion_logprobs")
    if list(d.glob("scores/*.parquet")):
        lf = lf.join(pl.scan_parquet(d / "scores/*.parquet", missing_columns="insert").drop("steps", strict=False), on=KEY, how="left")
    if list(d.glob("advantages/*.parquet")):
        lf = lf.join(pl.scan_parquet(d / "advantages/*.parquet").select(*KEY, "advantage", "adv_mask"),
                     on=KEY, how="left")
    return lf


def filtered(lf: pl.LazyFrame, *, iteration: str | None = None, prompt_id: str | None = None,
             only_wrong: bool = False, only_truncated: bool = False) -> pl.LazyFrame:
    names = lf.collect_schema().names()
    if iteration:
        lf = lf.filter(pl.col("iteration") == iteration)
    if prompt_id:
        lf = lf.filter(pl.col("prompt_id") == prompt_id)
    if only_wrong:
        if "reward_accuracy" not in names:
            raise ValueError("--only-wrong needs scores. Hint: dvc repro score@<iteration>")
        lf = lf.filter(pl.col("reward_accuracy").fill_null(0) < 1)
    if only_truncated:
        lf = lf.filter(pl.col("finish_reason") == "length")
    return lf


def summary_table(lf: pl.LazyFrame) -> pl.DataFrame:
    """One row per iteration: completions, groups, mean of each reward, truncation, length."""
    names = lf.collect_schema().names()
    rewards = [c for c in names if c == "reward" or (c.startswith("reward_") and c != "reward_error")]
    return (lf.group_by("iteration").agg(
        pl.len().alias("completions"), pl.col("prompt_id").n_unique().alias("groups"),
        *[pl.col(c).mean().round(3) for c in rewards],
        (pl.col("finish_reason") == "length").mean().round(3).alias("truncated"),
        pl.col("completion_len").mean().round(1).alias("len_mean"),
    ).sort("iteration").collect())


def inspect(*, data_dir: str | Path = "data", iteration: str | None = None, prompt_id: str | None = None,
            only_wrong: bool = False, only_truncated: bool = False, limit: int = 5, summary_only: bool = False,
            console: Console | None = None) -> None:
    console = console or Console()
    lf = filtered(scan(data_dir), iteration=iteration, prompt_id=prompt_id, only_wrong=only_wrong,
                  only_truncated=only_truncated)
    summ = summary_table(lf)
    t = Table(title="per iteration")
    for c in summ.columns:
        t.add_column(c, justify="right" if c != "iteration" else "left")
    for row in summ.iter_rows():
        t.add_row(*[str(v) for v in row])
    console.print(t)
    if summary_only:
        return
    groups = lf.select("iteration", "prompt_id").unique().sort("iteration", "prompt_id").head(limit).collect()
    rows = lf.join(groups.lazy(), on=["iteration", "prompt_id"], how="semi").sort(KEY).collect()
    names = rows.columns
    rewards = [c for c in names if c.startswith("reward_") and c != "reward_error"]
    for (it, pid), g in rows.group_by(["iteration", "prompt_id"], maintain_order=True):
        first = g.row(0, named=True)
        t = Table(title=f"{it} · {pid} · answer {first['answer']!r}", caption=first["question"], show_lines=True)
        t.add_column("#", justify="right")
        t.add_column("completion", overflow="fold", ratio=1)
        for c in [*rewards, "reward", "advantage"]:
            if c in names:
                t.add_column(c.removeprefix("reward_"), justify="right")
        t.add_column("finish")
        for r in g.iter_rows(named=True):
            vals = [_fmt(r.get(c)) for c in [*rewards, "reward", "advantage"] if c in names]
            t.add_row(str(r["sample_idx"]), r["completion"], *vals, r["finish_reason"])
        console.print(t)


def _fmt(v: object) -> str:
    return "—" if v is None else (f"{v:+.3f}" if isinstance(v, float) else str(v))
