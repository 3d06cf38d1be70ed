"""The GRPO policy update: mu passes of clipped-surrogate steps with KL to the reference.

What this implements (see ``grpo_pipeline.losses`` for the formulas):

* pi_old = the policy that sampled the rollouts.  With ``mu = 1`` it is the policy itself
  before its first step, so ``logp_old = logp.detach()`` (ratio exactly 1) and no extra
  forward pass is spent; with ``mu > 1`` the old log-probs are computed once, with the
  training model, before the first optimizer step.  The sampler's log-probs stay in the
  rollouts for diagnostics only.
* pi_ref = the SFT model (``update.reference: sft``) or pi_old (``old``); ``beta = 0`` loads none.
* optimizer AdamW; ``minibatch_size`` sequences per step, as ``micro_batch_size`` chunks
  with gradient accumulation; gradient clipping at ``max_grad_norm``.
* a non-finite loss or gradient raises :class:`NonFiniteError`; the caller then writes nothing.
"""

from __future__ import annotations

import math
import resource
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from grpo_pipeline.config import UpdateConfig
from grpo_pipeline.losses import grpo_loss
from grpo_pipeline.policy import Batch, collate, completion_logprobs


class NonFiniteError(RuntimeError):
    """The loss or the gradient norm is NaN or inf."""


@dataclass
class Rollout:
    prompt_ids: list[int]
    completion_ids: list[int]
    advantage: float | list[float]   # scalar (outcome) or one per completion token (process)
    key: str = ""                    # prompt_id/sample_idx, for error messages


def autocast(cfg: UpdateConfig, device: torch.device):
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.dtype == "bfloat16")


def _advantages(rows: Sequence[Rollout], C: int) -> torch.Tensor:
    """(B,) for scalar advantages, (B, C) zero-padded for per-token ones."""
    if all(isinstance(r.advantage, float | int) for r in rows):
        return torch.tensor([float(r.advantage) for r in rows])                # (B,)
    out = torch.zeros(len(rows), C)                                              # (B, C)
    for i, r in enumerate(rows):
        a = r.advantage if isinstance(r.advantage, list) else [float(r.advantage)] * len(r.completion_ids)
        out[i, : len(a)] = torch.tensor(a)
    return out


@torch.no_grad()
def logprobs_of(model: torch.nn.Module, batches: list[list[Rollout]], *, pad_id: int, cfg: UpdateConfig,
                device: torch.device, desc: str) -> list[torch.Tensor]:
    """Per-micro-batch (b, C) log-probs under ``model``, no grad (old or reference policy)."""
    was_training = model.training
    model.eval()
    out = []
    for rows in tqdm(batches, desc=desc, leave=False):
        b = collate([r.prompt_ids for r in rows], [r.completion_ids for r in rows], pad_id=pad_id).to(device)
        with autocast(cfg, device):
            lp, _ = completion_logprobs(model, b)
        out.append(lp.float())
    model.train(was_training)
    return out


def lr_lambda(cfg: UpdateConfig, total_steps: int, start_step: int = 0):
    def f(step: int) -> float:
        s = start_step + step
        if cfg.warmup_steps and s < cfg.warmup_steps:
            return (s + 1) / cfg.warmup_steps
        if cfg.lr_schedule == "constant":
            return 1.0
        frac = min(1.0, (s - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps))
        return 0.5 * (1 + math.cos(math.pi * frac)) if cfg.lr_schedule == "cosine" else 1.0 - frac
    return f


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def train(model: torch.nn.Module, rollouts: list[Rollout], cfg: UpdateConfig, *, pad_id: int,
          ref_model: torch.nn.Module | None = None, device: torch.device | None = None,
          optimizer: torch.optim.Optimizer | None = None, start_step: int = 0,
          total_steps: int | None = None) -> tuple[list[dict], torch.optim.Optimizer]:
    """Run the update in place on ``model``; return per-step metrics and the optimizer."""
    device = device or next(model.parameters()).device
    if not rollouts:
        raise ValueError("no rollouts with a valid advantage to train on")
    gen = torch.Generator().manual_seed(cfg.seed)
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    model.train()
    optimizer = optimizer or torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    steps_per_pass = math.ceil(len(rollouts) / cfg.minibatch_size)
    sched = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_lambda(cfg, total_steps or steps_per_pass * cfg.mu, start_step))

    # Fixed micro-batches (indices) so old / reference log-probs line up with the training passes.
    def micro_batches(order: list[int]) -> list[list[int]]:
        return [order[i: i + cfg.micro_batch_size] for i in range(0, len(order), cfg.micro_batch_size)]

    fixed = micro_batches(list(range(len(rollouts))))
    need_old = cfg.mu > 1 or (cfg.beta > 0 and cfg.reference == "old")
    logp_old = _per_row(logprobs_of(model, [[rollouts[i] for i in mb] for mb in fixed], pad_id=pad_id, cfg=cfg,
                                    device=device, desc="old log-probs"), fixed) if need_old else None
    logp_ref = None
    if cfg.beta > 0:
        if cfg.reference == "old":
            logp_ref = logp_old
        else:
            if ref_model is None:
                raise ValueError("update.beta > 0 with reference 'sft' needs the reference model")
            logp_ref = _per_row(logprobs_of(ref_model, [[rollouts[i] for i in mb] for mb in fixed], pad_id=pad_id,
                                            cfg=cfg, device=device, desc="reference log-probs"), fixed)

    history: list[dict] = []
    step = 0
    bar = tqdm(total=steps_per_pass * cfg.mu, desc="update", leave=False)
    for epoch in range(cfg.mu):
        order = torch.randperm(len(rollouts), generator=gen).tolist()
        for lo in range(0, len(order), cfg.minibatch_size):
            mini = order[lo: lo + cfg.minibatch_size]
            t0 = time.perf_counter()
            n_tok = sum(len(rollouts[i].completion_ids) for i in mini)
            stats: dict[str, float] = {}
            for mb in micro_batches(mini):
                rows = [rollouts[i] for i in mb]
                b = collate([r.prompt_ids for r in rows], [r.completion_ids for r in rows], pad_id=pad_id).to(device)
                with autocast(cfg, device):
                    logp, ent = completion_logprobs(model, b, with_entropy=True)
                C = b.completion_ids.shape[1]
                old = _stack(logp_old, mb, C, device) if logp_old is not None else logp.detach()
                ref = _stack(logp_ref, mb, C, device) if logp_ref is not None else None
                loss, m = grpo_loss(
                    logp, old, _advantages(rows, C).to(device), b.completion_mask, logp_ref=ref,
                    eps_low=cfg.epsilon, eps_high=cfg.epsilon_high, beta=cfg.beta, kl_estimator=cfg.kl_estimator,
                    aggregation=cfg.aggregation, max_tokens=max(len(r.completion_ids) for r in rollouts),
                    global_num_seqs=len(mini), global_num_tokens=n_tok)
                if not torch.isfinite(loss):
                    keys = ", ".join(r.key for r in rows[:4])
                    raise NonFiniteError(f"non-finite loss {loss.item()} at step {step} (rows {keys}, ...)")
                loss.backward()
                _accumulate(stats, m, loss, ent, b, weight=len(mb) / len(mini))
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
            if not torch.isfinite(grad_norm):
                raise NonFiniteError(f"non-finite gradient norm {grad_norm.item()} at step {step}")
            optimizer.step()
            sched.step()
            optimizer.zero_grad(set_to_none=True)
            dt = time.perf_counter() - t0
            stats.update(step=start_step + step, epoch=epoch, grad_norm=float(grad_norm), tokens=n_tok,
                         tokens_per_s=n_tok / dt, lr=sched.get_last_lr()[0], peak_memory_mb=peak_memory_mb(device))
            history.append(stats)
            bar.update(1)
            bar.set_postfix(loss=f"{stats['loss']:.4f}", kl=f"{stats.get('kl', 0):.4f}")
            step += 1
    bar.close()
    return history, optimizer


def _per_row(chunks: list[torch.Tensor], fixed: list[list[int]]) -> dict[int, torch.Tensor]:
    """Split (b, C) micro-batch tensors back into one 1-D tensor per rollout index."""
    return {i: chunk[j] for chunk, mb in zip(chunks, fixed) for j, i in enumerate(mb)}


def _stack(per_row: dict[int, torch.Tensor], idx: list[int], C: int, device: torch.device) -> torch.Tensor:
    out = torch.zeros(len(idx), C, device=device)                                  # (b, C)
    for j, i in enumerate(idx):
        t = per_row[i][:C]
        out[j, : t.shape[0]] = t
    return out


def _accumulate(stats: dict[str, float], m: dict[str, torch.Tensor], loss: torch.Tensor, ent: torch.Tensor,
                b: Batch, *, weight: float) -> None:
    """Token/sequence-weighted averages of the micro-batch metrics over the minibatch."""
    mask = b.completion_mask.bool()
    vals = {"loss": float(loss.detach()), "entropy": float(ent.detach()[mask].float().mean())}
    vals.update({k: float(v) for k, v in m.items()})
    for k, v in vals.items():
        if k == "loss":
            stats[k] = stats.get(k, 0.0) + v       # micro losses already carry the global normaliser
        elif k == "ratio_min":
            stats[k] = min(stats.get(k, v), v)
        elif k == "ratio_max":
            stats[k] = max(stats.get(k, v), v)
        else:
            stats[k] = stats.get(k, 0.0) + weight * v
