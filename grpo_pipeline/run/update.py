"""update@itN: one GRPO policy update from the iteration's rollouts and advantages."""

from __future__ import annotations

import time

import polars as pl
import torch

from grpo_pipeline import schemas
from grpo_pipeline.advantages import token_advantages_from_steps
from grpo_pipeline.checkpoint import load_model, load_tokenizer, read_checkpoint_metadata, save_checkpoint
from grpo_pipeline.config import UpdateConfig
from grpo_pipeline.io import write_json
from grpo_pipeline.run import summary
from grpo_pipeline.update import Rollout, train

ROLLOUT_COLUMNS = ["iteration", "prompt_id", "sample_idx", "prompt_token_ids", "completion_token_ids"]


def load_rollouts(rollouts: str, advantages: str, tokenizer) -> tuple[list[Rollout], int, str]:
    """Join rollouts with their advantages; rows masked by the advantage stage are left out."""
    ro = schemas.read_table(rollouts, "rollouts", columns=ROLLOUT_COLUMNS)
    adv = schemas.read_table(advantages, "advantages")
    df = ro.join(adv.drop("iteration"), on=["prompt_id", "sample_idx"], how="left")
    missing = df.filter(pl.col("advantage").is_null())
    if missing.height:
        r = missing.row(0, named=True)
        msg = (f"{advantages}: no advantage for {missing.height} rollouts of {rollouts}, first "
               f"prompt_id={r['prompt_id']!r} sample_idx={r['sample_idx']}. Hint: rerun the advantage stage")
        raise ValueError(msg)
    n_masked = int((~df["adv_mask"]).sum())
    df = df.filter(pl.col("adv_mask") & (pl.col("completion_token_ids").list.len() > 0))
    process = df["step_advantages"].list.len().fill_null(0).sum() > 0
    rows = []
    for r in df.iter_rows(named=True):
        a: float | list[float] = float(r["advantage"])
        if process:
            ids = r["completion_token_ids"]
            ends = [len(tokenizer.decode(ids[: t + 1], skip_special_tokens=False)) for t in range(len(ids))]
            steps = r["step_advantages"] or []
            a = token_advantages_from_steps([s["end"] for s in steps], [s["value"] for s in steps], ends).tolist()
        rows.append(Rollout(r["prompt_token_ids"], r["completion_token_ids"], a, f"{r['prompt_id']}/{r['sample_idx']}"))
    return rows, n_masked, ro["iteration"][0]


def run(cfg: UpdateConfig, *, policy: str, reference: str | None, rollouts: str, advantages: str, out: str,
        metrics_path: str | None, steps_path: str | None) -> dict:
    t_start = time.perf_counter()
    torch.manual_seed(cfg.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tokenizer = load_tokenizer(policy)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    rows, n_masked, iteration = load_rollouts(rollouts, advantages, tokenizer)
    model = load_model(policy, dtype="float32", device=device)
    ref_model = None
    if cfg.beta > 0 and cfg.reference == "sft":
        if not reference:
            raise ValueError("update.reference is 'sft' but no reference checkpoint was given (--reference)")
        ref_model = load_model(reference, dtype="bfloat16" if cfg.dtype == "bfloat16" else "float32",
                               device=device).eval().requires_grad_(False)
    prev = read_checkpoint_metadata(policy).get("train_state", {})
    start_step = int(prev.get("global_step", 0))
    history, _ = train(model, rows, cfg, pad_id=pad_id, ref_model=ref_model, device=device, start_step=start_step)
    del ref_model
    meta = {**read_checkpoint_metadata(policy), "parent": policy,
            "train_state": {"global_step": start_step + len(history), "iteration": iteration}}
    save_checkpoint(model, tokenizer, out, metadata=meta)

    keys = ["loss", "policy_loss", "kl", "clip_frac_low", "clip_frac_high", "ratio_mean", "entropy", "grad_norm"]
    metrics = {k: round(sum(h[k] for h in history) / len(history), 6) for k in keys if k in history[0]}
    metrics.update(
        ratio_min=round(min(h["ratio_min"] for h in history), 6), ratio_max=round(max(h["ratio_max"] for h in history), 6),
        steps=len(history), sequences=len(rows), masked=n_masked,
        tokens_per_s=round(sum(h["tokens"] for h in history) / sum(h["tokens"] / h["tokens_per_s"] for h in history), 2),
        peak_memory_mb=round(max(h["peak_memory_mb"] for h in history), 1),
        wall_s=round(time.perf_counter() - t_start, 2),
    )
    if steps_path:
        write_json(steps_path, [{k: (round(v, 6) if isinstance(v, float) else v) for k, v in h.items()} for h in history])
    summary(f"update@{iteration}", metrics, path=metrics_path)
    return metrics
