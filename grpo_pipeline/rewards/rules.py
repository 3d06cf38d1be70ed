"""Built-in rule rewards (the spec's section 2.3 table), vectorised over a frame.

Every rule is registered by name in :data:`REWARD_RULES` and has the signature::

    rule(df: pl.DataFrame, *, rel_tol: float, format_partial_credit: bool)
        -> tuple[pl.Series, pl.Series]    # (N,) Float64 values, (N,) Utf8 errors

``df`` holds at least ``completion`` and ``answer`` (and ``operation`` for
``reasoning``).  A null value means "not applicable" or "failed" (then the error
column says why, as ``"<rule>: <ExceptionType>: message"``).

=========  ===================================================================
accuracy   1.0 when the one ``<answer>…</answer>`` matches the reference, else 0.0.
           Plain numbers by the tolerance rule of :mod:`.parse` (vectorised fast
           path); what the fast path cannot decide (``\\sqrt{2}``, ``2^{10}``, ...)
           goes row by row through math-verify.  Missing / repeated tags: 0.0.
format     1.0 for ``<think>…</think><answer>…</answer>``, exactly one of each, only
           whitespace around and between the blocks; else 0.0.  With
           ``format_partial_credit`` 0.25 for each of: (a) exactly one
           ``<think>…</think>``, (b) exactly one ``<answer>…</answer>``, (c) the text
           starts with ``<think>`` and ``</think>`` is followed (after whitespace)
           by ``<answer>``, (d) nothing but whitespace after ``</answer>``.  The four
           hold together exactly when the strict format holds (1.0 either way).
reasoning  1.0 when the ``<think>`` part shows the operation the problem needs
           (column ``operation``: add / sub / mul / div, see
           :data:`OPERATION_PATTERNS`), 0.0 when it does not or there is no
           ``<think>``; null where ``operation`` is null (not applicable).
=========  ===================================================================
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable

import polars as pl

from grpo_pipeline.rewards.parse import (
    CHAR_MAP,
    extract_answer_expr,
    normalize_expr,
    number_fields_expr,
    numbers_match,
    numbers_match_expr,
    parse_number,
)

__all__ = [
    "OPERATION_PATTERNS",
    "REWARD_RULES",
    "THINK_RE",
    "accuracy_fast_expr",
    "accuracy_rule",
    "format_reward_expr",
    "format_rule",
    "get_rule",
    "math_verify_match",
    "reasoning_reward_expr",
    "reasoning_rule",
    "register_rule",
]

RuleFn = Callable[..., tuple[pl.Series, pl.Series]]
REWARD_RULES: dict[str, RuleFn] = {}


def register_rule(name: str) -> Callable[[RuleFn], RuleFn]:
    """Register a built-in vectorised rule under ``name``."""

    def deco(fn: RuleFn) -> RuleFn:
        if name in REWARD_RULES:
            msg = f"reward rule {name!r} is already registered"
            raise ValueError(msg)
        REWARD_RULES[name] = fn
        return fn

    return deco


def get_rule(name: str) -> RuleFn:
    """The rule registered as ``name``; unknown names list the valid ones."""
    if name not in REWARD_RULES:
        msg = f"Unknown reward rule {name!r}. Supported rules are: {list(REWARD_RULES)}"
        raise ValueError(msg)
    return REWARD_RULES[name]


def _no_errors(n: int) -> pl.Series:
    return pl.Series("error", [None] * n, dtype=pl.Utf8)


# ------------------------------------------------------------------ accuracy
_HAS_MATH = r"[0-9\\]"


def accuracy_fast_expr(completion: pl.Expr, answer: pl.Expr, *, rel_tol: float) -> pl.Expr:
    """Fast-path accuracy: 1.0 / 0.0, or null where it cannot decide (-> math-verify).

    Decided: no valid answer block (0); equal normalised text, case-folded (1);
    both plain numbers (tolerance rule); a prediction without digits or LaTeX
    against a plain-number reference, or two texts without either (0).
    """
    pn, rn = normalize_expr(extract_answer_expr(completion)), normalize_expr(answer)
    pv, _ = number_fields_expr(pn)
    rv, rd = number_fields_expr(rn)
    same = pn.str.to_lowercase() == rn.str.to_lowercase()
    pred_math = pn.str.contains(_HAS_MATH)
    ref_math = rn.str.contains(_HAS_MATH)
    return (
        pl.when(pn.is_null()).then(0.0)
        .when(same).then(1.0)
        .when(pv.is_not_null() & rv.is_not_null())
        .then(numbers_match_expr(pv, rv, rd, rel_tol=rel_tol).cast(pl.Float64))
        .when(~pred_math & (rv.is_not_null() | ~ref_math)).then(0.0)
        .otherwise(None)
    )


def _mv_float(x: object) -> float | None:
    """A math-verify (sympy) result as a real float, or None."""
    if not getattr(x, "is_number", False):
        return None
    try:
        v = complex(x.evalf())  # type: ignore[attr-defined]
    except (TypeError, ValueError, AttributeError):
        return None
    return v.real if v.imag == 0 and math.isfinite(v.real) else None


def math_verify_match(pred: str, ref: str, *, rel_tol: float) -> bool:
    """Slow path: math-verify, with the tolerance rule applied when both sides
    evaluate to real numbers (so ``\\sqrt{2.79}`` matches ``1.67``).

    math-verify's signal-based timeouts only work in the main thread; elsewhere
    they are off.
    """
    from math_verify import parse, verify

    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    mapped = ["".join(CHAR_MAP.get(ch, ch) for ch in s) for s in (ref, pred)]
    gold = parse(mapped[0], parsing_timeout=timeout)
    target = parse(mapped[1], parsing_timeout=timeout)
    if not gold or not target:
        return False
    gv, tv = _mv_float(gold[0]), _mv_float(target[0])
    if gv is not None and tv is not None:
        ref_num = parse_number(ref)
        if numbers_match(tv, gv, ref_num.decimals if ref_num else None, rel_tol=rel_tol):
            return True
    return bool(verify(gold, target, timeout_seconds=timeout))


@register_rule("accuracy")
def accuracy_rule(df: pl.DataFrame, *, rel_tol: float, **_: object) -> tuple[pl.Series, pl.Series]:
    """Accuracy reward (module docstring); the metrics count slow-path rows."""
    frame = df.select(
        acc=accuracy_fast_expr(pl.col("completion"), pl.col("answer"), rel_tol=rel_tol),
        pred=extract_answer_expr(pl.col("completion")),
        answer=pl.col("answer"),
    )
    values = frame["acc"].to_list() if frame["acc"].null_count() else None
    errors: list[str | None] = [None] * df.height
    if values is None:
        return frame["acc"].alias("value"), pl.Series("error", errors, dtype=pl.Utf8)
    slow = frame.with_row_index("i").filter(pl.col("acc").is_null())
    for i, pred, ref in slow.select("i", "pred", "answer").iter_rows():
        try:
            values[i] = float(math_verify_match(pred, ref, rel_tol=rel_tol))
        except Exception as e:  # noqa: BLE001 - any failure is recorded, the row's reward is null
            errors[i] = f"accuracy: {type(e).__name__}: {e}"
    return pl.Series("value", values, dtype=pl.Float64), pl.Series("error", errors, dtype=pl.Utf8)


# ------------------------------------------------------------------ format
_STRICT_FORMAT_RE = r"(?s)^\s*<think>.*</think>\s*<answer>.*</answer>\s*$"


def _one_block(c: pl.Expr, tag: str) -> pl.Expr:
    return (
        (c.str.count_matches(f"<{tag}>", literal=True) == 1)
        & (c.str.count_matches(f"</{tag}>", literal=True) == 1)
        & c.str.contains(f"(?s)<{tag}>.*</{tag}>")
    )


def format_reward_expr(completion: pl.Expr, *, partial_credit: bool = False) -> pl.Expr:
    """Format reward as an expression (module docstring for the items)."""
    think, answer = _one_block(completion, "think"), _one_block(completion, "answer")
    order = completion.str.contains(r"^\s*<think>") & completion.str.contains(r"</think>\s*<answer>")
    trailing = completion.str.contains(r"</answer>\s*$")
    if partial_credit:
        items = [think, answer, order, trailing]
        return pl.sum_horizontal([x.cast(pl.Float64) for x in items]) * 0.25
    strict = think & answer & completion.str.contains(_STRICT_FORMAT_RE)
    return strict.cast(pl.Float64)


@register_rule("format")
def format_rule(df: pl.DataFrame, *, format_partial_credit: bool = False, **_: object) -> tuple[pl.Series, pl.Series]:
    """Format reward (module docstring)."""
    v = df.select(value=format_reward_expr(pl.col("completion"), partial_credit=format_partial_credit))
    return v["value"], _no_errors(df.height)


# ------------------------------------------------------------------ reasoning
#: The ``<think>`` content: up to the first ``</think>``, or to the end when unclosed.
THINK_RE = r"(?s)<think>(.*?)(?:</think>|$)"

#: What "shows the operation" means, case-insensitive, per ``operation`` value.
OPERATION_PATTERNS: dict[str, str] = {
    "div": r"(?i)[/／÷]|\bdivid|\bdivision\b|除",
    "mul": r"(?i)[*＊×]|[0-9]\s*x\s*[0-9]|\btimes\b|\bmultipl|乘",
    "add": r"(?i)[+＋]|\bplus\b|\badd|\bsum\b|加",
    "sub": r"(?i)[0-9)]\s*[-−－]\s*[0-9(]|\s[-−－]\s|\bminus\b|\bsubtract|减",
}


def reasoning_reward_expr(completion: pl.Expr, operation: pl.Expr) -> pl.Expr:
    """Reasoning reward as an expression: null where ``operation`` is null."""
    think = completion.str.extract(THINK_RE, 1)
    out = pl.when(operation.is_null()).then(None)
    for op, pat in OPERATION_PATTERNS.items():
        out = out.when(operation == op).then(think.str.contains(pat).fill_null(False).cast(pl.Float64))
    return out.otherwise(None)


@register_rule("reasoning")
def reasoning_rule(df: pl.DataFrame, **_: object) -> tuple[pl.Series, pl.Series]:
    """Reasoning reward (module docstring); all null without an ``operation`` column."""
    if "operation" not in df.columns:
        return pl.Series("value", [None] * df.height, dtype=pl.Float64), _no_errors(df.height)
    bad = df.filter(pl.col("operation").is_not_null() & ~pl.col("operation").is_in(list(OPERATION_PATTERNS)))
    if bad.height:
        row = bad.row(0, named=True)
        msg = (
            f"column 'operation' has unknown value {row['operation']!r} at prompt_id={row.get('prompt_id')!r} "
            f"sample_idx={row.get('sample_idx')!r} ({bad.height} rows); valid: {list(OPERATION_PATTERNS)} or null"
        )
        raise ValueError(msg)
    v = df.select(value=reasoning_reward_expr(pl.col("completion"), pl.col("operation")))
    return v["value"], _no_errors(df.height)
