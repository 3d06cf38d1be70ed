"""Held-out accuracy on the same kinds of arithmetic problems, phrased in words the pipeline never generates.

The eval set of the pipeline (``data/prompts/eval.parquet``) is drawn from the same templates as the
train set, so a gain there could be a gain on the templates.  This script draws numbers the way
``grpo_pipeline.data`` does (same kinds, same difficulty ranges, both languages) and renders them with
*other* sentences, names, items and days (below; none of them occur in ``data.py``).  The reference
answer and solution are the pipeline's own (``data.build_problem`` on the same numbers), so only the
wording differs.  Each checkpoint is decoded greedily and judged by ``stages/evaluate.py``'s code
(``grpo_pipeline.run.evaluate.run``, the params' sampling backend and reward rules); the script prints
accuracy and format per checkpoint and per language, with standard errors, and the paired difference
of each checkpoint to the first::

    python bench/eval_rephrased.py --repo . sft it8           # checkpoints under models/
    python bench/eval_rephrased.py --repo . sft it8 --n 512 --seed 7
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import tempfile
from fractions import Fraction
from pathlib import Path

import polars as pl

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from grpo_pipeline import data, schemas

NAMES = {"en": ["Priya", "Carlos", "Emma", "Hassan", "Yuki", "Noah", "Fatima", "Leo"],
         "zh": ["小芳", "周杰", "孙悦", "吴凡", "郑爽", "何晨", "林可", "高远"]}
ITEMS = {"en": [("orange", "oranges"), ("comic book", "comic books"), ("candle", "candles"), ("toy car", "toy cars"),
                ("cookie", "cookies"), ("postcard", "postcards")],
         "zh": [("橙子", "个"), ("漫画书", "本"), ("蜡烛", "根"), ("玩具车", "辆"), ("饼干", "块"), ("明信片", "张")]}
DAYS = {"en": ["Thursday", "Friday", "Saturday"], "zh": ["周四", "周五", "周六"]}


def _num(x) -> str:
    return data.format_number(x)


def render(kind: str, lang: str, v: dict, w: dict, rng: random.Random) -> str:
    """A question with the numbers of ``data._draw`` in sentences of this file's own."""
    name, (one, other), en = w["name"], w["item"], lang == "en"
    money = (lambda x: data._money_text(Fraction(x), w["currency"]))
    pick = rng.randrange(2)
    if kind == "unit_price":
        total, n = money(v["total"]), v["count"]
        return ([f"At the market, {n} {other} came to {total} altogether for {name}. What did a single {one} cost?",
                 f"{name}'s receipt shows {total} for {n} {other}, all at the same price. Find the cost of one {one}."],
                [f"{n}{other}{one}一共卖{total}，{name}想知道一{other}{one}的单价是多少？",
                 f"{name}付了{total}，正好买下{n}{other}{one}。求一{other}{one}的价钱。"])[not en][pick]
    if kind == "total_cost":
        n, price = v["count"], money(v["price"])
        return ([f"Each {one} is priced at {price}. If {name} picks up {n} of them, what is the bill?",
                 f"What do {n} {other} cost when a single one sells for {price}?"],
                [f"{one}每{other}售价{price}，{name}打算买{n}{other}，总共应付多少钱？",
                 f"已知一{other}{one}卖{price}，买{n}{other}{one}要花多少钱？"])[not en][pick]
    if kind == "change":
        n, price, paid = v["count"], money(v["price"]), money(v["paid"])
        return ([f"{name} hands the cashier {paid} for {n} {other} priced at {price} apiece. What does {name} get back?",
                 f"With {paid} in hand, {name} buys {n} {other} that are {price} each. How much money is left over?"],
                [f"{name}拿{paid}去买{n}{other}{one}，单价是{price}，应该找零多少钱？",
                 f"{one}{price}一{other}，{name}买了{n}{other}，交给店员{paid}，店员要退回多少钱？"])[not en][pick]
    if kind == "sum":
        terms, days = [_num(x) for x in v["terms"]], DAYS[lang]
        if "quantity" in w:
            verb = w["quantity"][0] if en else w["quantity"]
            if en:
                parts = "; ".join(f"on {d} {name} {verb} {t} km" for d, t in zip(days, terms))
                return f"Training log: {parts}. What distance in kilometres did {name} cover over those days?"
            parts = "，".join(f"{d}{verb}{t}千米" for d, t in zip(days, terms))
            return f"{name}的训练记录：{parts}。这几天总共多少千米？"
        if en:
            parts = "; ".join(f"on {d} another {t}" if i else f"on {d} {name} got {t} {other}"
                              for i, (d, t) in enumerate(zip(days, terms)))
            return f"{parts[0].upper()}{parts[1:]}. What is the total number of {other}?"
        parts = "，".join(f"{d}又得到{t}{other}" if i else f"{name}{d}得到{t}{other}{one}"
                         for i, (d, t) in enumerate(zip(days, terms)))
        return f"{parts}，总共得到几{other}{one}？"
    a, b, c = v["a"], v["b"], v["c"]
    if v["variant"] == "add_mul":
        return (f"In {name}'s shed there are {a} wooden crates and {b} plastic crates, and every crate contains "
                f"{c} {other}. Count all the {other}." if en else
                f"{name}的仓库里有{a}个木箱、{b}个塑料箱，每个箱子装{c}{other}{one}，这些箱子一共装了多少{other}{one}？")
    return (f"{name} picks up {a} bags of {other}, {b} per bag, then hands {c} of them to a neighbour. "
            f"How many {other} remain with {name}?" if en else
            f"{name}买回{a}袋{one}，每袋{b}{other}，分给邻居{c}{other}后，手里还剩多少{other}{one}？")


def rephrased_problems(n: int, seed: int, difficulty: int = 1) -> pl.DataFrame:
    """``n`` problems, kinds x languages balanced, in :data:`data.PROBLEM_COLUMNS`."""
    rng = random.Random(seed)
    combos = [(k, lang) for k in data.KINDS for lang in data.LANGUAGES]
    rows, seen = [], set()
    while len(rows) < n:
        kind, lang = combos[len(rows) % len(combos)]
        values, vocab, _ = data._draw(kind, lang, difficulty, rng)
        vocab = {**vocab, "name": rng.choice(NAMES[lang]), "item": rng.choice(ITEMS[lang])}
        ref = data.build_problem(kind, language=lang, values=values, vocab=vocab)   # the pipeline's answer
        q = render(kind, lang, values, vocab, rng)
        if q in seen:
            continue
        seen.add(q)
        rows.append({"prompt_id": f"reph-{len(rows):06d}", "question": q, "answer": ref["answer"], "language": lang,
                     "kind": kind, "operation": ref["operation"], "solution": ref["solution"], "source": "rephrased"})
    return pl.DataFrame(rows, schema=data.PROBLEM_SCHEMA).select(data.PROBLEM_COLUMNS)


def _se(p: float, n: int) -> float:
    return math.sqrt(p * (1 - p) / n) if n else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoints", nargs="+", help="names under <repo>/models (the first is the baseline)")
    ap.add_argument("--repo", default=".")
    ap.add_argument("--n", type=int, default=256)
    ap.add_argument("--seed", type=int, default=20261205)
    ap.add_argument("--show", type=int, default=0, help="print this many questions and exit")
    args = ap.parse_args()
    problems = rephrased_problems(args.n, args.seed)
    if args.show:
        for row in problems.head(args.show).iter_rows(named=True):
            print(f"[{row['kind']}/{row['language']}] {row['question']}  -> {row['answer']}")
        return
    from grpo_pipeline.coding import add_task_columns
    from grpo_pipeline.config import load_params
    from grpo_pipeline.run import evaluate

    repo = Path(args.repo)
    cfg = load_params(repo / "params.yaml", sections=("evaluate", "sampling"))
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        prompts = Path(tmp) / "rephrased.parquet"
        schemas.write_table(add_task_columns(problems), prompts, "prompts")   # null tests / entry_point
        for name in args.checkpoints:
            out = Path(tmp) / f"{name}.parquet"
            evaluate.run(cfg.evaluate, cfg.sampling, cfg.reward, name=name, checkpoint=str(repo / "models" / name),
                         prompts=str(prompts), out=str(out), metrics_path=None, n_prompts=args.n)
            judged = schemas.read_table(out, "eval")
            results[name] = judged.join(problems.select("prompt_id", "language"), on="prompt_id").sort("prompt_id")
    base_name = args.checkpoints[0]
    base = results[base_name]
    print(f"rephrased held-out problems: {args.n} (seed {args.seed}), greedy; +- is the standard error")
    for name, df in results.items():
        parts = [f"{name:>6}: accuracy {df['accuracy'].mean():.3f} +- {_se(df['accuracy'].mean(), df.height):.3f}",
                 f"format {df['format'].mean():.3f}"]
        for lang in data.LANGUAGES:
            sub = df.filter(pl.col("language") == lang)["accuracy"]
            parts.append(f"{lang} {sub.mean():.3f} +- {_se(sub.mean(), sub.len()):.3f}")
        if name != base_name:
            d = df["accuracy"].cast(pl.Float64) - base["accuracy"].cast(pl.Float64)
            parts.append(f"minus {base_name} {d.mean():+.3f} +- {d.std() / math.sqrt(d.len()):.3f} (paired)")
        print("  ".join(parts))


if __name__ == "__main__":
    main()
