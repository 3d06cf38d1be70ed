"""The GRPO policy update: mu passes of clipped-surrogate steps with KL to the reference.

What this implements (the formulas are in ``grpo_pipeline.losses``)::

    loss = agg_i,t( -min(r A, clip(r, 1-eps_low, 1+eps_high) A) + beta * KL_k(pi_theta || pi_ref) )
    r    = exp(logp_theta - logp_old)

* pi_old = the policy that sampled the rollouts, i.e. the weights before this update's first
  optimizer step.  Its log-probs are computed with the training model (not taken from the
  sampler, whose log-probs stay in the rollouts for diagnostics) in one no-grad pass before the
  first step, for every row a later step needs.  At the first step the policy *is* pi_old, so
  ``logp_old = logp.detach()`` there: the ratio is exactly 1, and when the whole iteration is one
  optimizer step (``mu = 1``, one minibatch) no extra pass is spent at all.
* pi_ref = the SFT model (``update.reference: sft``, log-probs computed by the caller or from
  ``ref_model``) or pi_old (``old``, the first spec document's KL[pi_theta || pi_old]); ``beta = 0``
  uses none.
* ``mu`` passes, each a fresh shuffle (seeded by ``update.seed`` and the global step) cut into
  minibatches of ``minibatch_size`` sequences, one AdamW step each, accumulated over
  ``micro_batch_size`` micro-batches; gradient clipping at ``max_grad_norm``; learning rate with
  warm-up and cosine / linear decay over the *global* step (``start_step`` + local step).
* aggregation normalisers are the global minibatch's counts (``G`` sequences, ``N`` tokens):
  micro-batch losses sum to the minibatch loss.  With W processes (DDP / FSDP average gradients
  over ranks) each rank passes ``G / W`` and ``N / W``, so the averaged gradient is exactly the
  single-process one.
* a non-finite loss or gradient norm raises :class:`NonFiniteError` before the optimizer step,
  on every rank; the caller then writes nothing.

Metrics per optimizer step (over the whole minibatch, all ranks): ``loss``, ``policy_loss``,
``kl`` (mean per token; only with a reference), ``clip_frac_low`` / ``clip_frac_high`` (token
shares), ``ratio_mean`` / ``ratio_min`` / ``ratio_max``, ``entropy`` (mean per token),
``grad_norm`` (before clipping), ``lr``, ``tokens``, ``tokens_per_s``, ``peak_memory_mb``, the step's phases
``forward_s`` / ``backward_s`` / ``optimizer_s`` (the first step also ``prep_s``, the pi_old / reference passes
inside this call, and ``old_rows``); when the rows carry
the sampler's log-probs, the sampler-trainer mismatch of pi_old (``losses.rollout_mismatch``):
``mismatch/logp_diff_mean`` / ``mismatch/logp_diff_max`` (|logp_old - logp_sampler|), ``mismatch/outside_cap_share``,
``mismatch/kl_k3`` (KL(pi_sampler || pi_old) per token) and ``mismatch/weight_mean`` (the correction's mean weight).

Variants (``update.loss``, ``update.importance_sampling_level``, ``update.rollout_correction``) are the
registered functions of ``grpo_pipeline.losses``; :func:`clip_range` picks their clip epsilons.
"""

from __future__ import annotations

import math
import resource
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from tqdm.auto import tqdm

from grpo_pipeline.allocator import release_free_memory
from grpo_pipeline.buckets import passes_for
from grpo_pipeline.config import UpdateConfig
from grpo_pipeline.distributed import DistContext, grad_norm, no_sync
from grpo_pipeline.losses import grpo_loss
from grpo_pipeline.policy import (
    PolicyModule,
    attention_kernels,
    collate,
    completion_logprobs,
    enable_checkpointing,
    frozen_casts,
    is_policy_module,
)


class NonFiniteError(RuntimeError):
    """The loss or the gradient norm is NaN or inf."""


@dataclass
class Rollout:
    prompt_ids: list[int]
    completion_ids: list[int]
    advantage: float | list[float]   # scalar (outcome) or one per completion token (process)
    key: str = ""                    # prompt_id/sample_idx, for error messages
    sampler_logprobs: list[float] | None = None   # the sampler's log-prob of each completion token


def autocast(cfg: UpdateConfig, device: torch.device):
    # Selective checkpointing replays a block's ops and expects the same ones: autocast's weight-cast cache
    # would cast a weight once for the prompt pass and the completion pass together but again in each replay.
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.dtype == "bfloat16",
                          cache_enabled=cfg.gradient_checkpointing != "selective")


def _advantages(rows: Sequence[Rollout], C: int) -> torch.Tensor:
    """(B,) for scalar advantages, (B, C) zero-padded for per-token ones."""
    if all(isinstance(r.advantage, float | int) for r in rows):
        return torch.tensor([float(r.advantage) for r in rows])                # (B,)
    out = torch.zeros(len(rows), C)                                              # (B, C)
    for i, r in enumerate(rows):
        a = r.advantage if isinstance(r.advantage, list) else [float(r.advantage)] * len(r.completion_ids)
        out[i, : len(a)] = torch.tensor(a)
    return out


def lr_lambda(cfg: UpdateConfig, start_step: int = 0):
    """Learning-rate factor of local step ``step`` at global step ``start_step + step``."""
    def f(step: int) -> float:
        s = start_step + step
        if cfg.warmup_steps and s < cfg.warmup_steps:
            return (s + 1) / cfg.warmup_steps
        if cfg.lr_schedule == "constant":
            return 1.0
        frac = min(1.0, (s - cfg.warmup_steps) / (cfg.total_steps - cfg.warmup_steps))
        shape = 0.5 * (1 + math.cos(math.pi * frac)) if cfg.lr_schedule == "cosine" else 1.0 - frac
        return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * shape
    return f


def make_optimizer(params: list[torch.nn.Parameter], cfg: UpdateConfig) -> torch.optim.Optimizer:
    """AdamW, fused (one kernel, no parameter-sized temporaries) where torch has it for these parameters."""
    try:
        return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, fused=True)
    except (RuntimeError, ValueError):
        return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)


def clock(device: torch.device) -> float:
    """``time.perf_counter()`` once the device's queued work is done (phase timings)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


class PhaseTimer:
    """Seconds spent in named phases (forward, backward) of one optimizer step, without a device sync per
    micro-batch: on a GPU each mark is a CUDA event, read once after the step's single synchronisation
    (``seconds`` must follow a ``clock``); elsewhere ``time.perf_counter()``."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.spans: dict[str, list] = {}

    def mark(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def add(self, phase: str, start: Any, end: Any) -> None:
        self.spans.setdefault(phase, []).append((start, end))

    def seconds(self, phase: str) -> float:
        spans = self.spans.get(phase, [])
        if self.cuda:
            return sum(a.elapsed_time(b) for a, b in spans) / 1000.0
        return sum(b - a for a, b in spans)


def peak_memory_mb(device: torch.device) -> float:
    """CUDA: peak allocated since the update started; CPU: the process's peak resident set."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def micro_batches(rows: Sequence[int], ctx: DistContext, size: int) -> list[tuple[list[int], bool]]:
    """This rank's micro-batches of ``rows`` as ``(indices, active)``; every rank gets the same count.

    Rank r takes ``rows[r::W]``; a rank with nothing left runs an inactive micro-batch (one row,
    fully masked) so that all ranks run the same forwards and backwards.
    """
    shard = list(rows[ctx.rank:: ctx.world_size])
    n = math.ceil(math.ceil(len(rows) / ctx.world_size) / size)
    out = [(shard[k * size: (k + 1) * size], True) for k in range(n)]
    return [(mb, True) if mb else ([rows[0]], False) for mb, _ in out]


def batch_order(rollouts: Sequence[Rollout], rows: Sequence[int]) -> list[int]:
    """``rows`` in micro-batch order: a group's rows side by side (they share the prompt's forward,
    ``policy._shared_prompt_hidden``), by completion length inside it (less right padding per
    micro-batch: measured 29% -> 19% padded completion cells on the default update at 4 rows).

    The order inside a minibatch does not change its summed loss or gradient.
    """
    return sorted(rows, key=lambda i: (rollouts[i].prompt_ids, len(rollouts[i].completion_ids), i))


def largest_first(rollouts: Sequence[Rollout], plan: list[tuple[list[int], bool]]) -> list[tuple[list[int], bool]]:
    """A step's micro-batches, the one with the most padded cells first (the order of a sum's terms).

    A micro-batch's activations grow with its padded cells (rows x longest completion, plus each distinct
    prompt once).  Run first, the largest sizes the allocator's cache; the smaller ones that follow reuse
    its freed blocks.  Run last, it needed blocks larger than any freed so far, on top of the gradients:
    measured on W1's update (bf16, 16-row micro-batches, tcmalloc) the process's resident peak was
    4.2 GiB in batch order, 3.7 GiB largest first, at the same speed (README: Performance).
    """
    def cells(mb: tuple[list[int], bool]) -> int:
        idx = mb[0]
        prompts = {tuple(rollouts[i].prompt_ids) for i in idx}
        return (len(idx) * max(len(rollouts[i].completion_ids) for i in idx)
                + len(prompts) * max(len(p) for p in prompts))

    return sorted(plan, key=cells, reverse=True)      # stable: equal ones keep batch order


def _batch(rollouts: Sequence[Rollout], idx: list[int], active: bool, *, pad_id: int, device: torch.device):
    rows = [rollouts[i] for i in idx]
    b = collate([r.prompt_ids for r in rows], [r.completion_ids for r in rows], pad_id=pad_id).to(device)
    if not active:
        b.completion_mask.zero_()
    return rows, b


@torch.no_grad()
@frozen_casts()       # a frozen LM head is cast to the autocast dtype once per call, not per chunk
def rollout_logprobs(model: torch.nn.Module, rollouts: Sequence[Rollout], rows: Sequence[int], *, pad_id: int,
                     cfg: UpdateConfig, device: torch.device, ctx: DistContext | None = None,
                     desc: str = "log-probs") -> torch.Tensor:
    """(N, C_max) float32 no-grad log-probs of ``rows`` under ``model`` (pi_old or pi_ref); other rows 0.

    Each rank computes its shard of ``rows``; the result is summed over ranks, so all hold it all.
    """
    ctx = ctx or DistContext(device=device)
    C = max(len(r.completion_ids) for r in rollouts)
    out = torch.zeros(len(rollouts), C, device=device)                          # (N, C_max)
    was_training = model.training
    model.eval()
    order = batch_order(rollouts, rows)
    for idx, active in tqdm(micro_batches(order, ctx, cfg.micro_batch_size), desc=desc, leave=False,
                            disable=not ctx.is_main):
        _, b = _batch(rollouts, idx, active, pad_id=pad_id, device=device)
        with autocast(cfg, device):
            lp, _ = completion_logprobs(model, b, chunk_size=cfg.logprob_chunk_size)   # (b, c)
        if active:
            out[torch.tensor(idx, device=device), : lp.shape[1]] = lp.float()
    model.train(was_training)
    return ctx.reduce(out) if ctx.world_size > 1 else out


# Accumulated per-step statistics: sums over micro-batches and ranks (token means times tokens), then maxima.
_TOKEN_MEANS = ("clip_frac_low", "clip_frac_high", "ratio_mean", "mismatch/logp_diff_mean",
                "mismatch/outside_cap_share", "mismatch/kl_k3", "mismatch/weight_mean")
_SUMS = ("loss", "policy_loss", "kl", *_TOKEN_MEANS, "entropy", "n_tokens", "non_finite")
_MAXES = ("ratio_min", "ratio_max", "mismatch/logp_diff_max")   # ratio_min is kept negated while reduced


def _micro_stats(loss: torch.Tensor, m: dict[str, torch.Tensor], ent: torch.Tensor, mask: torch.Tensor):
    """This micro-batch's sums (token metrics times its valid tokens) and its maxima (``_MAXES``)."""
    n = mask.sum().to(torch.float64)
    zero = torch.zeros((), dtype=torch.float64, device=n.device)
    tok = [m[k].detach().double() * n if k in m else zero for k in _TOKEN_MEANS]
    kl = torch.nan_to_num(m["kl"].detach().double() * n, nan=0.0)
    ent_sum = (ent.detach().double() * mask).sum()
    loss_d = loss.detach().double()
    sums = torch.stack([loss_d, m["policy_loss"].detach().double(), kl, *tok, ent_sum, n,
                        (~torch.isfinite(loss_d)).double()])
    diff_max = m.get("mismatch/logp_diff_max", zero).detach().double()
    return sums, torch.stack([-m["ratio_min"].detach().double(), m["ratio_max"].detach().double(), diff_max])


def _step_stats(sums: torch.Tensor, maxes: torch.Tensor, ctx: DistContext, *, has_kl: bool,
                has_sampler: bool) -> dict[str, float]:
    s = dict(zip(_SUMS, ctx.reduce(sums).tolist()))
    mx = dict(zip(_MAXES, ctx.reduce(maxes, "max").tolist()))
    n = max(s["n_tokens"], 1.0)
    W = ctx.world_size
    out = {"loss": s["loss"] / W, "policy_loss": s["policy_loss"] / W}   # each rank's loss carries 1/W
    if has_kl:
        out["kl"] = s["kl"] / n
    out.update({k: s[k] / n for k in (*_TOKEN_MEANS, "entropy") if has_sampler or not k.startswith("mismatch/")})
    out.update(ratio_min=-mx["ratio_min"], ratio_max=mx["ratio_max"], non_finite=s["non_finite"])
    if has_sampler:
        out["mismatch/logp_diff_max"] = mx["mismatch/logp_diff_max"]
    return out


def clip_range(cfg: UpdateConfig) -> tuple[float, float | None]:
    """``(eps_low, eps_high)`` of the configured loss: GSPO's own for sequence ratios; CISPO's cap."""
    low, high = ((cfg.sequence_epsilon, cfg.sequence_epsilon_high) if cfg.importance_sampling_level == "sequence"
                 else (cfg.epsilon, cfg.epsilon_high))
    return (low, cfg.cispo_epsilon_high) if cfg.loss == "cispo" else (low, high)


def _sampler_logprobs(rows: Sequence[Rollout], C: int) -> torch.Tensor:
    """(B, C) the sampler's log-probs, zero-padded."""
    out = torch.zeros(len(rows), C)                                              # (B, C)
    for i, r in enumerate(rows):
        out[i, : len(r.sampler_logprobs)] = torch.tensor(r.sampler_logprobs)
    return out


def _check_sampler_logprobs(rollouts: Sequence[Rollout], cfg: UpdateConfig) -> bool:
    """Whether every row carries the sampler's log-probs (one per completion token); required by a correction."""
    missing = next((r for r in rollouts if r.sampler_logprobs is None), None)
    if missing is not None:
        if cfg.rollout_correction != "none":
            msg = (f"update.rollout_correction is {cfg.rollout_correction!r} but rollout {missing.key!r} has no "
                   "sampler log-probs (completion_logprobs)")
            raise ValueError(msg)
        return False
    bad = next((r for r in rollouts if len(r.sampler_logprobs) != len(r.completion_ids)), None)
    if bad is not None:
        msg = (f"rollout {bad.key!r} has {len(bad.sampler_logprobs)} sampler log-probs for "
               f"{len(bad.completion_ids)} completion tokens")
        raise ValueError(msg)
    return True


@frozen_casts()
def train(model: torch.nn.Module, rollouts: list[Rollout], cfg: UpdateConfig, *, pad_id: int,
          ref_model: torch.nn.Module | None = None, ref_logprobs: torch.Tensor | None = None,
          device: torch.device | None = None, optimizer: torch.optim.Optimizer | None = None,
          start_step: int = 0, max_tokens: int | None = None, ctx: DistContext | None = None,
          reference_is_old: bool = False) -> tuple[list[dict], torch.optim.Optimizer]:
    """Run the update in place on ``model``; return per-step metrics and the optimizer.

    Parameters
    ----------
    model : an HF causal LM, or a :class:`PolicyModule` wrapped by ``grpo_pipeline.distributed.wrap``.
    rollouts : the iteration's rows with a valid advantage.
    ref_model, ref_logprobs : the reference (``reference: sft``, ``beta > 0``): a model, or its
        precomputed (N, C_max) log-probs from :func:`rollout_logprobs` (then the caller can free it).
    optimizer : carried over from the previous iteration (else a new AdamW over ``model``).
    start_step : global optimizer steps already taken (learning-rate schedule, shuffling seed).
    max_tokens : Dr. GRPO's constant normaliser when ``cfg.max_tokens`` is null (the stage passes the
        sampler's ``max_new_tokens``); ``cfg.max_tokens`` wins; neither: the longest completion.
    ctx : this process's place in a distributed run (default: one process).
    reference_is_old : pi_ref has pi_old's weights (``run.update.reference_is_policy``): the KL term uses
        ``logp_old`` as ``logp_ref``, as ``update.reference: old`` does.
    """
    if not rollouts:
        raise ValueError("no rollouts with a valid advantage to train on")
    if any(not r.completion_ids for r in rollouts):
        bad = next(r.key for r in rollouts if not r.completion_ids)
        msg = f"rollout {bad!r} has an empty completion; leave such rows out"
        raise ValueError(msg)
    has_sampler = _check_sampler_logprobs(rollouts, cfg)
    eps_low, eps_high = clip_range(cfg)
    device = device or next(model.parameters()).device
    module = model if is_policy_module(model) else PolicyModule(model, chunk_size=cfg.logprob_chunk_size,
                                                                length_buckets=passes_for(cfg.length_buckets, device.type))
    ctx = ctx or DistContext(device=device)
    if not is_policy_module(model):
        enable_checkpointing(model, cfg.gradient_checkpointing)
    module.train()
    params = [p for p in module.parameters() if p.requires_grad]
    optimizer = optimizer or make_optimizer(params, cfg)
    sched = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg, start_step))
    max_tokens = cfg.max_tokens or max_tokens or max(len(r.completion_ids) for r in rollouts)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    # The whole schedule up front: which rows a step after the first needs pi_old for.
    gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + start_step)
    steps = [(epoch, order[lo: lo + cfg.minibatch_size])
             for epoch in range(cfg.mu) for order in [torch.randperm(len(rollouts), generator=gen).tolist()]
             for lo in range(0, len(rollouts), cfg.minibatch_size)]
    later = sorted({i for _, mini in steps[1:] for i in mini})
    ref_is_old = cfg.beta > 0 and (cfg.reference == "old" or reference_is_old)
    t_prep = clock(device)
    logp_old = (rollout_logprobs(module, rollouts, later, pad_id=pad_id, cfg=cfg, device=device, ctx=ctx,
                                 desc="old log-probs") if later else None)
    logp_ref = ref_logprobs.to(device) if ref_logprobs is not None else None
    if cfg.beta > 0 and not ref_is_old and logp_ref is None:
        if ref_model is None:
            raise ValueError("update.beta > 0 with reference 'sft' needs the reference model or its log-probs")
        logp_ref = rollout_logprobs(ref_model, rollouts, range(len(rollouts)), pad_id=pad_id, cfg=cfg, device=device,
                                    ctx=ctx, desc="reference log-probs")
    prep_s = clock(device) - t_prep

    history: list[dict] = []
    bar = tqdm(total=len(steps), desc="update", leave=False, disable=not ctx.is_main)
    for k, (epoch, mini) in enumerate(steps):
        t0 = clock(device)
        timer = PhaseTimer(device)
        n_tok = sum(len(rollouts[i].completion_ids) for i in mini)             # same on every rank
        norm = {"global_num_seqs": len(mini) / ctx.world_size, "global_num_tokens": n_tok / ctx.world_size}
        plan = largest_first(rollouts, micro_batches(batch_order(rollouts, mini), ctx, cfg.micro_batch_size))
        sums, maxes = torch.zeros(len(_SUMS), dtype=torch.float64, device=device), None
        finite: list[torch.Tensor] = []      # per micro-batch, read after the loop (one sync per step)
        keys: list[list[str]] = []
        for j, (idx, active) in enumerate(plan):
            rows, b = _batch(rollouts, idx, active, pad_id=pad_id, device=device)
            C = b.completion_ids.shape[1]
            sel = torch.tensor(idx, device=device)
            with no_sync(module, ctx, sync=j == len(plan) - 1):
                t_f = timer.mark()
                with autocast(cfg, device), attention_kernels(device):
                    logp, ent = completion_logprobs(module, b, with_entropy=True)   # (b, C) each
                old = logp.detach() if k == 0 else logp_old[sel, :C]
                ref = old if ref_is_old else (logp_ref[sel, :C] if logp_ref is not None else None)
                sampler = _sampler_logprobs(rows, C).to(device) if has_sampler else None
                loss, m = grpo_loss(logp, old, _advantages(rows, C).to(device), b.completion_mask, logp_ref=ref,
                                    eps_low=eps_low, eps_high=eps_high, beta=cfg.beta,
                                    kl_estimator=cfg.kl_estimator, aggregation=cfg.aggregation,
                                    max_tokens=max_tokens, loss=cfg.loss,
                                    importance_sampling_level=cfg.importance_sampling_level, logp_sampler=sampler,
                                    rollout_correction=cfg.rollout_correction,
                                    rollout_correction_level=cfg.rollout_correction_level,
                                    rollout_correction_cap=cfg.rollout_correction_cap, **norm)
                t_b = timer.mark()
                with attention_kernels(device):                  # checkpointed layers rerun attention here
                    loss.backward()                              # a non-finite loss is reported below
                timer.add("forward", t_f, t_b)
                timer.add("backward", t_b, timer.mark())
            s, mx = _micro_stats(loss, m, ent, b.completion_mask)
            sums += s
            maxes = mx if maxes is None else torch.maximum(maxes, mx)
            finite.append(torch.isfinite(loss.detach()))
            keys.append([r.key for r in rows[:4]])
        stats = _step_stats(sums, maxes, ctx, has_kl=cfg.beta > 0 or logp_ref is not None, has_sampler=has_sampler)
        if stats.pop("non_finite"):
            bad = [i for i, ok in enumerate(torch.stack(finite).tolist()) if not ok] if finite else []
            bad_keys = keys[bad[0]] if bad else []
            where = f"rows {', '.join(bad_keys)}, ..." if bad_keys else "on another rank"
            raise NonFiniteError(f"non-finite loss {stats['loss']} at step {start_step + k} ({where}); nothing written")
        t_o = clock(device)
        gnorm = grad_norm(params)
        if not torch.isfinite(gnorm):
            raise NonFiniteError(f"non-finite gradient norm {float(gnorm)} at step {start_step + k}; nothing written")
        torch.nn.utils.clip_grads_with_norm_(params, cfg.max_grad_norm, gnorm.to(device))
        lr = optimizer.param_groups[0]["lr"]
        if device.type == "cpu" and not optimizer.state:     # AdamW's moments are about to be allocated
            release_free_memory()
        optimizer.step()
        sched.step()
        optimizer.zero_grad(set_to_none=True)
        t_end = clock(device)
        dt = t_end - t0
        peak = float(ctx.reduce(torch.tensor([peak_memory_mb(device)], dtype=torch.float64), "max"))
        stats.update(step=start_step + k, epoch=epoch, grad_norm=float(gnorm), lr=lr, tokens=n_tok,
                     time_s=dt, tokens_per_s=n_tok / dt, peak_memory_mb=peak,
                     forward_s=timer.seconds("forward"), backward_s=timer.seconds("backward"),
                     optimizer_s=t_end - t_o)
        history.append(stats)
        bar.update(1)
        bar.set_postfix(loss=f"{stats['loss']:.4f}", kl=f"{stats.get('kl', 0):.4f}")
    bar.close()
    history[0]["prep_s"] = prep_s    # old / reference log-prob passes inside this call
    history[0]["old_rows"] = len(later)
    return history, optimizer
