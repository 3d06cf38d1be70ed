"""sample@itN: G completions per prompt from the iteration's policy, streamed to Parquet shards.

Output: ``<out>/part-00000.parquet`` ... one shard per data-parallel worker
(``sampling.data_parallel_size``), each holding a contiguous slice of the iteration's prompts in
order; readers glob ``<out>/*.parquet``. Every engine call (``sampling.batch_prompts`` prompts)
is appended to its shard as one row group, so memory stays bounded. All shards are written into
a temporary sibling directory that replaces ``<out>`` only when every worker succeeded
(:func:`grpo_pipeline.io.atomic_dir`): an interrupted run leaves no final output, and the next run
removes its leftovers. Because every request has its own seed, the rows do not depend on the
number of workers.

Workers (``data_parallel_size > 1``) are spawned processes with one engine each: on GPU worker
``r`` sees GPUs ``[r * tp, (r + 1) * tp)`` of the visible ones (``CUDA_VISIBLE_DEVICES``), on
CPU it is pinned to an equal share of the cores. With one worker the engine runs in the stage's
own process.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import multiprocessing.connection as mp_connection
import os
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import polars as pl
import pyarrow as pa

from grpo_pipeline import schemas
from grpo_pipeline.checkpoint import load_tokenizer
from grpo_pipeline.config import SamplingConfig
from grpo_pipeline.hardware import resolve_dtype
from grpo_pipeline.io import atomic_dir
from grpo_pipeline.run import summary
from grpo_pipeline.sampling import (
    Backend,
    Request,
    Sample,
    SamplingSpec,
    backend_for,
    build_requests,
    select_prompts,
    spec_from,
    token_char_ends,
)

SEED_RULE = "completion k of prompt p: seed request_seed(sampling.seed, iteration, p) + k"


@dataclass
class Shard:
    """One worker's slice of the iteration: prompts ``[lo, hi)``, written to ``path``."""

    rank: int
    prompts: pl.DataFrame
    texts: list[str]
    requests: list[Request]
    path: Path
    meta: dict


def shard_bounds(n: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous, near-equal slices of ``range(n)`` (the first ones one longer)."""
    q, r = divmod(n, parts)
    bounds, lo = [], 0
    for k in range(parts):
        hi = lo + q + (k < r)
        bounds.append((lo, hi))
        lo = hi
    return bounds


def run(cfg: SamplingConfig, *, iteration: str, index: int, policy: str, prompts_path: str, out: str,
        metrics_path: str | None, backend: Backend | None = None) -> dict:
    """Sample the iteration's groups into ``out``; ``backend``: an engine already started (not closed here)."""
    cfg = cfg.model_copy(update={"dtype": resolve_dtype(cfg.dtype, what=f"sample@{iteration}")})
    prompts = schemas.read_table(prompts_path, "prompts")
    if prompts.height == 0:
        msg = f"{prompts_path}: the prompts file has no rows. Hint: rerun the prepare stage"
        raise ValueError(msg)
    tokenizer = getattr(backend, "tokenizer", None)
    if tokenizer is None:
        tokenizer = load_tokenizer(policy)  # a missing tokenizer fails here, before any engine starts
    budget = cfg.max_model_len - cfg.max_new_tokens
    # every row, not only this iteration's: a prompt too long fails the first iteration, naming it
    build_requests(prompts, tokenizer, iteration=iteration, seed=cfg.seed, max_prompt_len=budget, source=prompts_path)
    prompts = select_prompts(prompts, index=index, per_iteration=cfg.prompts_per_iteration + cfg.spare_prompts,
                             seed=cfg.seed)
    spec = spec_from(cfg)
    requests, texts = build_requests(prompts, tokenizer, iteration=iteration, seed=cfg.seed, max_prompt_len=budget,
                                     source=prompts_path)
    dp = min(cfg.data_parallel_size, len(requests))
    if backend is not None and dp > 1:
        msg = "run(backend=...) serves one worker; sampling.data_parallel_size must be 1 with it"
        raise ValueError(msg)
    meta = {"iteration": iteration, "policy": policy, "sampling": cfg.model_dump(), "spec": spec.as_dict(),
            "seed_rule": SEED_RULE, "shards": dp, "prompts_total": len(requests),
            "groups_wanted": min(cfg.prompts_per_iteration, len(requests))}
    stats = RolloutStats()
    with atomic_dir(out) as tmp:
        shards = [Shard(rank, prompts[lo:hi], texts[lo:hi], requests[lo:hi], Path(tmp) / f"part-{rank:05d}.parquet",
                        {**meta, "shard": rank, "prompt_range": [lo, hi]})
                  for rank, (lo, hi) in enumerate(shard_bounds(len(requests), dp))]
        if dp == 1:
            own = backend is None
            backend = backend_for(cfg, policy, tokenizer=tokenizer) if own else backend
            try:
                stats = sample_shard(backend, shards[0], spec, batch_prompts=cfg.batch_prompts)
            finally:
                if own:
                    backend.close()
        else:
            for s in run_workers(cfg, policy, shards, spec):
                stats.merge(s)
    stats.extra["workers"] = dp
    metrics = stats.as_metrics()
    summary(f"sample@{iteration}", metrics, path=metrics_path)
    return metrics


@dataclass
class RolloutStats:
    completions: int = 0
    completion_tokens: int = 0
    max_len: int = 0
    truncated: int = 0
    seconds: float = 0.0         # time inside backend.generate
    extra: dict[str, float] = field(default_factory=dict)

    def add(self, samples: list[list[Sample]]) -> None:
        for g in samples:
            for s in g:
                self.completions += 1
                self.completion_tokens += len(s.token_ids)
                self.max_len = max(self.max_len, len(s.token_ids))
                self.truncated += s.finish_reason == "length"

    def merge(self, other: RolloutStats) -> None:
        """Add a parallel worker's counts; ``seconds`` is the slowest worker's (they ran at once)."""
        self.completions += other.completions
        self.completion_tokens += other.completion_tokens
        self.max_len = max(self.max_len, other.max_len)
        self.truncated += other.truncated
        self.seconds = max(self.seconds, other.seconds)
        for k, v in other.extra.items():
            self.extra[k] = max(self.extra.get(k, v), v)

    def as_metrics(self) -> dict[str, float]:
        c = max(self.completions, 1)
        return {
            "completions": self.completions,
            "completion_tokens_per_s": round(self.completion_tokens / max(self.seconds, 1e-9), 2),
            "completion_len_mean": round(self.completion_tokens / c, 2),
            "completion_len_max": self.max_len,
            "truncated_share": round(self.truncated / c, 4),
            **self.extra,
        }


def sample_shard(backend: Backend, shard: Shard, spec: SamplingSpec, *, batch_prompts: int) -> RolloutStats:
    """Generate ``shard``'s groups batch by batch, appending each batch to its Parquet file as a row group."""
    stats = RolloutStats(extra={"engine_startup_s": round(backend.startup_s, 2)})
    meta = {**shard.meta, **backend.versions(), "engine": getattr(backend, "engine_args", {})}
    t_start = time.perf_counter()
    with schemas.stream_writer(shard.path, "rollouts", metadata=meta) as write:
        for lo in range(0, len(shard.requests), batch_prompts):
            batch = shard.requests[lo: lo + batch_prompts]
            t0 = time.perf_counter()
            samples = backend.generate(batch, spec)
            stats.seconds += time.perf_counter() - t0
            stats.add(samples)
            write(rollout_frame(shard.prompts[lo: lo + batch_prompts], shard.texts[lo: lo + batch_prompts], batch,
                                samples, iteration=shard.meta["iteration"], policy=shard.meta["policy"],
                                tokenizer=backend.tokenizer))
    stats.extra["sample_s"] = round(stats.seconds, 3)
    stats.extra["write_s"] = round(time.perf_counter() - t_start - stats.seconds, 3)   # rows built + Parquet
    return stats


# --------------------------------------------------------------------------- data-parallel workers
def _device_env(cfg: SamplingConfig, dp: int) -> list[dict]:
    """Per worker: the GPUs it sees (``CUDA_VISIBLE_DEVICES``) or, on CPU, the cores it is pinned to."""
    import torch

    tp = cfg.tensor_parallel_size
    if torch.cuda.is_available():
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        gpus = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
        if len(gpus) < dp * tp:
            msg = (f"sampling.data_parallel_size={dp} x tensor_parallel_size={tp} needs {dp * tp} GPUs, "
                   f"{len(gpus)} are visible")
            raise ValueError(msg)
        return [{"gpus": gpus[r * tp:(r + 1) * tp]} for r in range(dp)]
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < dp:
        msg = f"sampling.data_parallel_size={dp} needs at least {dp} CPU cores, this process may use {len(cores)}"
        raise ValueError(msg)
    return [{"cores": [c for i, c in enumerate(cores) if i * dp // len(cores) == r]} for r in range(dp)]


def die_with_parent(parent: int) -> None:
    """PR_SET_PDEATHSIG: the kernel SIGKILLs this process when its parent dies, even by SIGKILL."""
    import ctypes
    import signal

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # the parent died before the prctl
        os._exit(1)


def _worker(cfg_dict: dict, policy: str, shard: Shard, spec: SamplingSpec, device: dict, stats_path: str,
            parent: int) -> None:
    """Body of one spawned worker: die with the stage, pin devices, start an engine, write the shard and its stats."""
    die_with_parent(parent)
    if "gpus" in device:
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(device["gpus"])
    else:
        os.sched_setaffinity(0, device["cores"])
        os.environ["OMP_NUM_THREADS"] = str(len(device["cores"]))
    try:
        cfg = SamplingConfig(**cfg_dict)
        backend = backend_for(cfg, policy)
        try:
            stats = sample_shard(backend, shard, spec, batch_prompts=cfg.batch_prompts)
        finally:
            backend.close()
        result = {"stats": stats.__dict__}
    except BaseException as e:  # noqa: BLE001 (recorded for the parent, then re-raised as exit 1)
        Path(stats_path).write_text(json.dumps({"error": f"{type(e).__name__}: {e}"}))
        traceback.print_exc()
        sys.exit(1)
    Path(stats_path).write_text(json.dumps(result))


def run_workers(cfg: SamplingConfig, policy: str, shards: list[Shard], spec: SamplingSpec) -> list[RolloutStats]:
    """Run one spawned worker per shard; any failure (or an interrupt here) stops all of them."""
    ctx = mp.get_context("spawn")
    devices = _device_env(cfg, len(shards))
    procs = []
    try:
        for shard, device in zip(shards, devices):
            stats_path = shard.path.with_suffix(".stats.json")
            p = ctx.Process(target=_worker, args=(cfg.model_dump(), policy, shard, spec, device, str(stats_path),
                                                  os.getpid()),
                            name=f"sample-worker-{shard.rank}")
            p.start()
            procs.append((p, shard, stats_path))
        results: dict[int, RolloutStats] = {}
        pending = {p.sentinel: (p, shard, stats_path) for p, shard, stats_path in procs}
        while pending:  # the first worker to fail stops the run (the others are terminated below)
            for sentinel in mp_connection.wait(list(pending)):
                p, shard, stats_path = pending.pop(sentinel)
                p.join()
                info = json.loads(stats_path.read_text()) if stats_path.exists() else {}
                stats_path.unlink(missing_ok=True)
                if p.exitcode != 0 or "stats" not in info:
                    lo, hi = shard.meta["prompt_range"]
                    msg = (f"sampling worker {shard.rank} (prompts {lo}..{hi - 1}) failed with exit code "
                           f"{p.exitcode}: {info.get('error', 'no error recorded; see its output above')}")
                    raise RuntimeError(msg)
                results[shard.rank] = RolloutStats(**info["stats"])
        return [results[k] for k in sorted(results)]
    finally:
        for p, _, _ in procs:
            if p.is_alive():
                p.terminate()
                p.join()


def rollout_frame(prompts: pl.DataFrame, texts: list[str], requests: list[Request], samples: list[list[Sample]], *,
                  iteration: str, policy: str, tokenizer) -> pl.DataFrame:
    """One row per completion, in the rollouts schema (grpo_pipeline/schemas.py); built as Arrow (fast)."""
    g = [len(group) for group in samples]  # completions per prompt

    def rep(values: list) -> list:  # a per-prompt value, once per completion row
        return [v for v, k in zip(values, g) for _ in range(k)]

    flat = [s for group in samples for s in group]
    cols = {
        "iteration": pa.array([iteration] * len(flat), pa.string()),
        "prompt_id": pa.array(rep([r.prompt_id for r in requests]), pa.string()),
        "sample_idx": pa.array([k for n in g for k in range(n)], pa.int32()),
        "question": pa.array(rep(prompts["question"].to_list()), pa.string()),
        "answer": pa.array(rep(prompts["answer"].to_list()), pa.string()),
        "operation": pa.array(rep(prompts["operation"].to_list()), pa.string()),
        "prompt": pa.array(rep(texts), pa.string()),
        "prompt_token_ids": pa.array(rep([r.prompt_token_ids for r in requests]), pa.list_(pa.int32())),
        "completion": pa.array([s.text for s in flat], pa.string()),
        "completion_token_ids": pa.array([s.token_ids for s in flat], pa.list_(pa.int32())),
        "completion_logprobs": pa.array([s.logprobs for s in flat], pa.list_(pa.float32())),
        "completion_token_ends": pa.array([token_char_ends(tokenizer, s.token_ids, s.text) for s in flat],
                                          pa.list_(pa.int32())),
        "finish_reason": pa.array([s.finish_reason for s in flat], pa.string()),
        "prompt_len": pa.array(rep([len(r.prompt_token_ids) for r in requests]), pa.int32()),
        "completion_len": pa.array([len(s.token_ids) for s in flat], pa.int32()),
        "policy": pa.array([policy] * len(flat), pa.string()),
    }
    return pl.from_arrow(pa.table(cols))
