"""update@itN: one GRPO policy update from the iteration's rollouts and advantages.

Order, to keep peak memory low: the reference's log-probs are computed first and the reference is
freed before the policy and its optimizer exist.  Then the policy trains (see
``grpo_pipeline.update``), and rank 0 writes, each atomically: the next checkpoint with the carried
AdamW state inside it (``grpo_pipeline.train_state``), then the metrics.  A failure before the end
(a non-finite loss or gradient included) leaves all of them as they were.
"""

from __future__ import annotations

import functools
import gc
import time

import polars as pl
import torch

from grpo_pipeline import distributed, lora, schemas, train_state
from grpo_pipeline.advantages import token_advantages_from_steps
from grpo_pipeline.checkpoint import (
    load_model,
    load_tokenizer,
    read_checkpoint_metadata,
    same_weights,
    save_checkpoint,
)
from grpo_pipeline.config import UpdateConfig
from grpo_pipeline.flops import param_counts, trainable_counts, update_flops, useful_tokens
from grpo_pipeline.hardware import resolve_dtype
from grpo_pipeline.io import write_json
from grpo_pipeline.run import deterministic, summary
from grpo_pipeline.update import Rollout, clock, make_optimizer, rollout_logprobs, train

ROLLOUT_COLUMNS = ["iteration", "prompt_id", "sample_idx", "prompt_token_ids", "completion_token_ids",
                   "completion_token_ends", "finish_reason", "completion_logprobs"]
MEAN_KEYS = ("loss", "policy_loss", "kl", "clip_frac_low", "clip_frac_high", "ratio_mean", "entropy", "grad_norm",
             "mismatch/logp_diff_mean", "mismatch/outside_cap_share", "mismatch/kl_k3", "mismatch/weight_mean")


def load_rollouts(rollouts: str, advantages: str, *, overlong_filter: bool = False
                  ) -> tuple[list[Rollout], dict[str, int], str]:
    """Join rollouts with their advantages; rows masked by the advantage stage are left out, and with
    ``overlong_filter`` (DAPO) the truncated ones (``finish_reason == "length"``) too.

    Process supervision: token ``t`` gets the sum of the normalised rewards of the steps ending after
    its first character (:func:`token_advantages_from_steps`), with the token offsets the sampler
    recorded (``completion_token_ends``).

    Returns the rows, the counts left out (``masked``, ``overlong_masked``) and the iteration."""
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
    truncated = df["finish_reason"] == "length"
    n_overlong = int(truncated.sum()) if overlong_filter else 0
    if overlong_filter:
        df = df.filter(~truncated)
    process = df["step_advantages"].list.len().fill_null(0).sum() > 0
    rows = []
    for r in df.iter_rows(named=True):
        a: float | list[float] = float(r["advantage"])
        if process:
            steps = r["step_advantages"] or []
            a = token_advantages_from_steps([s["end"] for s in steps], [s["value"] for s in steps],
                                            r["completion_token_ends"]).tolist()
        rows.append(Rollout(r["prompt_token_ids"], r["completion_token_ids"], a, f"{r['prompt_id']}/{r['sample_idx']}",
                            sampler_logprobs=r["completion_logprobs"]))
    return rows, {"masked": n_masked, "overlong_masked": n_overlong}, ro["iteration"][0]


def _budget(rollouts: str) -> int | None:
    """The sampler's ``max_new_tokens`` (Dr. GRPO's constant), from the rollouts' metadata."""
    try:
        return int(schemas.read_metadata(rollouts, "rollouts")["sampling"]["max_new_tokens"])
    except (KeyError, TypeError, ValueError):
        return None


class _FullState:
    """Saves ``model`` (sharded) with a gathered full state dict."""

    def __init__(self, model, state_dict: dict) -> None:
        self.model, self.state_dict = model, state_dict

    def save_pretrained(self, path, **kw) -> None:
        self.model.save_pretrained(path, state_dict=self.state_dict, **kw)


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def reference_is_policy(cfg: UpdateConfig, reference: str | None, policy: str, prev: dict) -> bool:
    """Whether pi_ref is pi_old: the reference checkpoint holds the policy's weights (iteration 0 starts from
    the SFT model that is also the reference).  Then ``logp_ref = logp_old`` exactly and no reference model is
    loaded or run (W1 on 2 cores: -17 s of a 104 s fp32 update).  Not with LoRA dropout on carried adapters:
    pi_old's log-probs come from the train-mode forward, which dropout would make differ from the reference's."""
    if not (cfg.beta > 0 and cfg.reference == "sft" and reference):
        return False
    carried_dropout = cfg.lora is not None and cfg.lora.dropout > 0 and bool(prev.get("train_state"))
    return not carried_dropout and same_weights(policy, reference)


def _reference_logprobs(cfg: UpdateConfig, reference: str | None, rows: list[Rollout], *, pad_id: int,
                        ctx: distributed.DistContext, times: dict[str, float]) -> torch.Tensor | None:
    """The reference's (N, C_max) log-probs (``None`` without a reference); its load and pass timed into ``times``."""
    if not (cfg.beta > 0 and cfg.reference == "sft"):
        return None
    if not reference:
        raise ValueError("update.reference is 'sft' but no reference checkpoint was given (--reference)")
    t0 = clock(ctx.device)
    ref = load_model(reference, dtype="bfloat16" if cfg.dtype == "bfloat16" else "float32",
                     device=distributed.load_device(ctx))
    module = distributed.wrap(ref.eval().requires_grad_(False), ctx, cfg, train=False)
    t1 = clock(ctx.device)
    out = rollout_logprobs(module, rows, range(len(rows)), pad_id=pad_id, cfg=cfg, device=ctx.device, ctx=ctx,
                           desc="reference log-probs")
    times.update(load_reference=t1 - t0, reference=clock(ctx.device) - t1)
    del module, ref
    _free(ctx.device)
    return out


def _attach_lora(cfg: UpdateConfig, model, state: dict | None, reason: str, ctx: distributed.DistContext):
    """LoRA adapters on ``model`` (``update.lora``), resumed from the carried state when it holds fitting ones."""
    if reason == "resumed":
        adapters = ctx.broadcast_object(state.pop(lora.ADAPTER_KEY, None) if ctx.is_main else None)
        if (adapters is None) != (cfg.lora is None):
            state, reason = None, ("fresh: the optimizer state was written " +
                                   ("without" if adapters is None else "with") + " LoRA adapters")
    if cfg.lora is None:
        return model, state, reason
    model = lora.attach(model, cfg.lora)
    if reason == "resumed" and not lora.resume(model, adapters):
        state, reason = None, "fresh: the carried LoRA adapters do not fit update.lora (rank or target_modules)"
    return model, state, reason


def _round(key: str, v):
    """6 decimals; the mismatch (often 1e-6 .. 1e-10 nats) keeps 4 significant digits instead."""
    if not isinstance(v, float):
        return v
    return float(f"{v:.4g}") if key.startswith("mismatch/") else round(v, 6)


PHASES = ("forward", "backward", "optimizer")


def phase_times(history: list[dict], times: dict[str, float]) -> dict[str, float]:
    """``time/<phase>_s`` of the iteration: the stage's own (loads, reference pass, write) and the steps' sums."""
    out = dict(times)
    out["old_logprobs"] = history[0].get("prep_s", 0.0)
    out.update({k: sum(h.get(f"{k}_s", 0.0) for h in history) for k in PHASES})
    return {f"time/{k}_s": round(v, 3) for k, v in out.items()}


def flop_metrics(n_params: int, head_params: int, rows: list[Rollout], *, mu: int, old_share: float,
                 reference_pass: bool, seconds: float, trained: tuple[int, bool] | None = None) -> dict[str, float]:
    """Model GFLOPs of the update's passes over ``rows`` and their GFLOP/s over ``seconds`` (``grpo_pipeline.flops``).

    ``mu`` forward+backward passes, the reference's forward, and pi_old's forward over ``old_share`` of the rows;
    ``trained``: ``flops.trainable_counts`` of the trained model (None: every weight trained). Under LoRA the
    base model's weights get input gradients only; the adapters' own forward is left out (~4% of the base's at
    rank 16 on SmolLM2-135M), as attention's score products are.
    """
    dec, comp = useful_tokens([r.prompt_ids for r in rows], [r.completion_ids for r in rows])
    n_trained, head_trained = trained if trained is not None else (None, True)
    flops = update_flops(n_params, head_params, decoder_tokens=dec, head_tokens=comp, train_passes=mu,
                         nograd_passes=old_share + int(reference_pass), trained_params=n_trained,
                         head_trained=head_trained)
    return {"model_gflop": round(flops / 1e9, 3), "gflop_per_s": round(flops / 1e9 / seconds, 3) if seconds else 0.0}


def iteration_metrics(history: list[dict], *, wall_s: float) -> dict:
    """Per-iteration summary of the per-step metrics."""
    metrics = {k: _round(k, sum(h[k] for h in history) / len(history)) for k in MEAN_KEYS if k in history[0]}
    train_s = sum(h["time_s"] for h in history) + history[0].get("prep_s", 0.0)
    tokens = sum(h["tokens"] for h in history)
    metrics.update(
        ratio_min=round(min(h["ratio_min"] for h in history), 6),
        ratio_max=round(max(h["ratio_max"] for h in history), 6),
        **({"mismatch/logp_diff_max": _round("mismatch/", max(h["mismatch/logp_diff_max"] for h in history))}
           if "mismatch/logp_diff_max" in history[0] else {}),
        steps=len(history), tokens=tokens, lr_last=history[-1]["lr"],
        tokens_per_s=round(tokens / train_s, 2),                       # incl. the old log-prob pass
        step_tokens_per_s=round(tokens / sum(h["time_s"] for h in history), 2),
        peak_memory_mb=round(max(h["peak_memory_mb"] for h in history), 1),
        wall_s=round(wall_s, 2),
    )
    return metrics


def _nothing_to_learn(policy: str, tokenizer, out: str, prev: dict, left_out: dict, *, iteration: str,
                      ctx: distributed.DistContext, metrics_path: str | None, steps_path: str | None,
                      t_start: float) -> dict:
    """Every row was left out (all groups' rewards equal under advantage.filter_groups, or all truncated
    under overlong_filter): the next checkpoint is the policy itself, with its AdamW state, and no
    optimizer step is taken."""
    metrics = {"steps": 0, "sequences": 0, **left_out, "world_size": ctx.world_size, "optimizer_state": "none",
               "wall_s": round(time.perf_counter() - t_start, 2)}
    if ctx.is_main:
        print(f"[update@{iteration}] warning: no rollout left to train on ({left_out}); "
              f"{out} is {policy} unchanged", flush=True)
        meta = {**prev, "parent": policy, "train_state": {**prev.get("train_state", {}), "iteration": iteration,
                                                         "skipped": "no rows to train on"}}
        save_checkpoint(load_model(policy, dtype="float32"), tokenizer, out, metadata=meta,
                        extra=functools.partial(train_state.carry_state, policy, checkpoint=out))
        if steps_path:
            write_json(steps_path, [])
        summary(f"update@{iteration}", metrics, path=metrics_path)
    ctx.barrier()
    return metrics


def run(cfg: UpdateConfig, *, policy: str, reference: str | None, rollouts: str, advantages: str, out: str,
        metrics_path: str | None, steps_path: str | None) -> dict:
    """Train on the iteration's rollouts and write ``out`` (with the carried state) and the metrics from rank 0."""
    t_start = time.perf_counter()
    deterministic()
    ctx = distributed.init(cfg.distributed.strategy)
    try:
        cfg = cfg.model_copy(update={"dtype": resolve_dtype(cfg.dtype, what="update", quiet=not ctx.is_main)})
        torch.manual_seed(cfg.seed)
        tokenizer = load_tokenizer(policy)
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        rows, left_out, iteration = load_rollouts(rollouts, advantages, overlong_filter=cfg.overlong_filter)
        prev = read_checkpoint_metadata(policy)
        if not rows:
            return _nothing_to_learn(policy, tokenizer, out, prev, left_out, iteration=iteration, ctx=ctx,
                                     metrics_path=metrics_path, steps_path=steps_path, t_start=t_start)
        start_step = int(prev.get("train_state", {}).get("global_step", 0))
        times: dict[str, float] = {}
        ref_is_policy = reference_is_policy(cfg, reference, policy, prev)
        if ref_is_policy and ctx.is_main:
            print(f"[update@{iteration}] reference {reference} holds the policy's weights: pi_ref = pi_old, "
                  "no reference pass", flush=True)
        ref_lp = None if ref_is_policy else _reference_logprobs(cfg, reference, rows, pad_id=pad_id, ctx=ctx,
                                                                times=times)

        t0 = clock(ctx.device)
        # full fine-tuning writes every weight: off the file mapping first (FSDP shards copy them anyway)
        model = load_model(policy, dtype="float32", device=distributed.load_device(ctx),
                           trainable=cfg.lora is None and cfg.distributed.strategy != "fsdp")
        n_params, head_params = param_counts(model)
        carry = cfg.optimizer_state == "carry"
        state, reason = None, "fresh: update.optimizer_state is 'fresh'"
        if carry:
            state, reason = train_state.load_state(policy) if ctx.is_main else (None, "")
            reason = ctx.broadcast_object(reason)
        model, state, reason = _attach_lora(cfg, model, state, reason, ctx)
        trained = trainable_counts(model)                   # before sharding: whole tensors
        originals = (lora.compute_copies(model, torch.bfloat16)
                     if cfg.lora is not None and cfg.dtype == "bfloat16" else None)   # float32 kept for the merge
        module = distributed.wrap(model, ctx, cfg)
        optimizer = make_optimizer([p for p in module.parameters() if p.requires_grad], cfg)
        if reason == "resumed":
            distributed.load_optimizer_state(module, optimizer, state, ctx)
            for g in optimizer.param_groups:   # this iteration's hyper-parameters; the moments carry over
                g.update(lr=cfg.lr, initial_lr=cfg.lr, weight_decay=cfg.weight_decay)
        del state
        if ctx.is_main:
            print(f"[update@{iteration}] optimizer state: {reason}", flush=True)
        times["load_policy"] = clock(ctx.device) - t0

        history, optimizer = train(module, rows, cfg, pad_id=pad_id, ref_logprobs=ref_lp, device=ctx.device,
                                   optimizer=optimizer, start_step=start_step, max_tokens=_budget(rollouts), ctx=ctx,
                                   reference_is_old=ref_is_policy)
        global_step = start_step + len(history)
        t0 = clock(ctx.device)
        full = distributed.full_model_state(module, ctx)                      # collective
        opt_state = distributed.full_optimizer_state(module, optimizer, ctx) if carry else None
        if ctx.is_main:
            meta = {**prev, "parent": policy, "train_state": {
                "global_step": global_step, "iteration": iteration, "optimizer_state": reason.split(":")[0],
                "strategy": cfg.distributed.strategy, "world_size": ctx.world_size}}
            saver = model if cfg.distributed.strategy != "fsdp" else _FullState(model, full)
            if cfg.lora is not None:      # the adapters travel with their moments; the checkpoint is merged
                if carry:
                    opt_state[lora.ADAPTER_KEY] = lora.adapter_state(model)
                meta["train_state"]["lora"] = cfg.lora.model_dump()
                saver = lora.merged(model, originals)
            extra = (functools.partial(train_state.write_state, state=opt_state, checkpoint=out,
                                       global_step=global_step) if carry else None)
            save_checkpoint(saver, tokenizer, out, metadata=meta, extra=extra)
        del full, opt_state
        times["write"] = clock(ctx.device) - t0
        metrics = iteration_metrics(history, wall_s=time.perf_counter() - t_start)
        compute_s = times.get("reference", 0.0) + history[0].get("prep_s", 0.0) + sum(h["time_s"] for h in history)
        metrics.update(flop_metrics(n_params, head_params, rows, mu=cfg.mu,
                                    old_share=history[0].get("old_rows", 0) / len(rows),
                                    reference_pass="reference" in times, seconds=compute_s, trained=trained),
                       **phase_times(history, times))
        metrics.update(sequences=len(rows), **left_out, world_size=ctx.world_size,
                       optimizer_state=reason.split(":")[0],
                       reference_logprobs=("pi_old" if ref_is_policy or (cfg.beta > 0 and cfg.reference == "old")
                                           else "reference pass" if ref_lp is not None else "none"))
        if ctx.is_main:
            if steps_path:
                write_json(steps_path, [{k: _round(k, v) for k, v in h.items()} for h in history])
            summary(f"update@{iteration}", metrics, path=metrics_path)
        ctx.barrier()
        return metrics
    finally:
        distributed.close(ctx)
