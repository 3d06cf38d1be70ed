"""evaluate: greedy accuracy and format compliance of a checkpoint on the held-out prompts.

Decoding goes through the same sampling backend as ``sample`` (greedy: temperature 0), and
completions are judged by the same rule rewards as training (accuracy and strict format); a
coding prompt (one with ``tests``) is correct when its code passes every hidden test in the
sandbox (``reward.tests`` limits; all or nothing). ``reward.rel_tol`` is the numeric tolerance.
The ``sampling`` keys it reads are listed one by one in ``dvc.yaml`` (not ``group_size``,
``temperature``, ``max_new_tokens``, ...: training's sampling does not rerun the evaluations).
With ``evaluate.pass_k`` set, ``pass_samples`` sampled completions per prompt also give the
unbiased pass@k estimate of Chen et al. (2021): ``1 - C(n - c, k) / C(n, k)``.
"""

from __future__ import annotations

from math import comb

import polars as pl

from grpo_pipeline import schemas
from grpo_pipeline.checkpoint import load_tokenizer
from grpo_pipeline.config import EvaluateConfig, RewardConfig, SamplingConfig
from grpo_pipeline.hardware import resolve_dtype
from grpo_pipeline.rewards import score_frame
from grpo_pipeline.run import summary
from grpo_pipeline.sampling import backend_for, build_requests, spec_from


def eval_rewards(reward: RewardConfig, *, coding: bool) -> RewardConfig:
    """The judge's rewards: accuracy and strict format (and all-or-nothing tests), with ``reward.rel_tol``
    and the ``reward.tests`` sandbox limits of params.yaml."""
    weights = {"accuracy": 1.0, "format": 1.0, **({"tests": 1.0} if coding else {})}
    return RewardConfig(weights=weights, step_scorer=None, rel_tol=reward.rel_tol,
                        tests=reward.tests.model_copy(update={"all_or_nothing": True}))


def judge(completions: pl.DataFrame, reward: RewardConfig) -> pl.DataFrame:
    """Add ``accuracy`` and ``format`` (1/0) to rows with ``prompt_id, sample_idx, completion, answer``.

    Rows with ``tests`` (coding prompts; ``entry_point`` beside it) are accurate when all tests pass.
    """
    coding = "tests" in completions.columns and completions["tests"].is_not_null().any()
    scored, _ = score_frame(completions, eval_rewards(reward, coding=coding))
    accuracy = scored["reward_accuracy"]
    if coding:
        accuracy = pl.select(pl.when(completions["tests"].is_not_null()).then(scored["reward_tests"])
                             .otherwise(accuracy)).to_series()
    return completions.with_columns(accuracy=accuracy.fill_null(0.0), format=scored["reward_format"].fill_null(0.0))


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct."""
    return 1.0 if n - c < k else 1.0 - comb(n - c, k) / comb(n, k)


def standard_error(values: pl.Series) -> float:
    """Standard error of the mean, ``sqrt(s^2 / n)`` with the sample variance (ddof 1); 0 for n < 2."""
    n = values.len()
    return float(values.std(ddof=1) / n**0.5) if n > 1 else 0.0


def eval_metrics(result: pl.DataFrame) -> dict:
    """Means over prompts, each 0/1 score with its standard error (``<name>_se``)."""
    return {
        "accuracy": round(float(result["accuracy"].mean()), 4),
        "accuracy_se": round(standard_error(result["accuracy"]), 4),
        "format": round(float(result["format"].mean()), 4),
        "format_se": round(standard_error(result["format"]), 4),
        "completion_len_mean": round(float(result["completion_len"].mean()), 2),
        "truncated_share": round(float((result["finish_reason"] == "length").mean()), 4),
        "prompts": result.height,
    }


def _frame(df: pl.DataFrame, samples, k: int = 0) -> pl.DataFrame:
    keep = [c for c in ("prompt_id", "answer", "operation", "tests", "entry_point") if c in df.columns]
    return df.select(keep).with_columns(
        sample_idx=pl.lit(k, pl.Int32), completion=pl.Series([g[k].text for g in samples], dtype=pl.Utf8),
        completion_len=pl.Series([len(g[k].token_ids) for g in samples], dtype=pl.Int32),
        finish_reason=pl.Series([g[k].finish_reason for g in samples], dtype=pl.Utf8))


def run(cfg: EvaluateConfig, sampling: SamplingConfig, reward: RewardConfig, *, name: str, checkpoint: str,
        prompts: str, out: str, metrics_path: str | None, n_prompts: int | None = None) -> dict:
    """Greedy-decode the first ``n_prompts`` (else ``cfg.n_prompts``, else all) eval prompts and judge them."""
    sampling = sampling.model_copy(update={"dtype": resolve_dtype(sampling.dtype, what=f"evaluate@{name}")})
    df = schemas.read_table(prompts, "prompts")
    n_prompts = n_prompts or cfg.n_prompts
    if n_prompts:
        df = df.head(n_prompts)
    tokenizer = load_tokenizer(checkpoint)
    requests, _ = build_requests(df, tokenizer, iteration=f"eval/{name}", seed=cfg.seed,
                                 max_prompt_len=sampling.max_model_len - cfg.max_new_tokens, source=prompts)
    backend = backend_for(sampling, checkpoint, seed=cfg.seed)
    greedy = backend.generate(requests, spec_from(sampling, n=1, temperature=0.0, max_new_tokens=cfg.max_new_tokens))
    result = judge(_frame(df, greedy), reward).with_columns(checkpoint=pl.lit(name)).drop("tests", "entry_point", strict=False)
    metrics = eval_metrics(result)
    if cfg.pass_k:
        spec = spec_from(sampling, n=cfg.pass_samples, temperature=cfg.pass_temperature,
                         max_new_tokens=cfg.max_new_tokens)
        sampled = backend.generate(requests, spec)
        judged = pl.concat([judge(_frame(df, sampled, k), reward) for k in range(cfg.pass_samples)])
        correct = judged.group_by("prompt_id").agg(pl.col("accuracy").sum().alias("c"))["c"].to_list()
        metrics[f"pass@{cfg.pass_k}"] = round(sum(pass_at_k(cfg.pass_samples, int(c), cfg.pass_k)
                                                  for c in correct) / len(correct), 4)
    schemas.write_table(result, out, "eval", metadata={"checkpoint": checkpoint, **backend.versions()})
    summary(f"evaluate@{name}", metrics, path=metrics_path)
    return metrics
