"""Per-row Python twins of the vectorised accuracy and format rules.

Straightforward one-completion-at-a-time code, kept for two jobs: the oracle the
tests compare the vectorised rules against, and the baseline of
``bench/bench_score.py``.  Same semantics as :mod:`.rules`.
"""

from __future__ import annotations

import re

from grpo_pipeline.rewards.parse import normalize_text, numbers_match, parse_number
from grpo_pipeline.rewards.rules import math_verify_match

__all__ = ["accuracy_row", "format_row"]

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_STRICT = re.compile(r"\s*<think>.*</think>\s*<answer>.*</answer>\s*", re.DOTALL)
_HAS_MATH = re.compile(r"[0-9\\]")


def accuracy_row(completion: str, answer: str, *, rel_tol: float) -> float:
    """Accuracy of one completion (1.0 / 0.0)."""
    if completion.count("<answer>") != 1 or completion.count("</answer>") != 1:
        return 0.0
    m = _ANSWER.search(completion)
    if m is None:
        return 0.0
    pred = m[1].strip()
    pn, rn = normalize_text(pred), normalize_text(answer)
    if pn.lower() == rn.lower():
        return 1.0
    p, r = parse_number(pred), parse_number(answer)
    if p is not None and r is not None:
        return float(numbers_match(p.value, r.value, r.decimals, rel_tol=rel_tol))
    if not _HAS_MATH.search(pn) and (r is not None or not _HAS_MATH.search(rn)):
        return 0.0
    return float(math_verify_match(pred, answer, rel_tol=rel_tol))


def _one(c: str, tag: str) -> bool:
    i, j = c.find(f"<{tag}>"), c.find(f"</{tag}>")
    return c.count(f"<{tag}>") == 1 and c.count(f"</{tag}>") == 1 and i < j


def format_row(completion: str, *, partial_credit: bool = False) -> float:
    """Format reward of one completion."""
    c = completion
    think, answer = _one(c, "think"), _one(c, "answer")
    if not partial_credit:
        return float(think and answer and _STRICT.fullmatch(c) is not None)
    order = c.lstrip().startswith("<think>") and re.search(r"</think>\s*<answer>", c) is not None
    trailing = c.rstrip().endswith("</answer>")
    return 0.25 * (think + answer + order + trailing)
