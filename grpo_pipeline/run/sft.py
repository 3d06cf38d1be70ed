"""sft: SFT-format initialisation on template demonstrations, written as an HF checkpoint."""

from __future__ import annotations

import time

import torch

from grpo_pipeline import schemas
from grpo_pipeline.checkpoint import load_model, load_tokenizer, read_checkpoint_metadata, save_checkpoint
from grpo_pipeline.config import SFTConfig
from grpo_pipeline.run import deterministic, summary
from grpo_pipeline.sft import build_demonstrations, train_sft


def run(cfg: SFTConfig, *, base: str, prompts: str, out: str, metrics_path: str | None) -> dict:
    t0 = time.perf_counter()
    deterministic()
    torch.manual_seed(cfg.seed)
    problems = schemas.read_table(prompts, "prompts")
    if cfg.max_examples:
        problems = problems.head(cfg.max_examples)
    tokenizer = load_tokenizer(base)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = load_model(base, dtype="float32", device=device, trainable=True)
    too_long: list[str] = []
    demos = build_demonstrations(problems, tokenizer, max_length=cfg.max_length, source=prompts, skipped=too_long)
    if too_long:
        print(f"[sft] warning: {len(too_long)} prompts of {prompts} leave no room within sft.max_length="
              f"{cfg.max_length} and are not trained on (first: {too_long[0]!r}); metric skipped_too_long",
              flush=True)
    if not demos and too_long:
        raise ValueError(f"{prompts}: every prompt with a reference answer is longer than sft.max_length="
                         f"{cfg.max_length} (first: {too_long[0]!r}). Hint: raise sft.max_length")
    if not demos:
        raise ValueError(f"{prompts}: no row has a reference `answer` to build SFT demonstrations from "
                         f"({problems.height} rows read). Hint: give the tasks reference solutions")
    history = train_sft(model, demos, cfg, pad_id=pad_id)
    save_checkpoint(model, tokenizer, out, metadata={**read_checkpoint_metadata(base), "parent": base,
                                                      "sft": cfg.model_dump()})
    k = max(1, len(history) // 5)
    metrics = {"loss_first": round(sum(h["loss"] for h in history[:k]) / k, 4),
               "loss_last": round(sum(h["loss"] for h in history[-k:]) / k, 4),
               "steps": len(history), "examples": len(demos), "skipped_too_long": len(too_long),
               "wall_s": round(time.perf_counter() - t0, 1)}
    summary("sft", metrics, path=metrics_path)
    return metrics
