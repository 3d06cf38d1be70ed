"""SFT-format initialisation (spec 第一阶段 1.1): teach ``<think>…</think><answer>…</answer>``.

Demonstrations are the training problems rendered through the shared chat template, with
the worked steps in the think part and the reference in the answer part.  The loss is the
mean negative log-likelihood of the completion tokens only: prompt tokens are masked out.
"""

from __future__ import annotations

import math

import polars as pl
import torch
from tqdm.auto import tqdm

from grpo_pipeline.config import SFTConfig
from grpo_pipeline.policy import attention_kernels, collate, completion_logprobs
from grpo_pipeline.template import demonstration, render_prompt, task_of


def build_demonstrations(problems: pl.DataFrame, tokenizer, *, max_length: int, source: str = "prompts",
                         skipped: list[str] | None = None) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, completion ids) per problem; the completion ends with the EOS token.

    Each row gets its task's instruction (coding when it has ``tests``, the one sampling uses);
    rows without a reference answer (user coding tasks without a solution) are skipped.  No
    sequence is longer than ``max_length``: the completion is cut, and a prompt that leaves no room
    for one completion token is an error naming the row and its length, or, with ``skipped`` given,
    left out and its ``prompt_id`` appended there.
    """
    problems = problems.filter(pl.col("answer").is_not_null() & (pl.col("answer").str.strip_chars() != ""))
    tests = problems["tests"].to_list() if "tests" in problems.columns else [None] * problems.height
    prompts = [render_prompt(tokenizer, q, task=task_of(t)) for q, t in zip(problems["question"].to_list(), tests)]
    eos = tokenizer.eos_token or ""
    targets = [demonstration(s, a) + eos for s, a in zip(problems["solution"].to_list(), problems["answer"].to_list())]
    p_ids = tokenizer(prompts, add_special_tokens=False)["input_ids"]
    c_ids = tokenizer(targets, add_special_tokens=False)["input_ids"]
    demos = []
    for pid, p, c in zip(problems["prompt_id"].to_list(), p_ids, c_ids):
        if len(p) >= max_length and skipped is not None:
            skipped.append(pid)
            continue
        if len(p) >= max_length:
            msg = (f"{source}: prompt {pid!r} has {len(p)} tokens, no room left within sft.max_length={max_length}. "
                   "Hint: raise sft.max_length or shorten the question")
            raise ValueError(msg)
        demos.append((list(p), list(c[: max_length - len(p)])))
    return demos


def sft_loss(model: torch.nn.Module, prompts: list[list[int]], completions: list[list[int]], *,
             pad_id: int) -> tuple[torch.Tensor, int]:
    """Mean NLL over completion tokens: -(1/N) sum_{i,t in o_i} log pi(o_t | q, o_<t)."""
    b = collate(prompts, completions, pad_id=pad_id).to(next(model.parameters()).device)
    with attention_kernels(b.input_ids.device):
        logp, _ = completion_logprobs(model, b)                # (B, C)
    mask = b.completion_mask.to(logp.dtype)                    # (B, C): prompt tokens never appear here
    return -(logp * mask).sum() / mask.sum(), b.num_tokens


def train_sft(model: torch.nn.Module, demos: list[tuple[list[int], list[int]]], cfg: SFTConfig, *,
              pad_id: int) -> list[dict]:
    """AdamW with linear warm-up and decay; returns per-step metrics."""
    if not demos:
        raise ValueError("no SFT demonstrations")
    gen = torch.Generator().manual_seed(cfg.seed)
    steps_per_epoch = math.ceil(len(demos) / cfg.batch_size)
    total = max(1, round(steps_per_epoch * cfg.epochs))
    warm = int(cfg.warmup_ratio * total)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / max(1, warm) if s < warm else max(0.0, (total - s) / max(1, total - warm)))
    model.train()
    history, step = [], 0
    bar = tqdm(total=total, desc="sft", leave=False)
    while step < total:
        order = torch.randperm(len(demos), generator=gen).tolist()
        for lo in range(0, len(order), cfg.batch_size):
            if step >= total:
                break
            batch = [demos[i] for i in order[lo: lo + cfg.batch_size]]
            loss, n_tok = sft_loss(model, [p for p, _ in batch], [c for _, c in batch], pad_id=pad_id)
            if not torch.isfinite(loss):
                raise RuntimeError(f"sft: non-finite loss at step {step}")
            with attention_kernels(next(model.parameters()).device):   # checkpointed layers rerun attention
                loss.backward()
            gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            if not torch.isfinite(gn):
                raise RuntimeError(f"sft: non-finite gradient norm {float(gn)} at step {step}; nothing written")
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            history.append({"step": step, "loss": float(loss.detach()), "grad_norm": float(gn), "tokens": n_tok})
            bar.update(1)
            bar.set_postfix(loss=f"{float(loss.detach()):.3f}")
            step += 1
    bar.close()
    return history
