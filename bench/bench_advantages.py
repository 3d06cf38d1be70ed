"""Throughput of grpo_pipeline.advantages: outcome (GRPO) and process-supervision advantages.

Prints rows/s and peak RSS for outcome advantages on ``--rows`` rows (groups of ``--group-size``,
contiguous as the sampler writes them, and shuffled), the ratio against a straightforward
Python per-group loop timed in the same run on a ``--baseline-rows`` subset (scaled per row),
and rows/s for process advantages on ``--process-rows`` rows with ~``--steps`` steps each::

    PYTHONPATH=. python bench/bench_advantages.py         # 10M rows, G = 8; 1M process rows (or pip install -e .)
    PYTHONPATH=. python bench/bench_advantages.py --rows 1000000   # quicker
"""

from __future__ import annotations

import argparse
import math
import os
import resource
import time

import numpy as np
import polars as pl
import pyarrow as pa

from grpo_pipeline.advantages import compute_advantages
from grpo_pipeline.config import AdvantageConfig


def outcome_frame(rows: int, group_size: int, *, seed: int = 0) -> pl.DataFrame:
    """``rows`` scores, groups of ``group_size`` written contiguously, ~2% null rewards."""
    rng = np.random.default_rng(seed)
    n_groups = math.ceil(rows / group_size)
    pid = pl.Series("prompt_id", np.repeat(np.arange(n_groups), group_size)[:rows]).cast(pl.String)
    reward = rng.integers(0, 3, rows).astype(np.float64)  # accuracy + format style rewards
    return pl.DataFrame({
        "prompt_id": "p" + pid,
        "sample_idx": (np.arange(rows) % group_size).astype(np.int32),
        "reward": pl.Series(reward).set(pl.Series(rng.random(rows) < 0.02), None),
    })


def process_frame(rows: int, group_size: int, steps: int, *, seed: int = 0) -> pl.DataFrame:
    """Outcome frame plus a ``steps`` column with 1..2*steps-1 steps per row (mean ``steps``)."""
    rng = np.random.default_rng(seed)
    df = outcome_frame(rows, group_size, seed=seed)
    lengths = rng.integers(1, 2 * steps, rows)  # (N,)
    total = int(lengths.sum())
    width = rng.integers(5, 60, total)  # (S,) characters per step
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    end = np.cumsum(width)
    end -= np.repeat(end[offsets[:-1]] - width[offsets[:-1]], lengths)  # restart at 0 per row
    reward = pa.array(rng.integers(0, 2, total).astype(np.float64), mask=rng.random(total) < 0.05)
    struct = pa.StructArray.from_arrays(
        [pa.array((end - width).astype(np.int32)), pa.array(end.astype(np.int32)), reward], ["start", "end", "reward"])
    steps_col = pl.from_arrow(pa.LargeListArray.from_arrays(pa.array(offsets, pa.int64()), struct))
    return df.with_columns(steps=steps_col)


def python_loop_baseline(df: pl.DataFrame, delta: float) -> list[float]:
    """The straightforward reference: dict of groups, then a Python loop per group and per row."""
    groups: dict[str, list[int]] = {}
    pids, rewards = df["prompt_id"].to_list(), df["reward"].to_list()
    for i, pid in enumerate(pids):
        groups.setdefault(pid, []).append(i)
    adv = [0.0] * len(rewards)
    for idx in groups.values():
        rs = [rewards[i] for i in idx if rewards[i] is not None]
        if len(set(rs)) <= 1:
            continue
        mean = sum(rs) / len(rs)
        std = math.sqrt(sum((r - mean) ** 2 for r in rs) / len(rs))
        for i in idx:
            if rewards[i] is not None:
                adv[i] = (rewards[i] - mean) / (std + delta)
    return adv


def polars_window(df: pl.DataFrame, delta: float) -> pl.DataFrame:
    """The one-expression polars ``over()`` version (no all-equal guard), for comparison."""
    r = pl.col("reward")
    return df.select(((r - r.mean().over("prompt_id")) / (r.std(ddof=0).over("prompt_id") + delta)).fill_null(0.0))


def reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark (Linux ``clear_refs``); False where unsupported."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_mib() -> float:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def best_of(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def bench_outcome(args: argparse.Namespace, cfg: AdvantageConfig) -> None:
    df = outcome_frame(args.rows, args.group_size)
    print(f"outcome input: {args.rows:,} rows, G={args.group_size}, {df.estimated_size() / 2**20:.0f} MiB")
    rss_before = peak_rss_mib()
    exact_peak = reset_peak_rss()
    rss_base = peak_rss_mib()
    t = best_of(lambda: compute_advantages(df, cfg), args.repeats)
    peak = peak_rss_mib()
    fast = args.rows / t
    label = "peak RSS during compute" if exact_peak else "process peak RSS (could not reset the mark)"
    print(f"  vectorised, contiguous groups: {t:.3f} s  {fast / 1e6:.2f} M rows/s  "
          f"{label}: {peak:.0f} MiB (input frame resident: {rss_base:.0f} MiB, build peak {rss_before:.0f} MiB)")
    shuffled = df.sample(fraction=1.0, shuffle=True, seed=1)
    ts = best_of(lambda: compute_advantages(shuffled, cfg), max(1, args.repeats - 1))
    print(f"  vectorised, shuffled rows:     {ts:.3f} s  {args.rows / ts / 1e6:.2f} M rows/s")
    tw = best_of(lambda: polars_window(df, cfg.delta), 1)
    print(f"  polars over() one-liner:       {tw:.3f} s  {args.rows / tw / 1e6:.2f} M rows/s")

    sub = df.head(args.baseline_rows)
    tb = best_of(lambda: python_loop_baseline(sub, cfg.delta), 1)
    slow = sub.height / tb
    ours = compute_advantages(sub, cfg)[0]["advantage"].to_numpy()
    err = float(np.max(np.abs(ours - np.array(python_loop_baseline(sub, cfg.delta)))))
    print(f"  Python per-group loop on {sub.height:,} rows: {tb:.3f} s  {slow / 1e6:.3f} M rows/s "
          f"(scaled to {args.rows:,} rows: {args.rows / slow:.1f} s); max |diff| vs vectorised {err:.1e}")
    verdict = "met" if fast >= 5e6 else "NOT met"
    print(f"  speed-up over the loop: {fast / slow:.0f}x  (target >= 5 M rows/s: {verdict})")


def bench_process(args: argparse.Namespace) -> None:
    pdf = process_frame(args.process_rows, args.group_size, args.steps)
    n_steps = int(pdf["steps"].list.len().sum())
    pcfg = AdvantageConfig(estimator="process")
    tp = best_of(lambda: compute_advantages(pdf, pcfg), args.repeats)
    print(f"process input: {args.process_rows:,} rows, {n_steps:,} steps ({n_steps / args.process_rows:.2f}/row)")
    print(f"  vectorised: {tp:.3f} s  {args.process_rows / tp / 1e6:.2f} M rows/s  {n_steps / tp / 1e6:.2f} M steps/s")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=10_000_000)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--baseline-rows", type=int, default=200_000)
    ap.add_argument("--process-rows", type=int, default=1_000_000)
    ap.add_argument("--steps", type=int, default=4, help="mean steps per completion")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    print(f"cpus={os.cpu_count()} polars={pl.__version__} numpy={np.__version__} load={os.getloadavg()[0]:.2f}")
    bench_outcome(args, AdvantageConfig())  # grpo, population std, delta = 1e-4
    bench_process(args)


if __name__ == "__main__":
    main()
