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

import functools
import math
import re
import threading
from collections.abc import Callable

import polars as pl

from grpo_pipeline.rewards.parse import (
    CHAR_MAP,
    extract_answer,
    normalize_series,
    number_fields,
    numbers_match,
    numbers_match_expr,
    parse_number,
)

__all__ = [
    "OPERATION_PATTERNS",
    "REWARD_RULES",
    "accuracy_fast",
    "accuracy_rule",
    "format_reward",
    "format_rule",
    "get_rule",
    "math_verify_match",
    "reasoning_reward_expr",
    "reasoning_rule",
    "register_rule",
    "think_content",
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


def _ref_fields(answer: pl.Series) -> pl.DataFrame:
    """Normalised reference text and number fields, computed once per distinct answer
    (a group's G rows share one): ``rn``, ``r_value``, ``r_decimals`` aligned with ``answer``."""
    uniq = answer.unique()
    rn = normalize_series(uniq)
    table = pl.DataFrame({"answer": uniq, "rn": rn}).hstack(number_fields(rn).rename(lambda c: f"r_{c}"))
    return pl.DataFrame({"answer": answer}).join(table, on="answer", how="left", maintain_order="left")


def accuracy_fast(df: pl.DataFrame, *, rel_tol: float) -> pl.DataFrame:
    """Fast-path accuracy: column ``acc`` 1.0 / 0.0, or null where it cannot decide
    (-> math-verify), with ``pred`` (the answer text, null without a valid block)
    and ``answer``.

    Decided: no valid answer block (0); equal normalised text, case-folded (1);
    both plain numbers (tolerance rule); a prediction without digits or LaTeX
    against a plain-number reference, or two texts without either (0).
    """
    pred = extract_answer(df["completion"]).alias("pred")
    pn = normalize_series(pred).alias("pn")
    frame = pl.concat(
        [pl.DataFrame([pred, pn]), number_fields(pn).rename(lambda c: f"p_{c}"), _ref_fields(df["answer"])],
        how="horizontal",
    )
    pn, rn, pv, rv = pl.col("pn"), pl.col("rn"), pl.col("p_value"), pl.col("r_value")
    acc = (
        pl.when(pn.is_null()).then(0.0)
        .when(pn.str.to_lowercase() == rn.str.to_lowercase()).then(1.0)
        .when(pv.is_not_null() & rv.is_not_null())
        .then(numbers_match_expr(pv, rv, pl.col("r_decimals"), rel_tol=rel_tol).cast(pl.Float64))
        .when(~pn.str.contains(_HAS_MATH) & (rv.is_not_null() | ~rn.str.contains(_HAS_MATH))).then(0.0)
        .otherwise(None)
    )
    return frame.select(acc=acc, pred="pred", answer="answer")


def _mv_float(x: object) -> float | None:
    """A math-verify (sympy) result as a real float, or None."""
    if not getattr(x, "is_number", False):
        return None
    try:
        v = complex(x.evalf())  # type: ignore[attr-defined]
    except (TypeError, ValueError, AttributeError):
        return None
    return v.real if v.imag == 0 and math.isfinite(v.real) else None


_STRUCTURE = re.compile(r"[\\^{}()\[\]<>=,]|[A-Za-z][0-9]|[0-9][A-Za-z]")
_WORD = re.compile(r"(?<![\\A-Za-z])[A-Za-z]{3,}")


def _mv_text(s: str) -> str:
    """Full-width to ASCII, ``≤ ≥ ≠`` to LaTeX; math without ``$`` wrapped in ``$…$`` so that
    math-verify parses it as a whole (a tuple, interval, set, relation, ``2x``) instead of taking
    its last number: text with LaTeX, brackets, relations, commas or a letter glued to a digit, or
    without any word of three letters."""
    s = "".join(CHAR_MAP.get(ch, ch) for ch in s).strip()
    s = s.replace("≤", "\\le ").replace("≥", "\\ge ").replace("≠", "\\neq ")
    if "$" in s:
        return s
    return f"${s}$" if _STRUCTURE.search(s) or not _WORD.search(s) else s


@functools.lru_cache(maxsize=65536)
def math_verify_match(pred: str, ref: str, *, rel_tol: float) -> bool:
    """Slow path: math-verify, with the tolerance rule applied when both sides
    evaluate to real numbers (so ``\\sqrt{2.79}`` matches ``1.67``); memoised, as a
    group's completions often repeat an answer.

    math-verify's signal-based timeouts only work in the main thread; elsewhere
    they are off.
    """
    from math_verify import parse, verify

    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    gold = parse(_mv_text(ref), parsing_timeout=timeout)
    target = parse(_mv_text(pred), parsing_timeout=timeout)
    if not gold or not target:
        return False
    gv, tv = _mv_float(gold[0]), _mv_float(target[0])
    if gv is not None and tv is not None:  # two real numbers: the tolerance rule decides
        ref_num = parse_number(ref)
        decimals = ref_num.decimals if ref_num else (0 if gv == int(gv) and "." not in ref else None)
        return numbers_match(tv, gv, decimals, rel_tol=rel_tol)
    return bool(verify(gold, target, timeout_seconds=timeout))


@register_rule("accuracy")
def accuracy_rule(df: pl.DataFrame, *, rel_tol: float, **_: object) -> tuple[pl.Series, pl.Series]:
    """Accuracy reward (module docstring): fast path, then math-verify row by row."""
    frame = accuracy_fast(df, rel_tol=rel_tol)
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
def format_reward(completion: pl.Series, *, partial_credit: bool = False) -> pl.Series:
    """(N,) Float64 format reward (module docstring for the items)."""
    c = pl.col("c")
    counts = {f"n_{t}": c.str.count_matches(t, literal=True) for t in ("<think>", "</think>", "<answer>", "</answer>")}
    order = {f"at_{t}": c.str.find(t, literal=True) for t in ("<think>", "</think>", "<answer>", "</answer>")}
    f = pl.DataFrame({"c": completion}).with_columns(
        **counts, **order,
        starts=c.str.strip_chars_start().str.starts_with("<think>"),
        ends=c.str.strip_chars_end().str.ends_with("</answer>"),
        joined=c.str.contains(r"</think>\s*<answer>"),
    )
    n, at = pl.col, lambda t: pl.col(f"at_{t}")
    think = (n("n_<think>") == 1) & (n("n_</think>") == 1) & (at("<think>") < at("</think>"))
    answer = (n("n_<answer>") == 1) & (n("n_</answer>") == 1) & (at("<answer>") < at("</answer>"))
    order_ok = n("starts") & n("joined")
    items = [think, answer, order_ok, n("ends")]
    if partial_credit:
        value = pl.sum_horizontal([x.fill_null(False).cast(pl.Float64) for x in items]) * 0.25
    else:
        value = pl.all_horizontal(items).fill_null(False).cast(pl.Float64)
    return f.select(value=value).to_series()


@register_rule("format")
def format_rule(df: pl.DataFrame, *, format_partial_credit: bool = False, **_: object) -> tuple[pl.Series, pl.Series]:
    """Format reward (module docstring)."""
    return format_reward(df["completion"], partial_credit=format_partial_credit), _no_errors(df.height)


# ------------------------------------------------------------------ reasoning
def think_content(completion: pl.Expr) -> pl.Expr:
    """The ``<think>`` content: after the first ``<think>``, up to the next
    ``</think>`` or to the end when unclosed; null without ``<think>``."""
    after = completion.str.splitn("<think>", 2).struct.field("field_1")
    return after.str.splitn("</think>", 2).struct.field("field_0")

#: What "shows the operation" means, case-insensitive, per ``operation`` value.
OPERATION_PATTERNS: dict[str, str] = {
    "div": r"[/／÷]|(?i:(?-u:\b)divi(?:d|sion))|除",
    "mul": r"[*＊×]|[0-9]\s*[xX]\s*[0-9]|(?i:(?-u:\b)(?:times|multipl))|乘",
    "add": r"[+＋]|(?i:(?-u:\b)(?:plus|add|sum(?-u:\b)))|加",
    "sub": r"[0-9)]\s*[-−－]\s*[0-9(]|\s[-−－]\s|(?i:(?-u:\b)(?:minus|subtract))|减",
}
# ``(?-u:\b)``: ASCII word boundary, which keeps polars' regex on its fast DFA engine.


def reasoning_reward_expr(think: pl.Expr, operation: pl.Expr) -> pl.Expr:
    """Reasoning reward from the ``<think>`` content (null: no think block) and
    the operation; null where ``operation`` is null.  Pass column references:
    ``think`` is used once per operation."""
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
    v = (
        df.lazy()
        .select(think=think_content(pl.col("completion")), operation="operation")
        .select(value=reasoning_reward_expr(pl.col("think"), pl.col("operation")))
        .collect()
    )
    return v["value"], _no_errors(df.height)
