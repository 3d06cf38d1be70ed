"""Rule rewards of the scoring stage: accuracy, format, reasoning, custom, steps.

:func:`score_frame` scores one batch of completions (the stage streams row groups
through it).  The components and their rules are documented in :mod:`.rules`,
:mod:`.parse` (numbers and the tolerance rule), :mod:`.custom` (``module:function``
rewards) and :mod:`.steps` (step spans and step scorers).

Total reward (spec 2.3: the sum of the rule rewards, here weighted)::

    reward = sum_k w_k * reward_k        over components with w_k != 0

null when one of those components is null (errored, or not applicable such as
``reasoning`` without an operation); the advantage stage leaves such rows out.
Built-in weights come from ``reward.weights`` (a rule missing there weighs 0),
custom ones from each ``reward.custom`` entry.  The ``tests`` rule (:mod:`.code`: run the
completion's code against the row's ``tests`` in the sandbox) runs only when weighted or when
the frame has a ``tests`` column, and adds ``tests_passed``, ``tests_total``, ``tests_reason``
and ``tests_detail``.

Errors: a row on which a reward fails gets a null value there and a
``reward_error`` entry.  ``reward.max_error_share`` is checked per batch for every
reward that can fail row by row: custom rewards, a plugged step scorer
(``"steps"``), and accuracy's math-verify path.

Example
-------
>>> import polars as pl
>>> from grpo_pipeline.config import RewardConfig
>>> df = pl.DataFrame({"prompt_id": ["p0"], "sample_idx": [0],
...                    "completion": ["<think>5 / 3 = 1.67</think><answer>1.67</answer>"],
...                    "answer": ["1.67"], "operation": ["div"]})
>>> out, metrics = score_frame(df, RewardConfig(weights={"accuracy": 1.0, "format": 1.0}))
>>> out["reward"].to_list(), out["steps"].to_list()  # a reasoning step, then the answer
([2.0], [[{'start': 7, 'end': 19, 'reward': 1.0}, {'start': 27, 'end': 48, 'reward': 1.0}]])
"""

from __future__ import annotations

from typing import Any

import polars as pl

from grpo_pipeline.config import RewardConfig
from grpo_pipeline.rewards import code as _code  # noqa: F401 - registers the "tests" rule
from grpo_pipeline.rewards.custom import load_function, run_custom_reward
from grpo_pipeline.rewards.rules import REWARD_RULES, get_rule, register_rule
from grpo_pipeline.rewards.steps import STEP_SCORERS, score_steps, split_steps, with_answer_step

__all__ = [
    "REWARD_RULES",
    "STEP_SCORERS",
    "RewardError",
    "get_rule",
    "register_rule",
    "reward_metrics",
    "score_frame",
    "split_steps",
]

REQUIRED = {"prompt_id": pl.Utf8, "sample_idx": None, "completion": pl.Utf8, "answer": pl.Utf8}
#: Rules that run only when weighted or when the input has their column (running code costs time).
OPT_IN_RULES = {"tests": "tests"}


def _runs(name: str, df: pl.DataFrame, cfg: RewardConfig) -> bool:
    col = OPT_IN_RULES.get(name)
    return col is None or col in df.columns or cfg.weights.get(name, 0.0) != 0.0


class RewardError(RuntimeError):
    """Too many completions errored in one reward (over ``reward.max_error_share``)."""


def _check_input(df: pl.DataFrame, cfg: RewardConfig) -> None:
    missing = [c for c in REQUIRED if c not in df.columns]
    if missing:
        msg = f"score_frame: missing columns {missing}; got {df.columns}"
        raise ValueError(msg)
    for col, dtype in REQUIRED.items():
        if dtype is not None and df.schema[col] != dtype:
            msg = f"score_frame: column {col!r} must be {dtype}, got {df.schema[col]}"
            raise ValueError(msg)
    for col in ("completion", "answer"):
        nulls = df.filter(pl.col(col).is_null())
        if nulls.height:
            r = nulls.row(0, named=True)
            msg = (
                f"score_frame: column {col!r} is null in {nulls.height} rows, first at "
                f"prompt_id={r['prompt_id']!r} sample_idx={r['sample_idx']!r}"
            )
            raise ValueError(msg)
    if cfg.weights.get("reasoning", 0.0) != 0.0 and "operation" not in df.columns:
        msg = "score_frame: reward.weights.reasoning is not 0 but the frame has no 'operation' column"
        raise ValueError(msg)
    if cfg.weights.get("tests", 0.0) != 0.0 and "tests" not in df.columns:
        msg = ("score_frame: reward.weights.tests is not 0 but the frame has no 'tests' column. Hint: set "
               "data.task: coding and score with --prompts (the score stage joins the tests on prompt_id)")
        raise ValueError(msg)
    names = [c.name for c in cfg.custom]
    clash = [n for n in names if n in REWARD_RULES or names.count(n) > 1]
    if clash:
        msg = f"reward.custom: names {sorted(set(clash))} clash with a built-in rule {list(REWARD_RULES)} or repeat"
        raise ValueError(msg)


def _check_error_share(name: str, errors: pl.Series, df: pl.DataFrame, cfg: RewardConfig) -> int:
    n_err = errors.len() - errors.null_count()
    if df.height and n_err / df.height > cfg.max_error_share:
        i = errors.is_not_null().arg_true()[0]
        msg = (
            f"reward {name!r} failed on {n_err} of {df.height} completions ({n_err / df.height:.1%}), over "
            f"reward.max_error_share={cfg.max_error_share:.1%}; first failure at prompt_id={df['prompt_id'][i]!r} "
            f"sample_idx={df['sample_idx'][i]!r}: {errors[i]}"
        )
        raise RewardError(msg)
    return n_err


def score_frame(df: pl.DataFrame, cfg: RewardConfig) -> tuple[pl.DataFrame, dict[str, Any]]:
    """Score completions with the rule, custom and step rewards.

    Parameters
    ----------
    df
        One row per completion: ``prompt_id`` (str), ``sample_idx`` (int),
        ``completion`` (str, after the assistant prefix), ``answer`` (str,
        reference), optionally ``operation`` (add/sub/mul/div or null) and any
        other columns (passed to custom rewards and plugged step scorers).
    cfg
        The ``reward`` section of params.yaml.

    Returns
    -------
    (frame, metrics)
        ``frame``: ``prompt_id``, ``sample_idx``, ``reward_accuracy``, ``reward_format``,
        ``reward_reasoning``, ``reward_<custom>`` (Float64, null: errored / not
        applicable), ``reward`` (Float64), ``reward_error`` (Utf8, ``"; "``-joined
        ``"<name>: <Type>: message"``), ``steps`` (List(Struct{start, end, reward}): the reasoning
        steps, then the final answer rewarded by accuracy; empty when ``step_scorer`` is null).
        ``metrics``: ``rows``, ``rewards/<name>/errors``, ``steps/errors`` (rows on which it failed)
        and the batch's :func:`reward_metrics`.

    Raises
    ------
    ValueError
        Missing / mistyped / null input columns, an unknown ``operation``, a bad
        ``module:function``, an unknown step scorer.
    RewardError
        More than ``cfg.max_error_share`` of the rows errored in one reward.
    """
    _check_input(df, cfg)
    customs = [(c, load_function(c.function, what=f"reward.custom {c.name!r}")) for c in cfg.custom]
    components: dict[str, tuple[pl.Series, float]] = {}
    errors: list[pl.Series] = []
    metrics: dict[str, Any] = {"rows": df.height}
    extras: list[pl.DataFrame] = []  # rule outputs beside the value, e.g. tests_reason
    for name, rule in REWARD_RULES.items():
        if not _runs(name, df, cfg):
            continue
        values, errs, *extra = rule(df, rel_tol=cfg.rel_tol, format_partial_credit=cfg.format_partial_credit, cfg=cfg)
        extras += extra
        components[name] = (values, cfg.weights.get(name, 0.0))
        errors.append(errs)
        metrics[f"rewards/{name}/errors"] = _check_error_share(name, errs, df, cfg)
    for c, fn in customs:
        values, errs = run_custom_reward(fn, c.name, df, c.timeout_s)
        components[c.name] = (values, c.weight)
        errors.append(errs)
        metrics[f"rewards/{c.name}/errors"] = _check_error_share(c.name, errs, df, cfg)
    steps, step_errs = score_steps(df, split=cfg.step_split, scorer=cfg.step_scorer)
    if cfg.step_scorer is not None:  # the final answer is the last step, rewarded by accuracy
        steps = with_answer_step(steps, df["completion"], components["accuracy"][0])
    step_errors = pl.Series("error", step_errs, dtype=pl.Utf8)
    metrics["steps/errors"] = _check_error_share("steps", step_errors, df, cfg)
    errors.append(step_errors)

    out = df.select("prompt_id", "sample_idx").with_columns(
        [values.alias(f"reward_{name}") for name, (values, _) in components.items()]
    )
    weighted = [pl.col(f"reward_{n}") * w for n, (_, w) in components.items() if w != 0.0]
    total = pl.sum_horizontal(weighted) if weighted else pl.lit(0.0)
    any_null = pl.any_horizontal([e.is_null() for e in weighted]) if weighted else pl.lit(False)
    err_frame = pl.DataFrame([e.alias(f"e{i}") for i, e in enumerate(errors)])
    out = out.with_columns(
        reward=pl.when(any_null).then(None).otherwise(total).cast(pl.Float64),
        reward_error=err_frame.select(
            pl.concat_str(pl.all(), separator="; ", ignore_nulls=True).replace("", None)
        ).to_series(),
        steps=steps,
    )
    out = pl.concat([out, *extras], how="horizontal") if extras else out
    return out, {**metrics, **reward_metrics(out)}


def reward_metrics(scored: pl.DataFrame | pl.LazyFrame) -> dict[str, Any]:
    """Statistics of scored completions, one home for them (the score stage runs it once on its whole
    output file, :func:`score_frame` on its batch): per reward column ``<name>/mean``, ``<name>/std``
    (population), ``<name>/nulls`` (``total`` for ``reward``), ``errors`` (rows with a
    ``reward_error``), ``completions``, and with a ``steps`` column ``steps/per_completion``,
    ``steps/reward_mean``, ``steps/null_share``. Means skip nulls; an empty frame gives None."""
    lf = scored.lazy()
    names = lf.collect_schema().names()
    cols = [c for c in names if c == "reward" or (c.startswith("reward_") and c != "reward_error")]
    exprs = []
    for c in cols:
        name = c.removeprefix("reward_") if c != "reward" else "total"
        exprs += [pl.col(c).mean().alias(f"{name}/mean"), pl.col(c).std(ddof=0).alias(f"{name}/std"),
                  pl.col(c).null_count().alias(f"{name}/nulls")]
    exprs += [pl.col("reward_error").is_not_null().sum().alias("errors"), pl.len().alias("completions")]
    if "steps" in names:
        reward = pl.element().struct.field("reward")
        n_steps = pl.col("steps").list.len().sum()
        n_valid = pl.col("steps").list.eval(reward.is_not_null()).list.sum().sum()
        total = pl.col("steps").list.eval(reward.fill_null(0.0)).list.sum().sum()
        exprs += [pl.when(pl.len() > 0).then(n_steps / pl.len()).alias("steps/per_completion"),
                  pl.when(n_valid > 0).then(total / n_valid).alias("steps/reward_mean"),
                  pl.when(n_steps > 0).then((n_steps - n_valid) / n_steps).alias("steps/null_share")]
    row = lf.select(exprs).collect().row(0, named=True)
    return {k: (round(float(v), 6) if isinstance(v, float) else (None if v is None else int(v))) for k, v in row.items()}
