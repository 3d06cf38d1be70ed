"""evaluate: greedy accuracy and format compliance of a checkpoint on the held-out prompts."""

from __future__ import annotations

import polars as pl

from grpo_pipeline import schemas
from grpo_pipeline.checkpoint import load_tokenizer
from grpo_pipeline.config import EvaluateConfig, RewardConfig, SamplingConfig
from grpo_pipeline.rewards import score_frame
from grpo_pipeline.run import summary
from grpo_pipeline.run.sample import backend_for, build_requests, spec_from

EVAL_REWARDS = RewardConfig(weights={"accuracy": 1.0, "format": 1.0}, step_scorer=None)


def run(cfg: EvaluateConfig, sampling: SamplingConfig, *, name: str, checkpoint: str, prompts: str, out: str,
        metrics_path: str | None) -> dict:
    df = schemas.read_table(prompts, "prompts")
    if cfg.n_prompts:
        df = df.head(cfg.n_prompts)
    tokenizer = load_tokenizer(checkpoint)
    spec = spec_from(sampling, n=1, temperature=0.0, max_new_tokens=cfg.max_new_tokens)
    requests, _ = build_requests(df, tokenizer, iteration=name, seed=sampling.seed,
                                 max_prompt_len=sampling.max_model_len - cfg.max_new_tokens, source=prompts)
    backend = backend_for(sampling, checkpoint)
    samples = backend.generate(requests, spec)
    completions = df.select("prompt_id", "answer", "operation").with_columns(
        sample_idx=pl.lit(0, pl.Int32), completion=pl.Series([g[0].text for g in samples]),
        completion_len=pl.Series([len(g[0].token_ids) for g in samples], dtype=pl.Int32),
        finish_reason=pl.Series([g[0].finish_reason for g in samples]))
    scored, _ = score_frame(completions, EVAL_REWARDS)
    result = completions.with_columns(checkpoint=pl.lit(name), accuracy=scored["reward_accuracy"],
                                      format=scored["reward_format"])
    schemas.write_table(result, out, "eval", metadata={"checkpoint": checkpoint, **backend.versions()})
    metrics = {
        "accuracy": round(float(result["accuracy"].fill_null(0).mean()), 4),
        "format": round(float(result["format"].fill_null(0).mean()), 4),
        "completion_len_mean": round(float(result["completion_len"].mean()), 2),
        "truncated_share": round(float((result["finish_reason"] == "length").mean()), 4),
        "prompts": result.height,
    }
    summary(f"evaluate@{name}", metrics, path=metrics_path)
    return metrics
