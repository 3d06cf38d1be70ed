"""Reasoning steps for process supervision: splitting and step scorers.

Splitting (:func:`split_steps`, vectorised): the ``<think>`` content (up to the
first ``</think>``, or the end when unclosed) is cut into steps, each stripped of
surrounding whitespace, empty ones dropped; each step keeps its span
``[start, end)`` in **characters** of the completion (Python ``str`` indices, so
``completion[start:end]`` is the step text, for Chinese too).

- ``"lines"``: one step per non-empty line.
- ``"sentences"``: split after ``. ! ? 。 ！ ？`` and newlines; a ``.`` followed by a
  digit does not end a sentence (``1.67`` stays whole).

The final answer is a step too (:func:`with_answer_step`, added by the score stage when a step
scorer is set): from ``<answer>`` to the completion's end, its reward the accuracy reward.

Step scorers, registered by name in :data:`STEP_SCORERS`, work on the exploded
steps frame (columns ``row``, ``text``) and return one Float64 per step::

    scorer(steps: pl.DataFrame) -> pl.Series          # (S,) reward per step, null allowed

A plugged-in scorer ``reward.step_scorer: "module:function"`` (e.g. a process reward
model) takes lists instead::

    fn(steps: list[list[str]], *, completions: list[str], answers: list[str], **columns)
        -> list[list[float | None]]                   # same shape as ``steps``

with ``columns`` as for custom rewards (``prompt_id``, ``question``, ...).  Rows on
which it fails (after a per-row retry, see :mod:`.custom`) get null step rewards
and a ``"steps: ..."`` error.

``"arithmetic"`` checks every claim ``a op b = c`` (op one of ``+ - * / × ÷ x``, ``=``
or ``≈``; numbers may carry a sign, ``$``/``¥``, thousands separators and up to
three Chinese unit characters, e.g. ``5元÷3支=1.67元``; ``c`` may be a fraction ``5/6``,
then checked exactly).  Chains ``a + b × c = d``
are evaluated with the usual precedence; parenthesised expressions are not
claims.  A claim is right when ``c`` equals the computed value rounded to ``c``'s
decimals (``5/3 = 1.67`` right, ``5/3 = 1.6`` wrong; ``c`` followed by ``...`` may
also be truncated), and exactly (1e-9 relative) when ``c`` is an integer.  Step
reward: 1.0 when every claim is right, 0.0 when one is wrong, **null when the step
has no claim** (nothing to check: left out of the advantage stage's normalisation).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import numpy as np
import polars as pl
import pyarrow as pa

from grpo_pipeline.rewards.custom import batch_columns, call_with_fallback, load_function, take, to_reward_value
from grpo_pipeline.rewards.parse import CHAR_MAP, numbers_match_expr
from grpo_pipeline.rewards.rules import think_content

__all__ = [
    "STEP_SCORERS",
    "STEP_SPLITS",
    "arithmetic_step_rewards",
    "arithmetic_step_scorer",
    "assemble_steps",
    "get_step_scorer",
    "register_step_scorer",
    "score_steps",
    "split_steps",
    "with_answer_step",
]

STEP_STRUCT = pl.Struct({"start": pl.Int32, "end": pl.Int32, "reward": pl.Float64})
_SEP = "\x00"  # inserted after each step end; a NUL already in the text becomes \x01 (same length)
_SENTENCE_END = r"(\.+)([^0-9.。！？!?]|$)|([。！？!?\n]+)"
STEP_SPLITS = ("lines", "sentences")


# ------------------------------------------------------------------ splitting
def split_steps(completion: pl.Series, *, mode: str) -> pl.DataFrame:
    """Exploded steps of every completion: ``row`` (UInt32), ``start``, ``end``
    (Int32 char offsets in the completion, end exclusive), ``text`` (Utf8)."""
    if mode not in STEP_SPLITS:
        msg = f"Unknown step split {mode!r}. Supported: {list(STEP_SPLITS)}"
        raise ValueError(msg)
    c = pl.col("completion")
    content = think_content(c).str.replace_all(_SEP, "\x01", literal=True)
    if mode == "lines":
        marked = content.str.replace_all("\n", "\n" + _SEP, literal=True)
    else:
        marked = content.str.replace_all(_SENTENCE_END, "${1}${3}" + _SEP + "${2}")
    piece = pl.col("piece")
    return (
        pl.DataFrame({"completion": completion})
        .with_row_index("row")
        .select(
            "row",
            base=(c.str.splitn("<think>", 2).struct.field("field_0").str.len_chars() + len("<think>")).cast(pl.Int32),
            piece=marked.str.split(_SEP),
        )
        .with_columns(rel_end=piece.list.eval(pl.element().str.len_chars().cast(pl.Int32).cum_sum()))
        .explode("piece", "rel_end")
        .drop_nulls("piece")
        .select(
            "row",
            start=pl.col("base") + pl.col("rel_end") - piece.str.len_chars().cast(pl.Int32)
            + (piece.str.len_chars() - piece.str.strip_chars_start().str.len_chars()).cast(pl.Int32),
            text=piece.str.strip_chars(),
        )
        .filter(pl.col("text").str.len_chars() > 0)
        .select("row", "start", end=pl.col("start") + pl.col("text").str.len_chars().cast(pl.Int32), text="text")
    )


def assemble_steps(n: int, steps: pl.DataFrame, rewards: pl.Series) -> pl.Series:
    """``List(Struct{start, end, reward})`` per completion from the exploded,
    row-ordered ``steps`` and their ``rewards``; empty lists where no steps."""
    counts = np.bincount(steps["row"].to_numpy(), minlength=n) if steps.height else np.zeros(n, dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    structs = pa.StructArray.from_arrays(
        [steps["start"].to_arrow(), steps["end"].to_arrow(), rewards.cast(pl.Float64).to_arrow()],
        names=["start", "end", "reward"],
    )
    lists = pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), structs)
    return pl.Series("steps", lists).cast(pl.List(STEP_STRUCT))


def with_answer_step(steps: pl.Series, completion: pl.Series, reward: pl.Series) -> pl.Series:
    """Append the final answer to each row's steps: span ``[start of "<answer>" (or the end), end of the
    completion)``, ``reward`` its reward (the accuracy reward; null stays null). Its end is the
    completion's end, so under process supervision every token gets its normalised reward: a right
    answer earns advantage."""
    c = pl.col("completion")
    answer = pl.DataFrame({"steps": steps, "completion": completion, "r": reward.cast(pl.Float64)}).select(
        pl.concat_list(pl.col("steps"), pl.struct(
            start=c.str.splitn("<answer>", 2).struct.field("field_0").str.len_chars().cast(pl.Int32),
            end=c.str.len_chars().cast(pl.Int32), reward=pl.col("r"))).alias("steps"))
    return answer["steps"].cast(pl.List(STEP_STRUCT))


# ------------------------------------------------------------------ scorers
StepScorer = Callable[[pl.DataFrame], pl.Series]
STEP_SCORERS: dict[str, StepScorer] = {}


def register_step_scorer(name: str) -> Callable[[StepScorer], StepScorer]:
    """Register a frame-level step scorer under ``name``."""

    def deco(fn: StepScorer) -> StepScorer:
        STEP_SCORERS[name] = fn
        return fn

    return deco


_NUM = r"-?(?:[0-9]{1,3}(?:,[0-9]{3})+|[0-9]+)(?:\.[0-9]+)?"
_OP = r"[-+*/×÷xX]"
_OPERAND = rf"[$¥]?\s*{_NUM}\s*[\u4e00-\u9fff]{{0,3}}"
_EQ = r"\s*[=≈]\s*[$¥]?\s*"
_ELLIPSIS = r"(?:\.\.\.|…)"
_FRACTION = rf"(?:\s*/\s*{_NUM})?"  # a result written as a fraction, 5/6
CLAIM_RE = rf"{_OPERAND}(?:\s*{_OP}\s*{_OPERAND})+{_EQ}{_NUM}{_FRACTION}{_ELLIPSIS}?"
_LHS_RE = r"^([^=≈]*)[=≈]"
_RHS_RE = rf"[=≈]\s*[$¥]?\s*(?P<c>{_NUM})(?:\s*/\s*(?P<d>{_NUM}))?(?P<ell>{_ELLIPSIS})?$"
_SINGLE_RE = (  # the common `a op b` left-hand side, checked without Python
    rf"^[$¥]?\s*(?P<a>{_NUM})\s*[\u4e00-\u9fff]{{0,3}}\s*(?P<op>{_OP})\s*[$¥]?\s*(?P<b>{_NUM})"
    rf"\s*[\u4e00-\u9fff]{{0,3}}\s*$"
)
_OPERAND_PY = re.compile(rf"\s*[$¥]?\s*({_NUM})\s*[\u4e00-\u9fff]{{0,3}}\s*")
_OP_PY = re.compile(_OP)
_FROM, _TO = list(CHAR_MAP), [CHAR_MAP[k] for k in CHAR_MAP]
_MUL, _DIV = set("*×xX"), set("/÷")


def _num(e: pl.Expr) -> pl.Expr:
    return e.str.replace_all(",", "", literal=True).cast(pl.Float64, strict=False)


def _eval_chain(lhs: str) -> float | None:
    """``a op b op c ...`` with * and / before + and -; None when not parseable."""
    nums: list[float] = []
    ops: list[str] = []
    pos = 0
    while True:
        m = _OPERAND_PY.match(lhs, pos)
        if m is None:
            return None
        nums.append(float(m[1].replace(",", "")))
        pos = m.end()
        if pos == len(lhs):
            break
        o = _OP_PY.match(lhs, pos)
        if o is None:
            return None
        ops.append(o[0])
        pos = o.end()
    if not ops:
        return None
    terms, signs = [nums[0]], [1.0]
    for op, x in zip(ops, nums[1:], strict=True):
        if op in _MUL:
            terms[-1] *= x
        elif op in _DIV:
            terms[-1] = terms[-1] / x if x != 0 else float("inf")
        else:
            terms.append(x)
            signs.append(1.0 if op == "+" else -1.0)
    return sum(s * t for s, t in zip(signs, terms, strict=True))


def _claim_checks(claims: pl.DataFrame) -> pl.Series:
    """(K,) Boolean per claim (column ``claim``)."""
    parts = (
        claims.select(lhs=pl.col("claim").str.extract(_LHS_RE, 1), rhs=pl.col("claim").str.extract_groups(_RHS_RE))
        .with_columns(single=pl.col("lhs").str.extract_groups(_SINGLE_RE))
        .unnest("rhs", "single")
    )
    a, b, op = _num(pl.col("a")), _num(pl.col("b")), pl.col("op")
    value = (
        pl.when(op == "+").then(a + b).when(op == "-").then(a - b)
        .when(op.is_in(list(_MUL))).then(a * b)
        .when(op.is_in(list(_DIV))).then(pl.when(b != 0).then(a / b).otherwise(float("inf")))
    )
    parts = parts.with_columns(value=value)
    chains = parts["value"].is_null()
    if chains.any():  # rare: evaluate `a op b op c = d` per claim in Python
        vals = parts["value"].to_list()
        for i in chains.arg_true().to_list():
            vals[i] = _eval_chain(parts["lhs"][i] or "")
        parts = parts.with_columns(value=pl.Series(vals, dtype=pl.Float64))
    frac = pl.col("d").is_not_null()  # a fraction: rel_tol (decimals null); an integer: exact
    parts = parts.with_columns(
        c=pl.when(frac).then(_num(pl.col("c")) / _num(pl.col("d"))).otherwise(_num(pl.col("c"))),
        dec=pl.when(frac).then(None).otherwise(pl.col("c").str.extract(r"\.([0-9]+)$", 1).str.len_chars().fill_null(0))
        .cast(pl.Int32),
    )
    v, c, dec = pl.col("value"), pl.col("c"), pl.col("dec")
    truncated = pl.col("ell").is_not_null() & ((v - c).abs() < pl.lit(10.0).pow(-dec.fill_null(0).cast(pl.Float64)))
    ok = numbers_match_expr(v, c, dec, rel_tol=1e-9) | truncated
    return parts.select(ok=pl.when(v.is_finite() & c.is_finite()).then(ok).otherwise(False).fill_null(False))["ok"]


@register_step_scorer("arithmetic")
def arithmetic_step_rewards(steps: pl.DataFrame) -> pl.Series:
    """(S,) 1.0 / 0.0 / null per step: all claims right / one wrong / no claim."""
    s = steps.height
    texts = steps.select(t=pl.col("text").str.replace_many(_FROM, _TO))["t"]
    found = pl.DataFrame({"claim": texts.str.extract_all(CLAIM_RE)}).with_row_index("step")
    claims = found.explode("claim").drop_nulls("claim")
    n_claims = np.bincount(claims["step"].to_numpy(), minlength=s) if claims.height else np.zeros(s)
    if claims.height:
        wrong = ~_claim_checks(claims).to_numpy()
        n_wrong = np.bincount(claims["step"].to_numpy(), weights=wrong, minlength=s)
    else:
        n_wrong = np.zeros(s)
    reward = np.where(n_claims == 0, np.nan, (n_wrong == 0).astype(np.float64))
    return pl.Series("reward", reward, dtype=pl.Float64, nan_to_null=True)


def arithmetic_step_scorer(steps: list[list[str]], **_: Any) -> list[list[float | None]]:
    """List interface of the ``"arithmetic"`` scorer (same shape as ``steps``)."""
    counts = [len(s) for s in steps]
    flat = pl.DataFrame({"text": [t for s in steps for t in s]}, schema={"text": pl.Utf8})
    rewards = arithmetic_step_rewards(flat).to_list()
    out, k = [], 0
    for n in counts:
        out.append(rewards[k : k + n])
        k += n
    return out


def get_step_scorer(name: str) -> StepScorer | Callable[..., Any]:
    """A registered scorer, or the function behind ``"module:function"``."""
    if ":" in name:
        return load_function(name, what=f"reward.step_scorer {name!r}")
    if name not in STEP_SCORERS:
        msg = f"Unknown step scorer {name!r}. Supported scorers are: {list(STEP_SCORERS)} or 'module:function'"
        raise ValueError(msg)
    return STEP_SCORERS[name]


def _plugged_rewards(fn: Callable[..., Any], steps: pl.DataFrame, df: pl.DataFrame) -> tuple[pl.Series, list[str | None]]:
    counts = np.bincount(steps["row"].to_numpy(), minlength=df.height).tolist() if steps.height else [0] * df.height
    flat, per_row, k = steps["text"].to_list(), [], 0
    for n in counts:
        per_row.append(flat[k : k + n])
        k += n
    columns = batch_columns(df)

    def call(rows: list[int] | None) -> Any:
        kw = take(columns, rows)
        return fn([per_row[i] for i in rows] if rows is not None else per_row, **kw)

    def convert(item: Any, i: int) -> list[float | None]:
        if len(item) != counts[i]:
            msg = f"returned {len(item)} step rewards for {counts[i]} steps"
            raise ValueError(msg)
        return [to_reward_value(v) for v in item]

    values, errors = call_with_fallback("steps", df.height, call, convert)
    flat_rewards = [v for i, row in enumerate(values) for v in (row if row is not None else [None] * counts[i])]
    return pl.Series("reward", flat_rewards, dtype=pl.Float64), errors


def score_steps(df: pl.DataFrame, *, split: str, scorer: str | None) -> tuple[pl.Series, list[str | None]]:
    """``(steps column, per-row errors)`` for ``df`` (``completion``, ``answer``, ...)."""
    n = df.height
    if scorer is None:
        empty = pl.DataFrame(schema={"row": pl.UInt32, "start": pl.Int32, "end": pl.Int32})
        return assemble_steps(n, empty, pl.Series([], dtype=pl.Float64)), [None] * n
    fn = get_step_scorer(scorer)
    steps = split_steps(df["completion"], mode=split)
    if ":" in scorer:
        rewards, errors = _plugged_rewards(fn, steps, df)
    else:
        rewards, errors = fn(steps), [None] * n
        if len(rewards) != steps.height:
            msg = f"step scorer {scorer!r} returned {len(rewards)} rewards for {steps.height} steps"
            raise ValueError(msg)
    return assemble_steps(n, steps, rewards), errors
