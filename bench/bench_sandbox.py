"""Benchmark the ``tests`` reward: N completions through the sandbox, hostile ones included.

Builds N (default 2,000) completions for generated coding tasks, each one distinct (so the
reward's de-duplication cannot skip work): correct and wrong solutions, syntax errors, and
hostile ones that loop forever, allocate without bound, or fork repeatedly (half of the fork
bombs give up at the first refused fork, half keep trying until the timeout).  Scores them with
:func:`grpo_pipeline.rewards.score_frame` (``reward.weights.tests: 1``) and prints completions/s,
the verdicts per kind, and whether every completion got a verdict (a non-null reward and the
expected reason).  Baseline: a fresh ``python -I -S`` per completion with a timeout and no
isolation (``subprocess.run``, as many at a time as sandbox workers), on the benign completions
only (a fork bomb there would be unbounded), and the ratio.

Usage::

    python bench/bench_sandbox.py [--n 2000] [--hostile-share 0.02] [--timeout 1.0] [--workers 0]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import polars as pl

from grpo_pipeline.coding import generate_tasks
from grpo_pipeline.config import RewardConfig
from grpo_pipeline.rewards import score_frame
from grpo_pipeline.sandbox import isolation

HOSTILE = {  # kind -> (code template, expected reason); {i} makes each completion distinct
    "loop": ("def {ep}(*a):\n    i = {i}\n    while True:\n        i += 1\n", "timeout"),
    "memory": ("x = [{i}]\nwhile True:\n    x.append(' ' * 10**6)\n", "memory"),
    "fork": ("import os\ndef {ep}(*a):\n    for _ in range({i} + 10**6):\n        os.fork()\n", "process_limit"),
    "fork_retry": (("import os\ndef {ep}(*a):\n    while True:\n        try:\n            os.fork()\n"
                    "        except OSError:\n            {i}\n"), "timeout"),
}
BENIGN = {"correct": "ok", "wrong": "assertion", "syntax": "syntax_error"}


def make_frame(n: int, *, hostile_share: float, seed: int = 0) -> tuple[pl.DataFrame, list[str], dict[str, str]]:
    tasks = generate_tasks(n=min(n, 240), seed=seed).to_dicts()
    n_each = max(1, round(n * hostile_share))
    kinds = [k for k in HOSTILE for _ in range(n_each)]
    benign = n - len(kinds)
    kinds += ["syntax"] * (benign // 10) + ["wrong"] * (benign * 3 // 10)
    kinds += ["correct"] * (n - len(kinds))
    rows, codes = [], []
    for i, kind in enumerate(kinds):
        t = tasks[i % len(tasks)]
        ep = t["entry_point"]
        if kind == "correct":
            code = f"{t['answer']}\n# {i}"
        elif kind == "wrong":
            code = f"def {ep}(*args):\n    return {i}\n"
        elif kind == "syntax":
            code = f"def {ep}(*args)\n    return {i}\n"
        else:
            code = HOSTILE[kind][0].format(ep=ep, i=i)
        codes.append(code)
        rows.append({"prompt_id": t["prompt_id"], "sample_idx": i, "answer": t["answer"], "tests": t["tests"],
                     "entry_point": ep, "completion": f"<think>plan</think><answer>```python\n{code}\n```</answer>"})
    expected = {**BENIGN, **{k: v[1] for k, v in HOSTILE.items()}}
    return pl.DataFrame(rows).with_columns(kind=pl.Series(kinds)), codes, expected


def baseline(frame: pl.DataFrame, codes: list[str], *, timeout: float, workers: int) -> float:
    """Completions/s of a fresh interpreter per benign completion (tests appended), ``workers`` at a time."""

    def one(src: str) -> None:
        try:
            subprocess.run([sys.executable, "-I", "-S", "-c", src], capture_output=True, timeout=timeout, check=False)
        except subprocess.TimeoutExpired:
            pass  # a verdict too ("timeout"), as in the sandbox

    t0 = time.perf_counter()
    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(one, [c + "\n" + "\n".join(t) for c, t in zip(codes, frame["tests"].to_list())]))
    return len(codes) / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--hostile-share", type=float, default=0.02, help="share of each of the 4 hostile kinds")
    ap.add_argument("--timeout", type=float, default=1.0, help="reward.tests.timeout_s")
    ap.add_argument("--workers", type=int, default=0, help="0: the usable cores")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--baseline-rows", type=int, default=200)
    args = ap.parse_args()
    df, codes, expected = make_frame(args.n, hostile_share=args.hostile_share)
    cfg = RewardConfig(weights={"tests": 1.0}, step_scorer=None, max_error_share=0.0,
                       tests={"timeout_s": args.timeout, "workers": args.workers, "batch_size": args.batch_size})
    iso = isolation()
    print(f"sandbox mode={iso['mode']} notes={iso['notes']} cores={len(os.sched_getaffinity(0))} "
          f"workers={args.workers or len(os.sched_getaffinity(0))} timeout_s={args.timeout}")
    t0 = time.perf_counter()
    out, _ = score_frame(df.drop("kind"), cfg)
    dt = time.perf_counter() - t0
    got = out.with_columns(kind=df["kind"])
    table = got.group_by("kind", "tests_reason").agg(n=pl.len(), reward=pl.col("reward_tests").mean()).sort("kind")
    print(table)
    wrong = got.filter(pl.col("tests_reason") != pl.col("kind").replace_strict(expected))
    print(f"{args.n} completions in {dt:.1f}s: {args.n / dt:.1f} completions/s; "
          f"verdicts: {got['tests_reason'].is_not_null().sum()}/{args.n}, null rewards: {got['reward_tests'].null_count()}, "
          f"unexpected reasons: {wrong.height}")
    benign = df.filter(pl.col("kind").is_in(list(BENIGN))).head(args.baseline_rows)
    sub = [codes[i] for i in benign["sample_idx"].to_list()]
    base = baseline(benign, sub, timeout=args.timeout, workers=args.workers or len(os.sched_getaffinity(0)))
    t1 = time.perf_counter()
    score_frame(benign.drop("kind"), cfg)
    ours = benign.height / (time.perf_counter() - t1)
    print(f"benign subset ({benign.height}): sandbox {ours:.1f}/s vs baseline (a fresh unsandboxed interpreter per "
          f"completion, as many at a time) {base:.1f}/s: ratio {ours / base:.2f}x")


if __name__ == "__main__":
    main()
