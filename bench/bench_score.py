"""Benchmark the scoring stage's rule rewards on synthetic completions.

Generates N (default 1,000,000) completions — correct and wrong answers, bad
format, fractions, thousands separators, full-width digits, Chinese units, ~0.1%
LaTeX (half of it ``\\sqrt`` that only math-verify decides) — and prints rows/s
and peak RSS for

1. format + accuracy (vectorised, :func:`score_frame` without steps; the reasoning rule
   is always computed too),
2. the same with step splitting and the arithmetic step scorer,
3. the baseline: the per-row Python twins (:mod:`grpo_pipeline.rewards.rowwise`)
   of the same two rules, on a subset (default 50,000), and the ratio.

Usage::

    python bench/bench_score.py [--rows 1000000] [--baseline-rows 50000] [--seed 0]
"""

from __future__ import annotations

import argparse
import resource
import time

import numpy as np
import polars as pl

from grpo_pipeline.config import RewardConfig
from grpo_pipeline.rewards import score_frame
from grpo_pipeline.rewards.rowwise import accuracy_row, format_row
from grpo_pipeline.rewards.rules import math_verify_match

KINDS = {  # kind -> share
    "en_correct": 0.30, "zh_correct": 0.20, "wrong": 0.15, "fraction": 0.06, "thousands": 0.04,
    "fullwidth": 0.04, "no_tags": 0.06, "trailing": 0.05, "two_answers": 0.03, "multiline": 0.0695,
    "latex_frac": 0.0005, "latex_sqrt": 0.0005,
}
SYM = {"add": "+", "sub": "-", "mul": "×", "div": "/"}
G = 8


def make_frame(n: int, *, seed: int = 0) -> pl.DataFrame:
    """``n`` synthetic completions with ``prompt_id``, ``sample_idx``, ``answer``, ``operation``."""
    rng = np.random.default_rng(seed)
    group = np.arange(n) // G  # one problem per prompt, G completions each
    a = rng.integers(1, 2000, n // G + 1)[group]
    b = rng.integers(1, 50, n // G + 1)[group]
    ops = np.array(list(SYM))[rng.integers(0, 4, n // G + 1)][group]
    share = np.array(list(KINDS.values()))
    kind = np.array(list(KINDS))[rng.choice(len(KINDS), n, p=share / share.sum())]
    kind = np.where((kind == "fraction") & (ops != "div"), "en_correct", kind)
    val = np.select([ops == "add", ops == "sub", ops == "mul"], [a + b, a - b, a * b], a / b)
    ans = pl.Series(np.where(ops == "div", np.char.mod("%.2f", val), np.char.mod("%d", np.round(val))))
    df = pl.DataFrame({"a": a, "b": b, "operation": ops, "kind": kind, "answer": ans})
    s, A, B = pl.col("answer"), pl.col("a").cast(pl.Utf8), pl.col("b").cast(pl.Utf8)
    sym = pl.col("operation").replace_strict(SYM)
    think = pl.concat_str([pl.lit("<think>"), A, pl.lit(" "), sym, pl.lit(" "), B, pl.lit(" = "), s, pl.lit("</think>")])
    wrong = (s.cast(pl.Float64) + 1).round(2).cast(pl.Utf8)
    tag = lambda x: pl.concat_str([pl.lit("<answer>"), x, pl.lit("</answer>")])
    k = pl.col("kind")
    thousands = s.cast(pl.Float64).cast(pl.Int64).map_elements(lambda v: f"{v:,}", return_dtype=pl.Utf8)
    comp = (
        pl.when(k == "en_correct").then(pl.concat_str([think, tag(s)]))
        .when(k == "zh_correct").then(pl.concat_str([
            pl.lit("<think>"), A, pl.lit("元"), sym, B, pl.lit("支="), s, pl.lit("元。所以每支约"), s,
            pl.lit("元</think>\n<answer>约"), s, pl.lit("元</answer>")]))
        .when(k == "wrong").then(pl.concat_str([think, tag(wrong)]))
        .when(k == "fraction").then(pl.concat_str([think, tag(pl.concat_str([A, pl.lit("/"), B]))]))
        .when(k == "thousands").then(pl.concat_str([think, tag(thousands)]))
        .when(k == "fullwidth").then(pl.concat_str([think, tag(s.str.replace_many(list("0123456789."), list("０１２３４５６７８９．")))]))
        .when(k == "no_tags").then(pl.concat_str([A, pl.lit(" "), sym, pl.lit(" "), B, pl.lit(" is "), s]))
        .when(k == "trailing").then(pl.concat_str([think, tag(s), pl.lit(" Hope this helps!")]))
        .when(k == "two_answers").then(pl.concat_str([think, tag(s), tag(wrong)]))
        .when(k == "multiline").then(pl.concat_str([
            pl.lit("<think>First, "), A, pl.lit(" "), sym, pl.lit(" "), B, pl.lit(" = "), s,
            pl.lit(".\nCheck: 2 + 2 = 4.\nSo the answer is "), s, pl.lit(".</think> "), tag(pl.concat_str([pl.lit("$"), s]))]))
        .when(k == "latex_frac").then(pl.concat_str([think, tag(pl.concat_str([pl.lit("\\frac{"), A, pl.lit("}{"), B, pl.lit("}")]))]))
        .otherwise(pl.concat_str([think, tag(pl.concat_str([pl.lit("\\sqrt{"), A, pl.lit("}")]))]))
    )
    return df.select(
        prompt_id=pl.format("p{}", pl.int_range(n) // G),
        sample_idx=(pl.int_range(n) % G).cast(pl.Int32),
        completion=comp, answer=s, operation="operation",
    )


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def timed(label: str, fn, n: int) -> float:
    t = time.perf_counter()
    fn()
    dt = time.perf_counter() - t
    print(f"{label:<42} {n:>9,} rows  {dt:7.2f} s  {n / dt:>11,.0f} rows/s  peak RSS {peak_rss_mib():,.0f} MiB")
    return n / dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--baseline-rows", type=int, default=50_000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    t = time.perf_counter()
    df = make_frame(args.rows, seed=args.seed)
    print(f"generated {df.height:,} completions in {time.perf_counter() - t:.1f} s; kinds: {dict(KINDS)}")
    weights = {"accuracy": 1.0, "format": 1.0, "reasoning": 0.0}
    plain = RewardConfig(weights=weights, step_scorer=None)
    steps = RewardConfig(weights=weights, step_scorer="arithmetic")
    t = time.perf_counter()
    math_verify_match("\\sqrt{4}", "2", rel_tol=1e-6)  # one-off import and grammar warm-up, not timed below
    print(f"math-verify warm-up: {time.perf_counter() - t:.2f} s")
    out: dict[str, pl.DataFrame] = {}
    fast = timed("rules (format + accuracy + reasoning)", lambda: out.setdefault("p", score_frame(df, plain)[0]), df.height)
    math_verify_match.cache_clear()
    timed("rules + steps (lines, arithmetic)", lambda: out.setdefault("s", score_frame(df, steps)[0]), df.height)
    math_verify_match.cache_clear()
    sub = df.head(args.baseline_rows)
    rows = list(zip(sub["completion"].to_list(), sub["answer"].to_list(), strict=True))
    res: list[tuple[float, float]] = []
    base = timed(
        "baseline: per-row Python, same two rules",
        lambda: res.extend((format_row(c), accuracy_row(c, a, rel_tol=1e-6)) for c, a in rows),
        len(rows),
    )
    got = out["p"].head(len(rows)).select("reward_format", "reward_accuracy").rows()
    print(f"vectorised / baseline: {fast / base:.1f}x; baseline agrees on {sum(g == r for g, r in zip(got, res, strict=True))}/{len(rows)} rows")
    print("mean rewards:", out["p"].select(pl.col("^reward_.*$").exclude("reward_error").mean()).row(0, named=True))


if __name__ == "__main__":
    main()
