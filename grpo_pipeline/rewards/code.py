"""The ``tests`` reward: run the code of each completion against its task's hidden unit tests.

The code is the one ``<answer>…</answer>`` block (:func:`grpo_pipeline.rewards.parse.extract_answer`),
optionally fenced (```` ```python … ``` ````: the first fenced block is taken; an unclosed fence
is dropped).  It runs in :mod:`grpo_pipeline.sandbox` with the task's ``tests`` (and
``entry_point``) columns, which the score stage joins from the prompts file (:func:`attach_tests`).

=================  ==========================================================================
value              ``reward.tests.all_or_nothing`` (default): 1.0 when all pass, else 0.0; else ``passed / total``;
                   0.0 without an answer block; null where the row has no tests (a math prompt)
                   or the sandbox failed (then ``reward_error`` says why)
``tests_passed``   tests passed (Int32), ``tests_total`` tests run (Int32)
``tests_reason``   ``"ok"``, ``"no_code"`` or a :data:`grpo_pipeline.sandbox.REASONS` key: what failed
                   first, or what stopped the run (``timeout``, ``memory``, ``forbidden``, ...)
``tests_detail``   the exception, limit or signal, e.g. ``"test 2 'assert f(3) == 9': AssertionError: "``
=================  ==========================================================================

Identical (code, tests, entry point) triples in a batch run once.
"""

from __future__ import annotations

import polars as pl
import pyarrow as pa

from grpo_pipeline.rewards.parse import extract_answer
from grpo_pipeline.rewards.rules import register_rule
from grpo_pipeline.sandbox import Limits, Program, Verdict, run_programs

__all__ = ["EXTRA_FIELDS", "attach_tests", "extract_code", "limits_from", "reason_counts", "tests_rule"]

#: Columns the rule adds to the scores file, beside ``reward_tests``.
EXTRA_FIELDS = [pa.field("tests_passed", pa.int32()), pa.field("tests_total", pa.int32()),
                pa.field("tests_reason", pa.string()), pa.field("tests_detail", pa.string())]
_FENCE = r"(?s)```[ \t]*[A-Za-z0-9_+-]*[ \t]*\r?\n(.*?)```"
_OPEN_FENCE = r"(?s)^```[ \t]*[A-Za-z0-9_+-]*[ \t]*\r?\n(.*)$"


def extract_code(completion: pl.Series) -> pl.Series:
    """(N,) Utf8: the code in the answer block, fences removed; null without a valid block or when empty.

    >>> extract_code(pl.Series(["<answer>```python\\nx = 1\\n```</answer>", "<answer>y = 2</answer>", "y"])).to_list()
    ['x = 1\\n', 'y = 2', None]
    """
    ans = pl.col("a")
    return (
        pl.DataFrame({"a": extract_answer(completion)})
        .select(
            pl.coalesce(ans.str.extract(_FENCE, 1), ans.str.extract(_OPEN_FENCE, 1), ans)
            .replace("", None)
            .alias(completion.name)
        )
        .to_series()
    )


def limits_from(cfg: object) -> Limits:
    """Sandbox limits from ``reward.tests`` (a :class:`grpo_pipeline.config.TestsRewardConfig`)."""
    keys = ("timeout_s", "memory_mb", "file_size_mb", "max_processes", "workers", "batch_size", "require_isolation")
    return Limits(**{k: getattr(cfg, k) for k in keys})


@register_rule("tests")
def tests_rule(df: pl.DataFrame, *, cfg: object = None, **_: object) -> tuple[pl.Series, pl.Series, pl.DataFrame]:
    """Tests reward (module docstring); ``cfg`` is the ``reward`` section. Returns values, errors and
    the :data:`EXTRA_FIELDS` columns."""
    n = df.height
    tcfg = getattr(cfg, "tests", None)
    all_or_nothing = bool(getattr(tcfg, "all_or_nothing", True))
    tests = df["tests"].to_list() if "tests" in df.columns else [None] * n
    entries = df["entry_point"].to_list() if "entry_point" in df.columns else [None] * n
    codes = extract_code(df["completion"]).to_list()
    values: list[float | None] = [None] * n
    errors: list[str | None] = [None] * n
    passed: list[int | None] = [None] * n
    total: list[int | None] = [None] * n
    reasons: list[str | None] = [None] * n
    details: list[str | None] = [None] * n
    jobs: dict[Program, list[int]] = {}
    for i, (code, t, e) in enumerate(zip(codes, tests, entries)):
        if t is None:
            continue
        if not t:
            errors[i] = "tests: ValueError: the row's tests list is empty"
        elif code is None:
            values[i], passed[i], total[i], reasons[i] = 0.0, 0, len(t), "no_code"
            details[i] = "no <answer>...</answer> block with code"
        else:
            jobs.setdefault(Program(code, tuple(t), e), []).append(i)
    programs = list(jobs)
    verdicts = run_programs(programs, limits=limits_from(tcfg) if tcfg is not None else None) if programs else []
    for prog, v in zip(programs, verdicts):
        for i in jobs[prog]:
            _fill(i, v, all_or_nothing, values, errors, passed, total, reasons, details)
    extra = pl.DataFrame({"tests_passed": passed, "tests_total": total, "tests_reason": reasons,
                          "tests_detail": details},
                         schema={"tests_passed": pl.Int32, "tests_total": pl.Int32, "tests_reason": pl.Utf8,
                                 "tests_detail": pl.Utf8})
    return pl.Series("value", values, dtype=pl.Float64), pl.Series("error", errors, dtype=pl.Utf8), extra


def _fill(i: int, v: Verdict, all_or_nothing: bool, values, errors, passed, total, reasons, details) -> None:
    passed[i], total[i], reasons[i], details[i] = v.passed, v.total, v.reason, v.detail
    if v.reason in ("sandbox_error", "test_error"):
        errors[i] = f"tests: {v.reason}: {v.detail}"
    elif all_or_nothing:
        values[i] = float(v.passed == v.total)
    else:
        values[i] = v.passed / v.total


def attach_tests(rollouts: pl.DataFrame, prompts: pl.DataFrame, *, source: str) -> pl.DataFrame:
    """``rollouts`` with the ``tests`` / ``entry_point`` of its prompts (joined on ``prompt_id``).

    Raises
    ------
    ValueError
        A rollout whose ``prompt_id`` is not in ``prompts`` (named, with ``source``).
    """
    table = prompts.select("prompt_id", "tests", "entry_point")
    missing = rollouts.join(table, on="prompt_id", how="anti")
    if missing.height:
        msg = (f"{source}: no prompt {missing['prompt_id'][0]!r} (and {missing.height - 1} more rollouts) "
               "for the rollouts being scored. Hint: score with the prompts file the rollouts were sampled from")
        raise ValueError(msg)
    return rollouts.drop([c for c in ("tests", "entry_point") if c in rollouts.columns]).join(
        table, on="prompt_id", how="left", maintain_order="left")


def reason_counts(scores: pl.LazyFrame | pl.DataFrame) -> dict[str, int]:
    """``{"tests/reason/<reason>": count}`` over a scores file's ``tests_reason`` (``{}`` without it)."""
    lf = scores.lazy()
    if "tests_reason" not in lf.collect_schema().names():
        return {}
    counts = lf.group_by("tests_reason").len().drop_nulls().sort("tests_reason").collect()
    return {f"tests/reason/{r}": int(n) for r, n in counts.iter_rows()}
