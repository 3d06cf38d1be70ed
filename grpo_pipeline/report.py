"""Curves across iterations, for ``dvc plots``: one row per iteration and one per evaluated checkpoint.

Each stage writes its own metrics JSON (``metrics/iterations/<it>/<stage>.json``,
``metrics/eval/<name>.json``); DVC plots need the values of all iterations in one file, so the
``report`` stage gathers them into ``metrics/curves/train.json`` and ``metrics/curves/eval.json``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from grpo_pipeline.io import write_json

TRAIN_KEYS = {
    "sample": ["completion_len_mean", "truncated_share", "completion_tokens_per_s"],
    "score": None,  # every */mean
    "advantage": ["advantage/abs_mean", "advantage/zero_std_group_share", "dynamic/dropped_group_share",
                  "dynamic/kept_groups"],
    "update": ["loss", "kl", "clip_frac_low", "clip_frac_high", "entropy", "grad_norm", "tokens_per_s", "steps",
               "sequences", "overlong_masked", "mismatch/logp_diff_mean", "mismatch/logp_diff_max",
               "mismatch/outside_cap_share", "mismatch/kl_k3"],
}


def _load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.exists() else {}


def train_curve(iter_dir: Path, iterations: list[str]) -> list[dict[str, Any]]:
    """Rows ``{iteration, index, reward/<name>/mean..., completion_len_mean, kl, ...}``."""
    rows = []
    for i, it in enumerate(iterations):
        row: dict[str, Any] = {"iteration": it, "index": i}
        for stage, keys in TRAIN_KEYS.items():
            m = _load(iter_dir / it / f"{stage}.json")
            if keys is None:
                row.update({f"reward/{k.removesuffix('/mean')}": v for k, v in m.items() if k.endswith("/mean")})
            else:
                row.update({k: m[k] for k in keys if k in m})
        rows.append(row)
    return rows


def eval_curve(eval_dir: Path, names: list[str]) -> list[dict[str, Any]]:
    """Rows ``{checkpoint, order, accuracy, format, completion_len_mean}`` in training order."""
    rows = []
    for order, name in enumerate(names):
        m = _load(eval_dir / f"{name}.json")
        if m:
            rows.append({"checkpoint": name, "order": order, **{k: m[k] for k in
                         ("accuracy", "accuracy_se", "format", "format_se", "completion_len_mean",
                          "truncated_share", "prompts") if k in m}})
    return rows


def paired_difference(before: Path, after: Path) -> tuple[float, float, int] | None:
    """Mean and standard error of ``accuracy(after) - accuracy(before)`` over the prompts both evaluated.

    Paired by ``prompt_id`` (the same prompts, so the SE is that of the per-prompt differences,
    ``std(d, ddof=1) / sqrt(n)``); ``None`` when either eval file is missing or they share no prompt.
    """
    if not (before.exists() and after.exists()):
        return None
    import polars as pl

    a = pl.read_parquet(before, columns=["prompt_id", "accuracy"])
    b = pl.read_parquet(after, columns=["prompt_id", "accuracy"])
    d = a.join(b, on="prompt_id", suffix="_after").select(pl.col("accuracy_after") - pl.col("accuracy"))
    n = d.height
    if n == 0:
        return None
    diff = d.to_series()
    return float(diff.mean()), float(diff.std(ddof=1) / n**0.5) if n > 1 else 0.0, n


def write_report(*, iter_dir: str, eval_dir: str, iterations: list[str], evaluations: list[str],
                 out_dir: str, eval_data_dir: str | None = None) -> dict[str, Any]:
    train = train_curve(Path(iter_dir), iterations)
    evals = eval_curve(Path(eval_dir), evaluations)
    write_json(Path(out_dir) / "train.json", train)
    write_json(Path(out_dir) / "eval.json", evals)
    summary: dict[str, Any] = {"iterations": len(train)}
    by_name = {r["checkpoint"]: r for r in evals}
    def put(label: str, row: dict) -> None:
        for k in ("accuracy", "accuracy_se", "format", "prompts"):
            if k in row:
                summary[f"{label}/{k}"] = row[k]

    for name in ("base", "sft"):
        if name in by_name:
            put(name, by_name[name])
    if evals and evals[-1]["checkpoint"] not in ("base", "sft"):
        put("final", evals[-1])
        summary["final/checkpoint"] = evals[-1]["checkpoint"]
        paired = eval_data_dir and "sft" in by_name and paired_difference(
            Path(eval_data_dir) / "sft.parquet", Path(eval_data_dir) / f"{evals[-1]['checkpoint']}.parquet")
        if paired:
            mean, se, n = paired
            summary.update({"final_minus_sft/accuracy": round(mean, 4), "final_minus_sft/accuracy_se": round(se, 4),
                            "final_minus_sft/prompts": n})
    return summary
