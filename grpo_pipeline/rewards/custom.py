"""User rewards given as ``module:function`` (``reward.custom`` in params.yaml).

Signature of a custom reward, called on batches (TRL-style)::

    fn(completions: list[str], answers: list[str], **columns) -> Sequence[float | None]

``columns`` holds every other column of the batch as a list of the same length
(``prompt_id``, ``sample_idx``, ``operation``, ``question``, ...), so accept
``**kwargs``.  Return one value per completion: a finite number, or ``None`` for
"not applicable" (the reward column is null there, no error).

Failures are isolated: when the batch call raises (or returns the wrong number
of values) the function is called again once per completion, and a line on stderr
says so; an exception on one completion, or a non-finite or non-numeric value, makes
that row's reward null and is recorded as ``"<name>: <ExceptionType>: message"``
(``"returned nan"`` for NaN).  :func:`grpo_pipeline.rewards.score_frame` fails the
stage when more than ``max_error_share`` of the rows errored, the score stage when a
custom reward is null for every row.

Every call has a time limit (``reward.custom[].timeout_s``, on the batch call and on
each per-row call): a call that overruns fails the stage, naming the reward (a hang
is not a per-row error, and retrying row by row would multiply it).
"""

from __future__ import annotations

import contextlib
import importlib
import math
import numbers
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import polars as pl

__all__ = ["RewardTimeout", "call_with_fallback", "load_function", "run_custom_reward", "to_reward_value"]


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


class RewardTimeout(RuntimeError):
    """A reward function call overran its time limit."""


@contextlib.contextmanager
def time_limit(seconds: float | None, what: str) -> Iterator[None]:
    """Raise :class:`RewardTimeout` in the body after ``seconds`` (SIGALRM: main thread only, else no limit)."""
    if not seconds or threading.current_thread() is not threading.main_thread():
        yield
        return

    def expired(_sig, _frame):
        raise RewardTimeout(f"{what}: no result within {seconds:g} s")

    old = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def call_with_fallback(
    name: str,
    n: int,
    call: Callable[[list[int] | None], Sequence[Any]],
    convert: Callable[[Any, int], Any],
    timeout_s: float | None = None,
) -> tuple[list[Any], list[str | None]]:
    """Call ``call(None)`` on the whole batch; on failure (logged) ``call([i])`` per row.

    ``convert(item, row)`` turns one returned item into the stored value (raising
    marks that row failed).  Returns ``(values, errors)``, each of length ``n``.
    Each call gets ``timeout_s``; an overrun raises :class:`RewardTimeout` naming ``name``.
    """
    values: list[Any] = [None] * n
    errors: list[str | None] = [None] * n
    hint = f"Hint: make it faster or raise its timeout_s ({timeout_s:g} s)" if timeout_s else ""
    try:
        with time_limit(timeout_s, f"reward {name!r}, called on a batch of {n} completions"):
            out = call(None)
        if len(out) != n:
            msg = f"returned {len(out)} values for {n} completions"
            raise ValueError(msg)
        out = list(out)
    except RewardTimeout as e:
        raise RewardTimeout(f"{e}. {hint}") from None
    except Exception as e:  # noqa: BLE001 - isolate the failing rows below
        print(f"warning: reward {name!r}: the call on a batch of {n} completions failed ({_error(name, e)}); "
              "calling it once per completion instead", file=sys.stderr, flush=True)
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
            with time_limit(timeout_s, f"reward {name!r}, called on row {i} alone"):
                one = call([i])
            if len(one) != 1:
                msg = f"returned {len(one)} values for 1 completion"
                raise ValueError(msg)
            values[i] = convert(next(iter(one)), i)
        except RewardTimeout as e:
            raise RewardTimeout(f"{e}. {hint}") from None
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


def run_custom_reward(fn: Callable[..., Any], name: str, df: pl.DataFrame,
                      timeout_s: float | None = None) -> tuple[pl.Series, pl.Series]:
    """Run one custom reward on ``df``: ``((N,) Float64 values, (N,) Utf8 errors)``."""
    columns = batch_columns(df)

    def call(rows: list[int] | None) -> Sequence[Any]:
        kw = take(columns, rows)
        return fn(kw.pop("completions"), kw.pop("answers"), **kw)

    values, errors = call_with_fallback(name, df.height, call, lambda v, _i: to_reward_value(v), timeout_s)
    return pl.Series("value", values, dtype=pl.Float64), pl.Series("error", errors, dtype=pl.Utf8)
