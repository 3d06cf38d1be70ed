"""Prompt data: seeded arithmetic word problems (English / Chinese) and a loader for user files.

Every frame has the columns of :data:`PROBLEM_COLUMNS` (all ``pl.String``):

- ``prompt_id``: ``"syn-000123"`` for synthetic rows, the ``id_field`` value (or ``"<stem>-000123"``) for files.
- ``question``, ``answer`` (the reference, as text), ``language`` (``"en"`` / ``"zh"``).
- ``kind``: one of :data:`KINDS` for synthetic rows, ``"user"`` for loaded rows.
- ``operation``: ``"add" | "sub" | "mul" | "div"``, the operator of the *first* step of the
  solution (``change`` therefore reads ``"mul"``: the cost is computed before the change).
  Null for loaded rows whose solution shows no operator.
- ``solution``: worked steps, one arithmetic claim ``a op b = c`` per line (``op`` in ``+ - * /``),
  each preceded by a digit-free label in the problem's language; null when unknown.
- ``source``: ``"synthetic"`` or the user file's name.

Number formatting rule (:func:`format_number`), used for answers and for solution lines
-----------------------------------------------------------------------------------------
1. A whole number is printed without decimals: ``12``, never ``12.0``.
2. Money (``unit_price``, ``total_cost``, ``change``) is rounded half-up to 2 decimals, trailing
   zeros dropped: 5/3 -> ``1.67``, 3*1.50 -> ``4.5``.
3. Anything else is printed as its shortest exact decimal when it terminates within 6 places
   (``6.25``), otherwise rounded half-up to 2 decimals (10/3 -> ``3.33``).

Example
-------
>>> build_problem("unit_price", language="zh", values={"total": 5, "count": 3},
...               vocab={"name": "小明", "item": ("铅笔", "支"), "currency": "元"})["question"]
'小明用5元钱买了3支铅笔，每支铅笔多少钱？'
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Sequence
from decimal import Decimal
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

PROBLEM_COLUMNS = ["prompt_id", "question", "answer", "language", "kind", "operation", "solution", "source"]
PROBLEM_SCHEMA = {name: pl.String for name in PROBLEM_COLUMNS}
LANGUAGES = ("en", "zh")
KINDS = ("unit_price", "total_cost", "change", "sum", "two_step")
DIFFICULTIES = (1, 2, 3)
OPERATIONS = ("add", "sub", "mul", "div")
OPERATION_SYMBOLS = {"add": "+", "sub": "-", "mul": "*", "div": "/"}
SYMBOL_OPERATIONS = {"+": "add", "-": "sub", "−": "sub", "*": "mul", "×": "mul", "x": "mul", "/": "div", "÷": "div"}
MONEY_KINDS = ("unit_price", "total_cost", "change")
SUPPORTED_SUFFIXES = (".jsonl", ".parquet")

# ---------------------------------------------------------------- vocabulary (no digits anywhere)
_NAMES = {
    "en": ["Tom", "Anna", "Li Hua", "Maria", "Kenji", "Sara", "Omar", "Lucy", "David", "Mei"],
    "zh": ["小明", "小红", "李华", "王芳", "张伟", "小刚", "刘洋", "陈静", "小丽", "赵磊"],
}
_ITEMS = {  # en: (singular, plural); zh: (noun, measure word)
    "en": [("pencil", "pencils"), ("notebook", "notebooks"), ("apple", "apples"), ("eraser", "erasers"),
           ("balloon", "balloons"), ("sticker", "stickers"), ("cupcake", "cupcakes"), ("marble", "marbles")],
    "zh": [("铅笔", "支"), ("笔记本", "本"), ("苹果", "个"), ("橡皮", "块"),
           ("气球", "个"), ("贴纸", "张"), ("蛋糕", "块"), ("弹珠", "颗")],
}
_CURRENCIES = {"en": ["$", "yuan"], "zh": ["元"]}
_QUANTITIES = {  # en: (past verb, base verb); zh: verb. Unit: km / 千米
    "en": [("ran", "run"), ("cycled", "cycle"), ("walked", "walk")], "zh": ["跑了", "骑行了", "走了"],
}
_DAYS = {"en": ["Monday", "Tuesday", "Wednesday"], "zh": ["周一", "周二", "周三"]}
_N_TEMPLATES = {"unit_price": 2, "total_cost": 2, "change": 2, "sum": 1, "two_step": 1}

# ---------------------------------------------------------------- operand magnitude by difficulty
_COUNT = {1: (2, 9), 2: (2, 20), 3: (5, 60)}
_PRICE_CENTS = {1: (100, 1000, 50), 2: (50, 5000, 10), 3: (100, 20000, 1)}  # (low, high, step)
_TOTAL = {1: (2, 20), 2: (10, 300), 3: (100, 5000)}
_TERM = {1: (2, 20), 2: (10, 200), 3: (100, 5000)}
_KM = {1: (1, 15, 0), 2: (1, 40, 1), 3: (10, 200, 2)}  # (low, high, decimals) of distances in "sum"
_FACTOR = {1: (2, 9), 2: (2, 30), 3: (10, 99)}
_NOTES = [5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000]
_MAX_TRIES = 200


def format_number(value: Fraction | int | str, *, money: bool = False) -> str:
    """Print ``value`` by the module's rule (see the module docstring).

    Examples
    --------
    >>> format_number(Fraction(5, 3), money=True), format_number(12), format_number("6.250")
    ('1.67', '12', '6.25')
    """
    q = Fraction(value)
    if q.denominator != 1 and (money or (q * 10**6).denominator != 1):  # round half-up to 2 decimals
        scaled = abs(q) * 100 + Fraction(1, 2)
        q = Fraction(scaled.numerator // scaled.denominator, 100) * (1 if q >= 0 else -1)
    if q.denominator == 1:
        return str(q.numerator)
    return format((Decimal(q.numerator) / Decimal(q.denominator)).normalize(), "f")


def _money_text(amount: Fraction, currency: str) -> str:
    if currency == "$":  # $5, $1.50
        return "$" + (str(amount.numerator) if amount.denominator == 1 else f"{float(amount):.2f}")
    return format_number(amount, money=True) + (" yuan" if currency == "yuan" else "元")


def _and_list(parts: list[str]) -> str:
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]


def _render(kind: str, lang: str, v: dict[str, Any], w: dict[str, Any], t: int) -> tuple[str, list]:
    """Return the question and the steps ``[(label, a, op, b), ...]``; ``a`` may be ``None`` = previous result."""
    name, en = w["name"], lang == "en"
    if kind == "sum" and "quantity" in w:
        terms, days = [format_number(x) for x in v["terms"]], _DAYS[lang]
        if en:
            said = _and_list([f"{x} km on {d}" for x, d in zip(terms, days)])
            q = f"{name} {w['quantity'][0]} {said}. How many kilometres did {name} {w['quantity'][1]} in total?"
        else:
            said = "，".join(f"{d}{w['quantity']}{x}千米" for x, d in zip(terms, days))
            q = f"{name}{said}，一共{w['quantity']}多少千米？"
        return q, _sum_steps(v["terms"], en)
    one, other = w["item"]  # en: (singular, plural); zh: (noun, measure word)
    if kind == "sum":
        terms = [format_number(x) for x in v["terms"]]
        if en:
            said = _and_list([f"{terms[0]} {other} on {_DAYS[lang][0]}"] + [
                f"{x} on {d}" for x, d in zip(terms[1:], _DAYS[lang][1:])])
            q = f"{name} collected {said}. How many {other} did {name} collect in total?"
        else:
            said = "，".join(f"{d}收集了{x}{other}" + (one if i == 0 else "")
                            for i, (x, d) in enumerate(zip(terms, _DAYS[lang])))
            q = f"{name}{said}，一共收集了多少{other}{one}？"
        return q, _sum_steps(v["terms"], en)
    if kind == "two_step":
        a, b, c = v["a"], v["b"], v["c"]
        if v["variant"] == "add_mul":
            q = (f"{name} has {a} red boxes and {b} blue boxes. Each box holds {c} {other}. "
                 f"How many {other} are there in all?" if en else
                 f"{name}有{a}个红盒子和{b}个蓝盒子，每个盒子里有{c}{other}{one}，一共有多少{other}{one}？")
            labels = ("Number of boxes", f"Number of {other}") if en else ("盒子总数", f"{one}的总数")
            return q, [(labels[0], a, "add", b), (labels[1], None, "mul", c)]
        q = (f"{name} buys {a} packs of {other} with {b} in each pack and gives {c} to friends. "
             f"How many {other} does {name} have left?" if en else
             f"{name}买了{a}包{one}，每包{b}{other}，送给朋友{c}{other}，还剩多少{other}？")
        things = other.capitalize()
        labels = (f"{things} bought", f"{things} left") if en else (f"买到的{one}", f"剩下的{one}")
        return q, [(labels[0], a, "mul", b), (labels[1], None, "sub", c)]
    cur = w["currency"]
    if kind == "unit_price":
        total, count = _money_text(v["total"], cur), v["count"]
        q = [[f"{name} spent {total} on {count} {other}. How much does each {one} cost?",
              f"{name} paid {total} for {count} {other}. What is the price of one {one}?"],
             [f"{name}用{total}钱买了{count}{other}{one}，每{other}{one}多少钱？",
              f"{name}花了{total}买了{count}{other}{one}，平均每{other}{one}多少钱？"]][not en][t]
        label = f"Price of one {one}" if en else f"每{other}{one}的价格"
        return q, [(label, v["total"], "div", count)]
    count, price = v["count"], _money_text(v["price"], cur)
    if kind == "total_cost":
        q = [[f"{name} buys {count} {other} at {price} each. How much does {name} pay in total?",
              f"One {one} costs {price}. How much do {count} {other} cost?"],
             [f"{name}买了{count}{other}{one}，每{other}{price}，一共要付多少钱？",
              f"一{other}{one}{price}，{name}要买{count}{other}，需要多少钱？"]][not en][t]
        return q, [("Total cost" if en else "总价", count, "mul", v["price"])]
    paid = _money_text(v["paid"], cur)
    q = [[f"{name} buys {count} {other} at {price} each and pays with {paid}. How much change does {name} get?",
          f"{count} {other} cost {price} each. {name} hands over {paid}. How much change should {name} receive?"],
         [f"{name}买了{count}{other}{one}，每{other}{price}，付了{paid}，应找回多少钱？",
          f"{name}要买{count}{other}{one}，单价{price}，给了售货员{paid}，能找回多少钱？"]][not en][t]
    labels = (f"Cost of the {other}", "Change") if en else (f"{one}的总价", "找回的钱")
    return q, [(labels[0], count, "mul", v["price"]), (labels[1], v["paid"], "sub", None)]


def _sum_steps(terms: list[Fraction], en: bool) -> list:
    labels = ("Total so far", "Adding the next day") if en else ("前两天合计", "再加上下一天")
    steps = [(labels[0], terms[0], "add", terms[1])]
    return steps + [(labels[1], None, "add", x) for x in terms[2:]]


_APPLY = {"add": lambda a, b: a + b, "sub": lambda a, b: a - b, "mul": lambda a, b: a * b, "div": lambda a, b: a / b}


def build_problem(
    kind: str, *, language: str, values: dict[str, Any], vocab: dict[str, Any], template: int = 0
) -> dict[str, str]:
    """Render one problem from explicit numbers; returns ``question, answer, operation, solution``.

    Numbers appear in the question in this order (tests rely on it):
    ``unit_price``: total, count. ``total_cost``: count, price. ``change``: count, price, paid.
    ``sum``: the terms. ``two_step``: a, b, c with ``values["variant"]`` ``"add_mul"``
    ((a + b) * c) or ``"mul_sub"`` (a * b - c).

    ``values`` holds ints, strings or Fractions. ``vocab`` holds ``name``, ``item`` (en: (singular,
    plural), zh: (noun, measure word)), ``currency`` for money kinds (``"$"``, ``"yuan"``, ``"元"``)
    and optionally ``quantity`` (a ``sum`` of distances; see ``_QUANTITIES``). ``template`` picks
    the phrasing (money kinds have 2).
    """
    _check_choice("kind", kind, KINDS)
    _check_choice("language", language, LANGUAGES)
    vals = {key: ([Fraction(x) for x in val] if key == "terms" else val if key == "variant" else Fraction(val))
            for key, val in values.items()}
    question, steps = _render(kind, language, vals, vocab, template)
    money, lines, prev = kind in MONEY_KINDS, [], None
    for label, a, op, b in steps:
        a, b = (prev if a is None else a), (prev if b is None else b)
        prev = Fraction(format_number(_APPLY[op](a, b), money=money))  # later steps use the shown value
        shown = [format_number(x, money=money) for x in (a, b, prev)]
        sep = ": " if language == "en" else "："
        lines.append(f"{label}{sep}{shown[0]} {OPERATION_SYMBOLS[op]} {shown[1]} = {shown[2]}")
    return {"question": question, "answer": format_number(prev, money=money),
            "operation": steps[0][2], "solution": "\n".join(lines)}


def _draw(kind: str, lang: str, difficulty: int, rng: random.Random) -> tuple[dict, dict, int]:
    vocab: dict[str, Any] = {"name": rng.choice(_NAMES[lang]), "item": rng.choice(_ITEMS[lang]),
                             "currency": rng.choice(_CURRENCIES[lang])}
    count = rng.randint(*_COUNT[difficulty])
    lo, hi, step = _PRICE_CENTS[difficulty]
    price = Fraction(rng.randrange(lo, hi + 1, step), 100)
    if kind == "unit_price":
        values: dict[str, Any] = {"total": rng.randint(*_TOTAL[difficulty]), "count": count}
    elif kind == "total_cost":
        values = {"count": count, "price": price}
    elif kind == "change":
        cost = count * price
        notes = [x for x in _NOTES if x > cost]
        values = {"count": count, "price": price, "paid": rng.choice(notes[:2])}
    elif kind == "sum":
        n_terms, (lo, hi, places) = rng.choice([2, 3]), _KM[difficulty]
        if rng.random() < 0.5:
            vocab["quantity"] = rng.choice(_QUANTITIES[lang])
            terms = [Fraction(rng.randint(lo * 10**places, hi * 10**places), 10**places) for _ in range(n_terms)]
        else:
            terms = [Fraction(rng.randint(*_TERM[difficulty])) for _ in range(n_terms)]
        values = {"terms": terms}
    else:
        a, b = rng.randint(*_FACTOR[difficulty]), rng.randint(*_FACTOR[difficulty])
        variant = rng.choice(["add_mul", "mul_sub"])
        c = rng.randint(*_FACTOR[difficulty]) if variant == "add_mul" else rng.randint(1, a * b - 1)
        values = {"a": a, "b": b, "c": c, "variant": variant}
    return values, vocab, rng.randrange(_N_TEMPLATES[kind])


def _check_choice(what: str, value: Any, allowed: Sequence[Any]) -> None:
    if value not in allowed:
        msg = f"Unknown {what}: {value!r}. Allowed values are: {list(allowed)}"
        raise ValueError(msg)


def generate_problems(
    *, n: int, seed: int = 0, languages: Sequence[str] = LANGUAGES, kinds: Sequence[str] | None = None,
    difficulty: int = 1,
) -> pl.DataFrame:
    """Generate ``n`` distinct arithmetic word problems with exact reference answers.

    Kinds and languages are balanced (round-robin over kind x language, then shuffled); names,
    items, currencies (元 / yuan / $) and phrasings vary. The same arguments give the same frame.

    Parameters
    ----------
    n
        Number of rows, at least 1.
    seed
        Seed of the private ``random.Random``; different seeds give different frames.
    languages, kinds
        Non-empty subsets of :data:`LANGUAGES` / :data:`KINDS` (``None`` = all kinds).
    difficulty
        1..3, operand magnitude (e.g. counts 2-9 / 2-20 / 5-60; prices in 0.5 / 0.1 / 0.01 steps).

    Returns
    -------
    polars.DataFrame
        Columns :data:`PROBLEM_COLUMNS`, ids ``syn-000000`` .. in row order, ``source="synthetic"``.

    Examples
    --------
    >>> generate_problems(n=4, seed=1, languages=["zh"], kinds=["unit_price"]).height
    4
    """
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        msg = f"n must be a positive integer, got {n!r}"
        raise ValueError(msg)
    kinds = list(KINDS if kinds is None else kinds)
    languages = list(languages)
    for what, chosen, allowed in (("kind", kinds, KINDS), ("language", languages, LANGUAGES)):
        if not chosen:
            msg = f"At least one {what} is required. Allowed values are: {list(allowed)}"
            raise ValueError(msg)
        for value in chosen:
            _check_choice(what, value, allowed)
    _check_choice("difficulty", difficulty, DIFFICULTIES)
    rng = random.Random(seed)
    combos = [(k, lang) for k in dict.fromkeys(kinds) for lang in dict.fromkeys(languages)]
    slots = [combos[i % len(combos)] for i in range(n)]
    rng.shuffle(slots)
    seen, rows = set(), []
    for i, (kind, lang) in enumerate(slots):
        for _ in range(_MAX_TRIES):
            values, vocab, template = _draw(kind, lang, difficulty, rng)
            problem = build_problem(kind, language=lang, values=values, vocab=vocab, template=template)
            if problem["question"] not in seen:
                break
        else:
            msg = (f"Could not draw {n} distinct problems (stuck at row {i}, kind={kind!r}, language={lang!r}). "
                   "Hint: lower n, raise difficulty or allow more kinds/languages.")
            raise ValueError(msg)
        seen.add(problem["question"])
        rows.append({"prompt_id": f"syn-{i:06d}", **problem, "language": lang, "kind": kind, "source": "synthetic"})
    return pl.DataFrame(rows, schema=PROBLEM_SCHEMA).select(PROBLEM_COLUMNS)


# ---------------------------------------------------------------- user files
_CJK = re.compile(r"[\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff]")
_CALC = re.compile(r"<<([^<>]*)>>")  # GSM8K calculator annotation <<48/2=24>>
_OPERATOR = re.compile(r"\d\s*([+\-−*×x/÷])\s*[$¥]?\s*\d")


def detect_language(text: str) -> str:
    """``"zh"`` if ``text`` has any CJK ideograph, else ``"en"``."""
    return "zh" if _CJK.search(text) else "en"


def infer_operation(text: str | None) -> str | None:
    """Operation of the first operator between two numbers (GSM8K ``<<..>>`` annotations first), or ``None``.

    >>> infer_operation("Natalia sold 48/2 = <<48/2=24>>24 clips in May."), infer_operation("no math")
    ('div', None)
    """
    if not text:
        return None
    for source in [m.group(1) for m in _CALC.finditer(text)] + [_CALC.sub("", text)]:
        match = _OPERATOR.search(source)
        if match:
            return SYMBOL_OPERATIONS[match.group(1)]
    return None


def _as_text(value: Any) -> str | None:
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return None if value is None else (str(value).strip() or None)


def _read_parquet_records(path: Path) -> list[dict[str, Any]]:
    """A user Parquet file's rows; a file that is no Parquet (a renamed JSONL, ...) is one error naming it."""
    try:
        return pl.read_parquet(path).to_dicts()
    except (pl.exceptions.PolarsError, OSError) as e:
        head = path.read_bytes()[:4] if path.is_file() else b""
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        msg = (f"{path}: not a readable Parquet file (starts with {head!r}, Parquet starts with b'PAR1'): {first}. "
               "Hint: is it JSONL with a .parquet name?")
        raise ValueError(msg) from None


def _read_records(path: Path) -> list[dict[str, Any]]:
    if path.suffix == ".parquet":
        return _read_parquet_records(path)
    records = []
    offset = 0
    with path.open("rb") as fh:
        for line_no, raw in enumerate(fh, start=1):
            start, offset = offset, offset + len(raw)
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                msg = (f"{path}: line {line_no} (byte offset {start + e.start}) is not UTF-8 ({e.reason}). "
                       "Hint: re-encode the file as UTF-8, or is it a Parquet file with a .jsonl name?")
                raise ValueError(msg) from None
            if line_no == 1:
                line = line.removeprefix("\ufeff")   # a UTF-8 byte-order mark
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                msg = f"{path}: line {line_no} is not valid JSON ({err.msg})"
                raise ValueError(msg) from err
            if not isinstance(record, dict):
                msg = f"{path}: line {line_no} is a JSON {type(record).__name__}, expected an object"
                raise ValueError(msg)  # noqa: TRY004 - bad file content, same error type as the rest
            records.append(record)
    return records


def read_user_records(path: Path, fields: Sequence[str | None]) -> list[dict[str, Any]]:
    """The rows of a user JSONL / Parquet file; errors name the file and any missing column in ``fields``."""
    if path.suffix not in SUPPORTED_SUFFIXES:
        msg = f"{path}: unsupported file type {path.suffix!r}. Supported extensions are: {list(SUPPORTED_SUFFIXES)}"
        raise ValueError(msg)
    records = _read_records(path)
    if not records:
        msg = f"{path}: no rows"
        raise ValueError(msg)
    available = list(dict.fromkeys(key for record in records for key in record))
    for field in fields:
        if field is not None and field not in available:
            msg = f"{path}: column {field!r} not found. Available columns: {available}"
            raise ValueError(msg)
    return records


def load_problems(
    path: str | Path, *, question_field: str = "question", answer_field: str = "answer",
    solution_field: str | None = None, id_field: str | None = None,
) -> pl.DataFrame:
    """Load user problems from JSONL or Parquet (chosen by extension) into the :data:`PROBLEM_COLUMNS` frame.

    GSM8K's convention is understood: an answer ``"worked solution\\n#### 1,072"`` gives
    ``answer="1072"`` and, unless ``solution_field`` is given, the text before ``####`` as the
    solution with the ``<<48/2=24>>`` calculator annotations removed. ``operation`` is inferred from
    the solution (first operator; null if none), ``language`` from the question (CJK -> zh),
    ``kind`` is ``"user"`` and ``source`` the file name. Ids come from ``id_field`` (must be unique)
    or are ``"<file stem>-000000"`` by row.

    Raises
    ------
    ValueError
        Unsupported extension; missing column (names the file, the column and the available ones);
        empty or null question/answer (names the file and the 1-based row); duplicate ids.
    """
    path = Path(path)
    records = read_user_records(path, [question_field, answer_field, solution_field, id_field])
    rows, seen_ids = [], set()
    for i, record in enumerate(records):
        question, answer = _as_text(record.get(question_field)), _as_text(record.get(answer_field))
        for field, value in ((question_field, question), (answer_field, answer)):
            if value is None:
                msg = f"{path}: row {i + 1} (1-based) has an empty or null {field!r}"
                raise ValueError(msg)
        solution = None
        if "####" in answer:
            worked, _, answer = answer.rpartition("####")
            answer = answer.strip().replace(",", "")
            solution = worked.strip() or None
            if not answer:
                msg = f"{path}: row {i + 1} (1-based) has nothing after '####' in {answer_field!r}"
                raise ValueError(msg)
        if solution_field is not None:
            solution = _as_text(record.get(solution_field))
        operation = infer_operation(solution)
        if solution is not None:
            solution = "\n".join(line.strip() for line in _CALC.sub("", solution).splitlines()).strip() or None
        prompt_id = f"{path.stem}-{i:06d}" if id_field is None else _as_text(record.get(id_field))
        if prompt_id is None or prompt_id in seen_ids:
            msg = f"{path}: row {i + 1} (1-based) has a null or duplicate {id_field!r}: {prompt_id!r}"
            raise ValueError(msg)
        seen_ids.add(prompt_id)
        rows.append({"prompt_id": prompt_id, "question": question, "answer": answer,
                     "language": detect_language(question), "kind": "user", "operation": operation,
                     "solution": solution, "source": path.name})
    return pl.DataFrame(rows, schema=PROBLEM_SCHEMA).select(PROBLEM_COLUMNS)


def split_train_eval(df: pl.DataFrame, *, n_eval: int, seed: int) -> tuple[pl.DataFrame, pl.DataFrame]:
    """Split ``df`` into ``(train, eval)`` with ``n_eval`` rows drawn by a seeded permutation.

    Both parts keep ``df``'s row order; the split depends only on ``len(df)``, ``n_eval`` and ``seed``
    (NumPy ``default_rng``), not on the polars version.
    """
    if n_eval < 1 or n_eval >= df.height:
        msg = f"n_eval must be in [1, len(df) - 1]: got n_eval={n_eval} with len(df)={df.height}"
        raise ValueError(msg)
    perm = np.random.default_rng(seed).permutation(df.height)  # (len(df),)
    is_eval = np.zeros(df.height, dtype=bool)
    is_eval[perm[:n_eval]] = True
    return df.filter(~pl.Series(is_eval)), df.filter(pl.Series(is_eval))
