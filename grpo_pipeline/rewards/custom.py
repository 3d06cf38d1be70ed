"""User rewards given as ``module:function`` (``reward.custom`` in params.yaml).

Signature of a custom reward, called on batches (TRL-style)::

    fn(completions: list[str], answers: list[str], **columns) -> Sequence[float | None]

``columns`` holds every other column of the batch as a list of the same length
(``prompt_id``, ``sample_idx``, ``operation``, ``question``, ...), so accept
``**kwargs``.  Return one value per completion: a finite number, or ``None`` for
"not applicable" (the reward column is null there, no error).

Failures are isolated: when the batch call raises (or returns the wrong number
of values) the function is called again once per completion; an exception on one
completion, or a non-finite or non-numeric value, makes that row's reward null
and is recorded as ``"<name>: <ExceptionType>: message"`` (``"returned nan"`` for
NaN).  :func:`grpo_pipeline.rewards.score_frame` fails the stage when more than
``max_error_share`` of the rows errored.
"""

from __future__ import annotations

import importlib
import math
import numbers
from collections.abc import Callable, Sequence
from typing import Any

import polars as pl

__all__ = ["call_with_fallback", "load_function", "run_custom_reward", "to_reward_value"]


def load_function(spec: str, *, what: str) -> Callable[..., Any]:
    """Import ``"module:function"``; ``what`` names the config entry in errors."""
    mod_name, sep, fn_name = spec.partition(":")
    if not sep or not mod_name or not fn_name:
        msg = f"{what}: {spec!r} is not of the form 'module:function'"
        raise ValueError(msg)
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        msg = f"{what}: cannot import module {mod_name!r} for {spec!r}: {e}. Hint: is it on PYTHONPATH / installed?"
        raise ValueError(msg) from e
    fn = getattr(mod, fn_name, None)
    if fn is None:
        public = sorted(n for n, v in vars(mod).items() if callable(v) and not n.startswith("_"))
        msg = f"{what}: module {mod_name!r} has no function {fn_name!r}; callables there: {public}"
        raise ValueError(msg)
    if not callable(fn):
        msg = f"{what}: {spec!r} is a {type(fn).__name__}, not a function"
        raise ValueError(msg)  # noqa: TRY004 - a config error, like the others here
    return fn


def to_reward_value(v: object) -> float | None:
    """One returned value as a float (None stays None); raise ``ValueError`` for
    NaN / infinities and ``TypeError`` for non-numbers."""
    if v is None:
        return None
    if isinstance(v, bool | numbers.Real):
        f = float(v)
        if not math.isfinite(f):
            msg = f"returned {f}"
            raise ValueError(msg)
        return f
    msg = f"returned a {type(v).__name__} ({v!r:.60}), expected a number or None"
    raise TypeError(msg)


def _error(name: str, e: BaseException) -> str:
    return f"{name}: {type(e).__name__}: {e}"


def call_with_fallback(
    name: str,
    n: int,
    call: Callable[[list[int] | None], Sequence[Any]],
    convert: Callable[[Any, int], Any],
) -> tuple[list[Any], list[str | None]]:
    """Call ``call(None)`` on the whole batch; on failure ``call([i])`` per row.

    ``convert(item, row)`` turns one returned item into the stored value (raising
    marks that row failed).  Returns ``(values, errors)``, each of length ``n``.
    """
    values: list[Any] = [None] * n
    errors: list[str | None] = [None] * n
    try:
        out = call(None)
        if len(out) != n:
            msg = f"returned {len(out)} values for {n} completions"
            raise ValueError(msg)
        out = list(out)
    except Exception:  # noqa: BLE001 - isolate the failing rows below
        out = None
    if out is not None:
        for i, item in enumerate(out):
            try:
                values[i] = convert(item, i)
            except Exception as e:  # noqa: BLE001
                errors[i] = _error(name, e)
        return values, errors
    for i in range(n):
        try:
            one = call([i])
            if len(one) != 1:
                msg = f"returned {len(one)} values for 1 completion"
                raise ValueError(msg)
            values[i] = convert(next(iter(one)), i)
        except Exception as e:  # noqa: BLE001
            errors[i] = _error(name, e)
    return values, errors


def batch_columns(df: pl.DataFrame) -> dict[str, list[Any]]:
    """``completions``, ``answers`` and every other column, as lists."""
    cols = {c: df[c].to_list() for c in df.columns if c not in ("completion", "answer")}
    return {"completions": df["completion"].to_list(), "answers": df["answer"].to_list(), **cols}


def take(columns: dict[str, list[Any]], rows: list[int] | None) -> dict[str, list[Any]]:
    """The ``rows`` of every column (all of them for None)."""
    if rows is None:
        return dict(columns)
    return {k: [v[i] for i in rows] for k, v in columns.items()}


def run_custom_reward(fn: Callable[..., Any], name: str, df: pl.DataFrame) -> tuple[pl.Series, pl.Series]:
    """Run one custom reward on ``df``: ``((N,) Float64 values, (N,) Utf8 errors)``."""
    columns = batch_columns(df)

    def call(rows: list[int] | None) -> Sequence[Any]:
        kw = take(columns, rows)
        return fn(kw.pop("completions"), kw.pop("answers"), **kw)

    values, errors = call_with_fallback(name, df.height, call, lambda v, _i: to_reward_value(v))
    return pl.Series("value", values, dtype=pl.Float64), pl.Series("error", errors, dtype=pl.Utf8)
