"""Answer and number parsing, vectorised (polars expressions) with a per-row twin.

The accuracy reward's fast path lives here.  Both sides of a comparison (the text
inside ``<answer>…</answer>`` and the reference) go through the same steps:

1. :func:`normalize_series` – full-width digits and punctuation to ASCII
   (``１２`` -> ``12``, ``，`` -> ``,``, ``。`` -> space, ``÷`` -> ``/``, ``−`` -> ``-``),
   and light LaTeX: ``\\frac{5}{3}`` / ``\\dfrac`` / ``\\tfrac`` of plain numbers -> ``5/3``;
   the wrappers ``\\boxed{…}``, ``\\text{…}``, ``\\mathrm{…}``, ``\\mbox{…}``, ``\\fbox{…}``
   dropped; ``\\$``, ``\\%``, ``\\,``, ``\\!``, ``\\;``, ``{,}``, ``\\approx`` simplified.
2. :data:`PLAIN_NUMBER_RE` – the whole string is *one* number (optionally a
   fraction ``a/b``) with a sign, a currency sign (``$ ¥ € £``), thousands
   separators (``1,234``), and any prefix / suffix made of words, units and
   punctuation (``约``, ``about``, ``≈``, ``x =``, ``元``, ``yuan``, ``pencils``,
   ``元/支``, ``%``).  Prefix and suffix may not hold digits nor the characters
   ``\\ { } ^ _ ( ) [ ] √ π + - * < > ≤ ≥ ≠`` (and the prefix no ``/``): those mean an
   expression or a relation, left to math-verify.  A letter glued to the number
   ("2x", "v2", "AZYUK2A") makes it an expression too, except the unit words of
   :data:`UNITS` ("5kg", "3rd"); a length unit's power is dropped first ("1234 m^2").

Tolerance rule (:func:`numbers_match_expr`), with ``p`` the prediction and ``r``
the reference:

- an integer ``r`` (written without decimals, not a fraction) matches only an equal
  ``p`` ("12.0" matches "12"; "1000001" does not match "1000000": no tolerance);
- otherwise ``p`` matches ``r`` when ``|p - r| <= rel_tol * max(|p|, |r|)``, or
- when ``r`` is written with ``d >= 1`` decimals (``"1.67"``: d = 2) and ``p``
  rounded to ``d`` decimals (ties away from zero) equals ``r``: "5/3", "1.667",
  "1.670" match "1.67"; "1.7" and "1.675" do not.  Fraction references use
  ``rel_tol`` only.

Float noise at the rounding boundary is absorbed by ``1e-6`` of the half unit.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import polars as pl

__all__ = [
    "PLAIN_NUMBER_RE",
    "ParsedNumber",
    "extract_answer",
    "normalize_series",
    "normalize_text",
    "number_fields",
    "numbers_match",
    "numbers_match_expr",
    "parse_number",
]

# ------------------------------------------------------------------ normalisation
# Character-for-character replacements (each keeps one character -> one character,
# so they are safe on text whose char offsets matter, see steps.py).
_FULLWIDTH = {chr(0xFF10 + i): str(i) for i in range(10)}
CHAR_MAP: dict[str, str] = {
    **_FULLWIDTH,
    "．": ".", "，": ",", "：": ":", "；": ";", "－": "-", "−": "-", "–": "-", "＋": "+",
    "／": "/", "÷": "/", "＄": "$", "￥": "¥", "％": "%", "（": "(", "）": ")", "＝": "=",
    "　": " ", "。": " ", "＊": "*", "﹣": "-",
}
_FROM = list(CHAR_MAP)
_TO = [CHAR_MAP[k] for k in _FROM]

_NUM_ARG = r"\s*(-?[0-9][0-9,]*(?:\.[0-9]+)?)\s*"
# (pattern, polars replacement, python replacement)
_LATEX_RULES: list[tuple[str, str, str]] = [
    (r"\\[dt]?frac\{" + _NUM_ARG + r"\}\{" + _NUM_ARG + r"\}", "${1}/${2}", r"\1/\2"),
    (r"\\(?:boxed|text|textbf|textrm|mathrm|mbox|fbox)\s*\{", "", ""),
    (r"\\(?:left|right)\b", "", ""),
    (r"\\approx", "≈", "≈"),
    (r"\\([$%])", "${1}", r"\1"),
    (r"\\[,;!: ]", "", ""),
    (r"\{,\}", ",", ","),
]
_LATEX_RULES_PY = [(re.compile(p), py) for p, _, py in _LATEX_RULES]


def normalize_series(s: pl.Series) -> pl.Series:
    """Normalise answer text (module docstring, step 1), vectorised.  The LaTeX
    rules run only on the rows holding ``\\`` or ``{``; braces are dropped only when
    no backslash command is left, so ``\\sqrt{2}`` stays unparseable."""
    s = s.str.replace_many(_FROM, _TO)
    power = s.str.contains(r"[\^²³]").arg_true()
    if len(power):
        s = s.scatter(power, s.gather(power).str.replace_all(UNIT_POWER_RE, "${1}"))
    idx = s.str.contains(r"[\\{]").arg_true()
    if len(idx):
        sub = s.gather(idx)
        for pat, repl, _ in _LATEX_RULES:
            sub = sub.str.replace_all(pat, repl)
        sub = pl.select(
            pl.when(pl.lit(sub).str.contains("\\", literal=True)).then(pl.lit(sub))
            .otherwise(pl.lit(sub).str.replace_all(r"[{}]", ""))
        ).to_series()
        s = s.scatter(idx, sub)
    return s.str.strip_chars()


def normalize_text(s: str) -> str:
    """Per-row twin of :func:`normalize_series`."""
    s = "".join(CHAR_MAP.get(ch, ch) for ch in s)
    s = _UNIT_POWER_PY.sub(r"\1", s)
    for pat, repl in _LATEX_RULES_PY:
        s = pat.sub(repl, s)
    if "\\" not in s:
        s = s.replace("{", "").replace("}", "")
    return s.strip()


# ------------------------------------------------------------------ plain numbers
_INT = r"(?:[0-9]{1,3}(?:,[0-9]{3})+|[0-9]+)"
_NUM = rf"(?:{_INT}(?:\.[0-9]+)?|\.[0-9]+)"
_BAD = r"0-9\\{}^_()\[\]√π+\-*<>≤≥≠"
#: Unit words that may be glued to a number ("5kg", "3rd"); any other letter glued to it
#: ("2x", "v2", "5k") makes the text not a plain number.
UNITS = ("kg|mg|km|cm|mm|ml|mL|g|L|h|hr|hrs|min|mins|sec|secs|lb|lbs|oz|ft|mph|kph|st|nd|rd|th")
#: One number in the whole string; groups ``sign``, ``num``, ``den`` (same syntax in
#: Python ``re`` and polars' Rust regex).  No letter right before the number (a currency code
#: before ``$``: ``US$12``), no letter right after it but a unit of :data:`UNITS`.
PLAIN_NUMBER_RE = (
    rf"^(?:[^{_BAD}/]*?[^{_BAD}/A-Za-z])?(?P<sign>[-+]?)\s*(?:[A-Z]{{0,3}}[$¥€£])?\s*(?P<num>{_NUM})"
    rf"(?:\s*/\s*(?P<den>{_NUM}))?(?:(?:{UNITS})(?:[^{_BAD}A-Za-z][^{_BAD}]*)?|[^{_BAD}A-Za-z][^{_BAD}]*)?$"
)
#: A length unit's square or cube ("m^2", "cm²"): the power is dropped, so "1234 m^2" reads as 1234.
UNIT_POWER_RE = r"(?-u:\b)((?:m|cm|mm|km|dm|ft|in|yd|mi)\s*)(?:\^\s*\{?\s*[23]\s*\}?|[²³])"
_UNIT_POWER_PY = re.compile(UNIT_POWER_RE.replace("(?-u:\\b)", "\\b"), re.ASCII)
_PLAIN_PY = re.compile(PLAIN_NUMBER_RE, re.DOTALL)


@dataclass(frozen=True)
class ParsedNumber:
    """A plain number: its value and its decimals (None for a fraction)."""

    value: float
    decimals: int | None


_SIMPLE_RE = r"^[0-9]+(?:\.[0-9]+)?$"


def number_fields(norm: pl.Series) -> pl.DataFrame:
    """``value`` (Float64) and ``decimals`` (Int32) of normalised text: value null
    when the text is not one plain number (or a fraction with a zero denominator),
    decimals null for fractions.  Bare decimals (the common case) skip the regex."""
    simple = norm.str.contains(_SIMPLE_RE).fill_null(False)
    dot = norm.str.find(".", literal=True)
    out = pl.DataFrame({"n": norm, "simple": simple, "dot": dot}).select(
        value=pl.when("simple").then(pl.col("n").cast(pl.Float64, strict=False)),
        decimals=pl.when("simple").then(
            pl.when(pl.col("dot").is_null()).then(0).otherwise(pl.col("n").str.len_bytes() - pl.col("dot") - 1)
        ).cast(pl.Int32),
    )
    idx = (~simple & norm.is_not_null()).arg_true()
    if not len(idx):
        return out
    g = norm.gather(idx).str.extract_groups(PLAIN_NUMBER_RE).struct.unnest()
    num, den = pl.col("num"), pl.col("den")
    clean = lambda e: e.str.replace_all(",", "", literal=True).cast(pl.Float64, strict=False)
    hard = g.select(
        value=pl.when(den.is_null()).then(clean(num)).otherwise(clean(num) / clean(den))
        * pl.when(pl.col("sign") == "-").then(-1.0).otherwise(1.0),
        decimals=pl.when(den.is_null() & num.is_not_null())
        .then(num.str.extract(r"\.([0-9]+)$", 1).str.len_chars().fill_null(0))
        .cast(pl.Int32),
    ).with_columns(value=pl.when(pl.col("value").is_finite()).then("value"))
    return out.with_columns(
        value=out["value"].scatter(idx, hard["value"]), decimals=out["decimals"].scatter(idx, hard["decimals"])
    )


def parse_number(text: str) -> ParsedNumber | None:
    """Per-row twin of :func:`number_fields` on ``normalize_text(text)``.

    >>> parse_number("约１.６７元")
    ParsedNumber(value=1.67, decimals=2)
    >>> parse_number("\\\\frac{5}{3}").decimals is None
    True
    """
    m = _PLAIN_PY.match(normalize_text(text))
    if m is None:
        return None
    num = float(m["num"].replace(",", ""))
    sign = -1.0 if m["sign"] == "-" else 1.0
    if m["den"] is None:
        frac = m["num"].rpartition(".")[2] if "." in m["num"] else ""
        return ParsedNumber(sign * num, len(frac))
    den = float(m["den"].replace(",", ""))
    if den == 0:
        return None
    return ParsedNumber(sign * num / den, None)


# ------------------------------------------------------------------ comparison
_TIE_SLACK = 1e-6  # share of the half unit that absorbs float noise at the boundary


def numbers_match_expr(pred: pl.Expr, ref: pl.Expr, decimals: pl.Expr, *, rel_tol: float) -> pl.Expr:
    """Boolean: ``pred`` matches ``ref`` by the tolerance rule (module docstring).

    Null where either value is null.  ``decimals`` is the reference's (null or 0:
    ``rel_tol`` only).
    """
    close = (pred - ref).abs() <= rel_tol * pl.max_horizontal(pred.abs(), ref.abs())
    half = 0.5 * pl.lit(10.0).pow(-decimals.cast(pl.Float64))
    s = pl.when(ref != 0).then(ref.sign()).when(pred != 0).then(pred.sign()).otherwise(1.0)
    pa, ra = pred * s, ref * s  # fold to ra >= 0: ties round away from zero
    eps = half * _TIE_SLACK
    rounded = (ra - half <= pa + eps) & (pa < ra + half - eps)
    use_round = decimals.fill_null(0) >= 1
    integer = decimals.fill_null(-1) == 0  # an integer reference: equal or wrong, no tolerance
    return (pred == ref) | (close & ~integer) | (use_round & rounded)


def numbers_match(pred: float, ref: float, decimals: int | None, *, rel_tol: float) -> bool:
    """Per-row twin of :func:`numbers_match_expr`."""
    if not (math.isfinite(pred) and math.isfinite(ref)):
        return False
    if pred == ref or (decimals != 0 and abs(pred - ref) <= rel_tol * max(abs(pred), abs(ref))):
        return True
    if not decimals:
        return False
    half = 0.5 * 10.0 ** (-decimals)
    s = math.copysign(1.0, ref) if ref != 0 else (math.copysign(1.0, pred) if pred != 0 else 1.0)
    pa, ra = pred * s, ref * s
    eps = half * _TIE_SLACK
    return ra - half <= pa + eps and pa < ra + half - eps


# ------------------------------------------------------------------ answer tags
def extract_answer(completion: pl.Series) -> pl.Series:
    """Text inside the one ``<answer>…</answer>`` block, stripped; null when the
    tags are missing, unbalanced, out of order or appear more than once."""
    c = pl.col("c")
    parts = pl.col("after").str.splitn("</answer>", 2)
    return (
        pl.DataFrame({"c": completion})
        .select(
            one=(c.str.count_matches("<answer>", literal=True) == 1)
            & (c.str.count_matches("</answer>", literal=True) == 1),
            after=c.str.splitn("<answer>", 2).struct.field("field_1"),
        )
        .select(
            pl.when(pl.col("one") & parts.struct.field("field_1").is_not_null())
            .then(parts.struct.field("field_0").str.strip_chars())
            .alias(completion.name)
        )
        .to_series()
    )
