"""sample@itN: G completions per prompt from the iteration's policy, streamed to Parquet."""

from __future__ import annotations

import time
from pathlib import Path

import polars as pl

from grpo_pipeline import schemas
from grpo_pipeline.checkpoint import load_tokenizer
from grpo_pipeline.config import SamplingConfig
from grpo_pipeline.io import atomic_dir
from grpo_pipeline.run import summary
from grpo_pipeline.sampling import Request, RolloutStats, SamplingSpec, make_backend, request_seed, select_prompts
from grpo_pipeline.template import render_prompt

BATCH_PROMPTS = 256  # prompts per engine call: results reach the Parquet file in batches


def build_requests(prompts: pl.DataFrame, tokenizer, *, iteration: str, seed: int, max_prompt_len: int,
                   source: str) -> tuple[list[Request], list[str]]:
    """Tokenised chat prompts, one per row; a prompt too long for the context is an error, never dropped."""
    texts = [render_prompt(tokenizer, q) for q in prompts["question"].to_list()]
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    requests = []
    for pid, toks in zip(prompts["prompt_id"].to_list(), ids):
        if len(toks) > max_prompt_len:
            msg = (f"{source}: prompt {pid!r} has {len(toks)} tokens, more than the {max_prompt_len} left for it "
                   "(sampling.max_model_len - max_new_tokens). Hint: raise sampling.max_model_len or shorten the prompt")
            raise ValueError(msg)
        requests.append(Request(pid, list(toks), request_seed(seed, iteration, pid)))
    return requests, texts


def spec_from(cfg: SamplingConfig, *, n: int | None = None, temperature: float | None = None,
              max_new_tokens: int | None = None) -> SamplingSpec:
    return SamplingSpec(
        n=n or cfg.group_size, temperature=cfg.temperature if temperature is None else temperature,
        top_p=cfg.top_p, top_k=cfg.top_k, min_p=cfg.min_p,
        max_new_tokens=max_new_tokens or cfg.max_new_tokens, stop=tuple(cfg.stop),
    )


def backend_for(cfg: SamplingConfig, policy: str):
    return make_backend(
        cfg.backend, policy, dtype=cfg.dtype, max_model_len=cfg.max_model_len,
        gpu_memory_utilization=cfg.gpu_memory_utilization, tensor_parallel_size=cfg.tensor_parallel_size,
        enforce_eager=cfg.enforce_eager, seed=cfg.seed,
    )


def run(cfg: SamplingConfig, *, iteration: str, index: int, policy: str, prompts_path: str, out: str,
        metrics_path: str | None) -> dict:
    prompts = schemas.read_table(prompts_path, "prompts")
    prompts = select_prompts(prompts, index=index, per_iteration=cfg.prompts_per_iteration, seed=cfg.seed)
    tokenizer = load_tokenizer(policy)
    spec = spec_from(cfg)
    requests, texts = build_requests(prompts, tokenizer, iteration=iteration, seed=cfg.seed,
                                     max_prompt_len=cfg.max_model_len - cfg.max_new_tokens, source=prompts_path)
    backend = backend_for(cfg, policy)
    meta = {"iteration": iteration, "policy": policy, "sampling": cfg.model_dump(), **backend.versions()}
    stats = RolloutStats(extra={"engine_startup_s": round(backend.startup_s, 2)})
    with atomic_dir(out) as tmp:
        with schemas.stream_writer(Path(tmp) / "part-00000.parquet", "rollouts", metadata=meta) as write:
            for lo in range(0, len(requests), BATCH_PROMPTS):
                batch = requests[lo: lo + BATCH_PROMPTS]
                t0 = time.perf_counter()
                samples = backend.generate(batch, spec)
                stats.seconds += time.perf_counter() - t0
                stats.add(samples)
                write(rollout_frame(prompts[lo: lo + BATCH_PROMPTS], texts[lo: lo + BATCH_PROMPTS], batch, samples,
                                    iteration=iteration, policy=policy))
    metrics = stats.as_metrics()
    summary(f"sample@{iteration}", metrics, path=metrics_path)
    return metrics


def rollout_frame(prompts: pl.DataFrame, texts: list[str], requests: list[Request], samples, *, iteration: str,
                  policy: str) -> pl.DataFrame:
    rows = []
    for p, text, req, group in zip(prompts.iter_rows(named=True), texts, requests, samples):
        for k, s in enumerate(group):
            rows.append({
                "iteration": iteration, "prompt_id": req.prompt_id, "sample_idx": k, "question": p["question"],
                "answer": p["answer"], "operation": p["operation"], "prompt": text,
                "prompt_token_ids": req.prompt_token_ids, "completion": s.text, "completion_token_ids": s.token_ids,
                "completion_logprobs": s.logprobs, "finish_reason": s.finish_reason,
                "prompt_len": len(req.prompt_token_ids), "completion_len": len(s.token_ids), "policy": policy,
            })
    return pl.DataFrame(rows, schema_overrides={"sample_idx": pl.Int32, "operation": pl.Utf8})
