"""advantage@itN: group-relative advantages from the scores Parquet, streamed by whole groups.

The sampler writes each group's rows together, so the scores file is read in batches and
each batch is cut after its last complete group; the trailing partial group is carried to
the next batch.  Memory stays bounded by the batch size, whatever the file size.  The
``batch`` std option needs the std of the whole iteration, so it reads the file at once.
"""

from __future__ import annotations

from collections.abc import Iterator

import polars as pl

from grpo_pipeline import schemas
from grpo_pipeline.advantages import compute_advantages, filter_groups
from grpo_pipeline.config import AdvantageConfig
from grpo_pipeline.run import summary


def whole_groups(batches: Iterator[pl.DataFrame], *, source: str) -> Iterator[pl.DataFrame]:
    """Re-cut ``batches`` so that no group (``prompt_id``) is split; error if a group is not contiguous."""
    carry: pl.DataFrame | None = None
    seen: set[str] = set()
    for batch in batches:
        if carry is not None:
            batch = pl.concat([carry, batch], how="vertical_relaxed")
        if batch.height == 0:
            continue
        last = batch["prompt_id"][-1]
        tail = batch["prompt_id"] == last
        start = batch.height - int(tail.cast(pl.Int32).reverse().cum_min().sum())  # first row of the trailing run
        done, carry = batch[:start], batch[start:]
        if done.height:
            ids = done["prompt_id"].unique(maintain_order=True)
            for pid in ids.to_list():
                if pid in seen:
                    msg = f"{source}: the rows of group prompt_id={pid!r} are not contiguous (it reappears later)"
                    raise ValueError(msg)
            seen.update(ids.to_list())
            if done["prompt_id"].n_unique() != done.select(pl.col("prompt_id").rle_id().n_unique()).item():
                raise ValueError(f"{source}: the rows of some group are not contiguous (prompt ids interleave)")
            yield done
    if carry is not None and carry.height:
        if carry["prompt_id"][0] in seen:
            raise ValueError(f"{source}: the rows of group prompt_id={carry['prompt_id'][0]!r} are not contiguous")
        yield carry


def filter_column(cfg: AdvantageConfig, scores: str) -> str:
    """The scores column that decides a group's informativeness under ``filter_groups``.

    ``reward_<filter_reward>``, or the total ``reward`` for ``total``; a named component the scores do
    not have (a task without it, e.g. coding scored by tests alone) falls back to the total, said in one line.
    """
    if cfg.filter_reward == "total":
        return "reward"
    by = f"reward_{cfg.filter_reward}"
    have = schemas.column_names(scores, "scores")
    if by in have:
        return by
    print(f"[advantage] {scores} has no {by!r} (reward columns {[c for c in have if c.startswith('reward')]}): "
          "groups are filtered on the total reward", flush=True)
    return "reward"


def run(cfg: AdvantageConfig, *, scores: str, out: str, metrics_path: str | None, batch_rows: int = 262144) -> dict:
    cols = ["iteration", "prompt_id", "sample_idx", "reward"] + (["steps"] if cfg.estimator == "process" else [])
    wanted = schemas.read_metadata(scores, "scores").get("groups_wanted") if cfg.filter_groups else None
    by = filter_column(cfg, scores) if cfg.filter_groups else "reward"
    if by != "reward":
        cols.append(by)
    if cfg.std == "batch":
        chunks: Iterator[pl.DataFrame] = iter([schemas.read_table(scores, "scores", columns=cols)])
    else:
        chunks = whole_groups(schemas.iter_batches(scores, "scores", batch_rows=batch_rows, columns=cols), source=scores)
    totals = {"abs_sum": 0.0, "rows": 0, "unmasked": 0, "groups": 0, "zero_std_groups": 0.0, "masked": 0}
    dynamic = {"groups": 0, "dropped": 0, "kept": 0, "surplus": 0}
    iteration = None
    with schemas.stream_writer(out, "advantages", metadata={"scores": scores, "advantage": cfg.model_dump()}) as write:
        for df in chunks:
            iteration = iteration or df["iteration"][0]
            adv, m = compute_advantages(df, cfg)
            if cfg.filter_groups:
                judged = df.select("prompt_id", reward=pl.col(by))
                adv, n = filter_groups(judged, adv, wanted=wanted, kept_before=dynamic["kept"])
                dynamic = {k: dynamic[k] + n[k] for k in dynamic}
            write(adv.with_columns(iteration=pl.lit(iteration)))
            unmasked = int(adv["adv_mask"].sum())
            totals["abs_sum"] += m["advantage/abs_mean"] * unmasked
            totals["unmasked"] += unmasked
            totals["rows"] += adv.height
            totals["groups"] += m["advantage/groups"]
            totals["zero_std_groups"] += m["advantage/zero_std_group_share"] * m["advantage/groups"]
            totals["masked"] += m["advantage/masked_rows"]
        if not totals["rows"]:  # inside the writer: the output file is not created
            raise ValueError(f"{scores}: no scored completions")
    metrics = {
        "advantage/abs_mean": round(totals["abs_sum"] / max(totals["unmasked"], 1), 6),
        "advantage/zero_std_group_share": round(totals["zero_std_groups"] / max(totals["groups"], 1), 6),
        "advantage/masked_rows": totals["masked"],
        "advantage/groups": totals["groups"],
        "rows": totals["rows"],
    }
    if cfg.filter_groups:  # DAPO dynamic sampling: what the update trains on
        metrics.update({"dynamic/dropped_group_share": round(dynamic["dropped"] / max(dynamic["groups"], 1), 6),
                        "dynamic/kept_groups": dynamic["kept"], "dynamic/surplus_groups": dynamic["surplus"],
                        "dynamic/groups_wanted": wanted if wanted is not None else dynamic["kept"]})
        if not dynamic["kept"]:
            print(f"[advantage@{iteration}] warning: every group's rewards are all equal: the update has "
                  "nothing to learn from this iteration", flush=True)
    summary(f"advantage@{iteration}", metrics, path=metrics_path)
    return metrics
