"""What kind of mistake each wrong evaluation answer is, per checkpoint, and how they move between two.

For math prompts whose eval rows carry a worked reference ``solution`` (the synthetic task; a file with
``solution_field``), each greedy completion of ``data/eval/<name>.parquet`` is put in one class:

- ``right``: the accuracy reward is 1;
- ``fewer_steps`` / ``more_steps``: it makes fewer / more arithmetic claims (``a op b = c``) than the
  reference (a two-step problem answered in one step, a third addition invented);
- ``arithmetic``: as many claims as the reference, one of them false (``20 - 11 = 11``);
- ``other``: as many claims, all true, and still a wrong answer (a wrong operand or operation).

Claims are found and checked by the ``arithmetic`` step scorer of process supervision, so "false" means
what it means there. Run from a finished pipeline directory (or ``--repo``)::

    python bench/eval_errors.py --repo . sft it7

prints the class counts of every named evaluation and, for the first and last, the paired transitions
(how many of SFT's arithmetic slips the final checkpoint gets right, and so on).
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import Counter
from pathlib import Path

import polars as pl

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from grpo_pipeline.rewards.parse import CHAR_MAP
from grpo_pipeline.rewards.steps import CLAIM_RE, arithmetic_step_scorer

CLASSES = ("right", "fewer_steps", "more_steps", "arithmetic", "other")
_CLAIM = re.compile(CLAIM_RE)
_NORMALISE = str.maketrans(CHAR_MAP)  # full-width digits and signs, as the step scorer reads them


def claims(text: str) -> list[str]:
    """The arithmetic claims of a text, in order (``a op b = c`` and chains)."""
    return [m.group(0) for m in _CLAIM.finditer((text or "").translate(_NORMALISE))]


def classify(completion: str, solution: str, correct: bool) -> str:
    """One of ``CLASSES`` for a completion judged ``correct`` or not against a worked ``solution``."""
    if correct:
        return "right"
    got, want = claims(completion), claims(solution)
    if len(got) < len(want):
        return "fewer_steps"
    if len(got) > len(want):
        return "more_steps"
    verdicts = arithmetic_step_scorer([got])[0] if got else []
    return "arithmetic" if any(v == 0.0 for v in verdicts) else "other"


def classes(eval_file: Path, prompts: pl.DataFrame) -> pl.DataFrame:
    """``prompt_id, class`` for every row of one evaluation."""
    df = pl.read_parquet(eval_file).join(prompts, on="prompt_id", how="left")
    if df["solution"].null_count() == df.height:
        raise SystemExit(f"{eval_file}: its prompts carry no reference solution; nothing to classify")
    labels = [classify(c, s or "", a == 1.0) for c, s, a in zip(df["completion"], df["solution"], df["accuracy"])]
    return df.select("prompt_id").with_columns(pl.Series("class", labels))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repo", default=".", help="a pipeline directory with data/eval and data/prompts")
    p.add_argument("names", nargs="+", help="evaluations by name, e.g. sft it7 (data/eval/<name>.parquet)")
    args = p.parse_args()
    root = Path(args.repo)
    prompts = pl.read_parquet(root / "data/prompts/eval.parquet").select("prompt_id", "solution")
    per = {n: classes(root / f"data/eval/{n}.parquet", prompts) for n in args.names}
    print(f"{'eval':>8} {'prompts':>7} " + " ".join(f"{c:>11}" for c in CLASSES))
    for name, df in per.items():
        count = Counter(df["class"].to_list())
        print(f"{name:>8} {df.height:>7} " + " ".join(f"{count[c]:>11}" for c in CLASSES))
    if len(per) > 1:
        first, last = args.names[0], args.names[-1]
        pair = per[first].join(per[last], on="prompt_id", suffix="_after")
        print(f"\ntransitions on the {pair.height} prompts both evaluated ({first} rows, {last} columns):")
        print(f"{'':>12} " + " ".join(f"{c:>11}" for c in CLASSES))
        for c in CLASSES:
            row = pair.filter(pl.col("class") == c)["class_after"].to_list()
            print(f"{c:>12} " + " ".join(f"{row.count(d):>11}" for d in CLASSES))


if __name__ == "__main__":
    main()
