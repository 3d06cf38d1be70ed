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
    "advantage": ["advantage/abs_mean", "advantage/zero_std_group_share"],
    "update": ["loss", "kl", "clip_frac_low", "clip_frac_high", "entropy", "grad_norm", "tokens_per_s"],
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
                         ("accuracy", "format", "completion_len_mean", "truncated_share") if k in m}})
    return rows


def write_report(*, iter_dir: str, eval_dir: str, iterations: list[str], evaluations: list[str],
                 out_dir: str) -> dict[str, Any]:
    train = train_curve(Path(iter_dir), iterations)
    evals = eval_curve(Path(eval_dir), evaluations)
    write_json(Path(out_dir) / "train.json", train)
    write_json(Path(out_dir) / "eval.json", evals)
    summary: dict[str, Any] = {"iterations": len(train)}
    by_name = {r["checkpoint"]: r for r in evals}
    for name in ("base", "sft"):
        if name in by_name:
            summary[f"{name}/accuracy"], summary[f"{name}/format"] = by_name[name]["accuracy"], by_name[name]["format"]
    if evals and evals[-1]["checkpoint"] not in ("base", "sft"):
        summary["final/accuracy"], summary["final/format"] = evals[-1]["accuracy"], evals[-1]["format"]
        summary["final/checkpoint"] = evals[-1]["checkpoint"]
    return summary
