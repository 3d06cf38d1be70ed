"""Coding tasks: seeded Python function-writing problems with hidden unit tests, and a loader.

Frames have :data:`TASK_COLUMNS`: the prompt columns of :mod:`grpo_pipeline.data` plus

- ``tests`` (``List(String)``): hidden test snippets, one ``assert`` each, run one by one after
  the completion's code (:mod:`grpo_pipeline.sandbox`); the reward is the share that passes.
- ``entry_point`` (``String``): the function the tests call; also bound as ``candidate``.

and, for coding rows: ``question`` the task statement (signature, what to compute, one worked
example; the hidden tests use other inputs), ``answer`` the reference code (the SFT target;
``""`` for user rows without one), ``solution`` a one-line plan or null, ``language="en"``,
``kind`` the family (:data:`FAMILIES`) or ``"user"``, ``operation`` null. Math frames get null
``tests`` / ``entry_point`` (:func:`add_task_columns`).

User files (JSONL or Parquet, :func:`load_tasks`), HumanEval / MBPP style: ``prompt``, ``tests``
as a list of assert strings (MBPP ``test_list``) or as one string of code (MBPP ``test``,
HumanEval ``test`` with ``def check(candidate): ...``), optional ``entry_point`` (else the first
function the tests call) and an optional reference (``reference_field``: MBPP ``code``;
HumanEval ``canonical_solution``, a body, is appended to the prompt).

Example
-------
>>> df = generate_tasks(n=2, seed=0, families=["add_k"])
>>> df["tests"][0].len(), df["entry_point"][0] in df["question"][0]
(5, True)
"""

from __future__ import annotations

import ast
import builtins
import json
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import polars as pl

from grpo_pipeline.data import PROBLEM_COLUMNS, PROBLEM_SCHEMA, read_user_records

__all__ = ["FAMILIES", "TASK_COLUMNS", "TASK_SCHEMA", "add_task_columns", "generate_tasks", "load_tasks",
           "split_tests"]

TASK_COLUMNS = [*PROBLEM_COLUMNS, "tests", "entry_point"]
TASK_SCHEMA = {**PROBLEM_SCHEMA, "tests": pl.List(pl.String), "entry_point": pl.String}
_MAX_TRIES = 200


@dataclass(frozen=True)
class _Family:
    names: tuple[str, ...]                       # function names to draw from
    signature: str                               # "(xs: list[int]) -> list[int]"
    text: str                                    # what it returns, with {params}
    body: str                                    # reference body (one expression or block), with {params}
    plan: str                                    # one-line plan for the SFT <think>
    params: Callable[[random.Random], dict[str, Any]]
    inputs: Callable[[random.Random, dict[str, Any]], tuple]   # one argument tuple


def _ints(rng: random.Random, lo: int = -20, hi: int = 20, n: tuple[int, int] = (0, 8)) -> list[int]:
    return [rng.randint(lo, hi) for _ in range(rng.randint(*n))]


def _word(rng: random.Random, alphabet: str = "abcdefghij", n: tuple[int, int] = (0, 10)) -> str:
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(*n)))


_F = _Family
_FAMILY_SPECS: dict[str, _Family] = {
    "add_k": _F(("add_k", "shift_all", "increase_each"), "(xs: list[int]) -> list[int]",
                "returns a new list with {k} added to every element of `xs`",
                "return [x + {k} for x in xs]", "Add {k} to each element, keeping the order.",
                lambda r: {"k": r.randint(1, 60)}, lambda r, p: (_ints(r),)),
    "count_greater": _F(("count_greater", "how_many_above"), "(xs: list[int]) -> int",
                        "returns how many elements of `xs` are greater than {k}",
                        "return sum(1 for x in xs if x > {k})", "Count the elements strictly above {k}.",
                        lambda r: {"k": r.randint(-10, 15)}, lambda r, p: (_ints(r),)),
    "multiples": _F(("multiples_of", "keep_divisible"), "(xs: list[int]) -> list[int]",
                    "returns the elements of `xs` that are divisible by {k}, in their original order",
                    "return [x for x in xs if x % {k} == 0]", "Keep each x with x % {k} == 0.",
                    lambda r: {"k": r.randint(2, 9)}, lambda r, p: (_ints(r, -50, 50),)),
    "sum_small_squares": _F(("sum_small_squares", "square_sum_upto"), "(xs: list[int]) -> int",
                            "returns the sum of the squares of the elements of `xs` that are at most {k}",
                            "return sum(x * x for x in xs if x <= {k})", "Square the elements <= {k} and add them.",
                            lambda r: {"k": r.randint(-5, 15)}, lambda r, p: (_ints(r),)),
    "repeat_join": _F(("repeat_join", "echo"), "(s: str) -> str",
                      "returns `s` repeated {k} times, joined by {sep!r}",
                      "return {sep!r}.join([s] * {k})", "Make {k} copies of s and join them with {sep!r}.",
                      lambda r: {"k": r.randint(2, 6), "sep": r.choice(["-", ",", " ", "+", ""])},
                      lambda r, p: (_word(r),)),
    "count_char": _F(("count_char", "occurrences"), "(s: str) -> int",
                     "returns how many times the character {c!r} occurs in `s`",
                     "return sum(1 for ch in s if ch == {c!r})", "Count the characters equal to {c!r}.",
                     lambda r: {"c": r.choice("abcdefghij")}, lambda r, p: (_word(r, n=(0, 14)),)),
    "rotate_left": _F(("rotate_left", "rotate"), "(xs: list[int]) -> list[int]",
                      "returns `xs` rotated left by {k} positions (the first elements move to the end; "
                      "{k} may exceed the length; an empty list stays empty)",
                      "if not xs:\n        return []\n    k = {k} % len(xs)\n    return xs[k:] + xs[:k]",
                      "Reduce {k} modulo the length, then join the two slices.",
                      lambda r: {"k": r.randint(1, 12)}, lambda r, p: (_ints(r),)),
    "clamp_all": _F(("clamp_all", "clip_values"), "(xs: list[int]) -> list[int]",
                    "returns a new list in which every element of `xs` is clamped into the range [{lo}, {hi}]",
                    "return [min(max(x, {lo}), {hi}) for x in xs]", "Raise values below {lo}, lower values above {hi}.",
                    lambda r: {"lo": (lo := r.randint(-10, 5)), "hi": lo + r.randint(1, 15)},
                    lambda r, p: (_ints(r),)),
    "caesar": _F(("caesar", "shift_letters"), "(s: str) -> str",
                 "returns `s` with every lowercase letter a-z shifted forward by {k} places in the alphabet, "
                 "wrapping from z to a; other characters are unchanged",
                 "return ''.join(chr((ord(ch) - 97 + {k}) % 26 + 97) if 'a' <= ch <= 'z' else ch for ch in s)",
                 "Shift letter codes by {k} modulo 26, leave the rest.",
                 lambda r: {"k": r.randint(1, 25)}, lambda r, p: (_word(r, "abcxyz z!", n=(0, 12)),)),
    "fizzbuzz": _F(("fizzbuzz", "fizz_words"), "(n: int) -> list[str]",
                   "returns a list of strings for the numbers 1 to `n`: 'Fizz' for multiples of {a}, "
                   "'Buzz' for multiples of {b}, 'FizzBuzz' for multiples of both, else the number itself",
                   "out = []\n    for i in range(1, n + 1):\n        w = ('Fizz' if i % {a} == 0 else '') + "
                   "('Buzz' if i % {b} == 0 else '')\n        out.append(w or str(i))\n    return out",
                   "Build each word from the two divisibility tests.",
                   lambda r: {"a": (a := r.randint(2, 5)), "b": r.choice([b for b in range(2, 8) if math.gcd(a, b) == 1])},
                   lambda r, p: (r.randint(0, 20),)),
    "digit_sum_base": _F(("digit_sum_base", "base_digit_sum"), "(n: int) -> int",
                         "returns the sum of the digits of the non-negative integer `n` written in base {k}",
                         "total = 0\n    while n:\n        total += n % {k}\n        n //= {k}\n    return total",
                         "Take n % {k} and divide by {k} until n is 0.",
                         lambda r: {"k": r.randint(2, 16)}, lambda r, p: (r.randint(0, 5000),)),
    "window_sums": _F(("window_sums", "sliding_sums"), "(xs: list[int]) -> list[int]",
                      "returns the sums of every run of {k} consecutive elements of `xs`, in order "
                      "(an empty list when `xs` has fewer than {k} elements)",
                      "return [sum(xs[i:i + {k}]) for i in range(len(xs) - {k} + 1)]",
                      "Slide a window of width {k} and sum each.",
                      lambda r: {"k": r.randint(1, 4)}, lambda r, p: (_ints(r, n=(0, 9)),)),
}
FAMILIES: tuple[str, ...] = tuple(_FAMILY_SPECS)


def _call(name: str, args: tuple) -> str:
    return f"{name}({', '.join(repr(a) for a in args)})"


def _build(family: str, rng: random.Random, n_tests: int) -> dict[str, Any]:
    spec = _FAMILY_SPECS[family]
    p = spec.params(rng)
    name = rng.choice(spec.names)
    code = f"def {name}{spec.signature}:\n    {spec.body.format(**p)}\n"
    scope: dict[str, Any] = {}
    exec(compile(code, f"<{family}>", "exec"), scope)  # noqa: S102 - our own reference code
    fn = scope[name]
    seen, cases = set(), []
    for _ in range(_MAX_TRIES):
        args = spec.inputs(rng, p)
        if repr(args) not in seen:
            seen.add(repr(args))
            cases.append((args, fn(*args)))
        if len(cases) == n_tests + 1:
            break
    ex = max(range(len(cases)), key=lambda j: len(repr(cases[j][0])))  # the most telling input is the example
    (ex_args, ex_out), hidden = cases[ex], cases[:ex] + cases[ex + 1:]
    question = (f"Write a Python function `{name}{spec.signature}` that {spec.text.format(**p)}.\n\n"
                f"Example: `{_call(name, ex_args)}` returns `{ex_out!r}`.")
    return {"question": question, "answer": code.strip(), "solution": spec.plan.format(**p), "kind": family,
            "tests": [f"assert {_call(name, a)} == {out!r}" for a, out in hidden], "entry_point": name}


def generate_tasks(*, n: int, seed: int = 0, families: Sequence[str] | None = None, n_tests: int = 5) -> pl.DataFrame:
    """``n`` distinct function-writing tasks, families balanced (round-robin, shuffled); seeded.

    Each task's hidden tests are ``n_tests`` asserts on distinct inputs computed by the reference
    solution (so the reference passes all of them); the example in the question is another input.
    Ids are ``code-000000`` .. in row order, ``source="synthetic"``.

    Raises
    ------
    ValueError
        ``n`` < 1, an unknown family (the valid ones are listed), or too few distinct tasks.
    """
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        msg = f"n must be a positive integer, got {n!r}"
        raise ValueError(msg)
    families = list(FAMILIES if families is None else dict.fromkeys(families))
    bad = [f for f in families if f not in _FAMILY_SPECS]
    if bad or not families:
        msg = f"Unknown coding task families {bad}. Allowed values are: {list(FAMILIES)}"
        raise ValueError(msg)
    rng = random.Random(seed)
    slots = [families[i % len(families)] for i in range(n)]
    rng.shuffle(slots)
    rows, seen = [], set()
    for i, family in enumerate(slots):
        for _ in range(_MAX_TRIES):
            task = _build(family, rng, n_tests)
            if task["question"] not in seen:
                break
        else:
            msg = f"Could not draw {n} distinct coding tasks (stuck at row {i}, family={family!r}). Hint: lower n"
            raise ValueError(msg)
        seen.add(task["question"])
        rows.append({"prompt_id": f"code-{i:06d}", "language": "en", "operation": None, "source": "synthetic", **task})
    return pl.DataFrame(rows, schema=TASK_SCHEMA).select(TASK_COLUMNS)


def add_task_columns(df: pl.DataFrame) -> pl.DataFrame:
    """``df`` with null ``tests`` / ``entry_point`` added where missing (math frames), in :data:`TASK_COLUMNS` order."""
    missing = [pl.lit(None, dtype=TASK_SCHEMA[c]).alias(c) for c in ("tests", "entry_point") if c not in df.columns]
    return df.with_columns(missing).select([*TASK_COLUMNS, *[c for c in df.columns if c not in TASK_COLUMNS]])


# ---------------------------------------------------------------- user files
def _first_call(tests: Sequence[str], defined: frozenset[str] = frozenset()) -> str | None:
    """The first called name that the reference defines, else the first that is not a builtin,
    e.g. ``f`` in ``assert f(1) == 2`` (``sum`` when the reference defines ``sum``)."""
    called = [node.func.id for src in tests for node in ast.walk(ast.parse(src))
              if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)]
    return next((n for n in called if n in defined), None) or next((n for n in called if not hasattr(builtins, n)),
                                                                  None)


def _vacuous(node: ast.Assert, defined: frozenset[str] = frozenset()) -> bool:
    """An assert that reads no name but builtins (``assert True``, ``assert 1 == 1``): not a test."""
    return not any(isinstance(n, ast.Name) and (n.id in defined or not hasattr(builtins, n.id))
                   for n in ast.walk(node.test))


def _per_assert(stmts: list[ast.stmt], prelude: str = "", defined: frozenset[str] = frozenset()) -> list[str]:
    """One test per top-level ``assert`` (vacuous ones dropped), each preceded by the prelude and the
    statements before it."""
    tests, setup = [], [prelude] if prelude else []
    for s in stmts:
        if isinstance(s, ast.Assert):
            if not _vacuous(s, defined):
                tests.append("\n".join([*setup, ast.unparse(s)]))
        else:
            setup.append(ast.unparse(s))
    return tests


def split_tests(tests: str | Sequence[str], *, entry_point: str | None = None, prelude: str = "",
                defined: Sequence[str] = ()) -> list[str]:
    """Normalise a task's tests to a list of snippets (see the module docstring).

    A list is taken as is (one snippet each). A string is parsed: HumanEval's ``def check(candidate)``
    gives one test per top-level ``assert`` of its body (with the module-level statements and the body's
    earlier statements before it; ``check(<entry_point>)`` as a whole when it has no top-level asserts);
    other code gives one test per top-level ``assert``. A JSON list in a string is a list.  Asserts that
    read no name but builtins (``assert True``) are dropped: they are not tests (names in ``defined``
    and the entry point count as the code's, even when they shadow a builtin).  ``prelude`` (MBPP's
    ``test_setup_code``, helpers of a HumanEval prompt) goes before every test.

    >>> split_tests("def check(candidate):\\n    assert candidate(1) == 2\\n    assert candidate(0) == 1\\n")
    ['assert candidate(1) == 2', 'assert candidate(0) == 1']
    """
    if isinstance(tests, str) and tests.lstrip().startswith("["):
        try:
            tests = json.loads(tests)
        except ValueError:
            pass
    known = frozenset([*defined, *([entry_point] if entry_point else [])])
    prelude = prelude.strip()
    if not isinstance(tests, str):
        out = [t.strip() for t in tests if isinstance(t, str) and t.strip()]
        trees = [ast.parse(t) for t in out]
        ast.parse(prelude)
        return ["\n".join(filter(None, [prelude, t])) for t, tree in zip(out, trees)
                if not (len(tree.body) == 1 and isinstance(tree.body[0], ast.Assert) and _vacuous(tree.body[0], known))]
    tree = ast.parse(tests)
    check = [s for s in tree.body if isinstance(s, ast.FunctionDef) and s.name == "check"]
    if not check:
        return _per_assert(tree.body, prelude, known) or [f"{prelude}\n{tests.strip()}".strip()]
    prelude = "\n".join(filter(None, [prelude, *(ast.unparse(s) for s in tree.body if s is not check[0])]))
    per = _per_assert(check[0].body, prelude, known)
    if per:
        return per
    if entry_point is None:
        msg = "tests define check(candidate) without top-level asserts: an entry_point is needed to call it"
        raise ValueError(msg)
    return [f"{prelude}\n{tests.strip()}\ncheck({entry_point})".strip()]


def _helpers(prompt: str, entry: str | None) -> str:
    """The imports and definitions of a HumanEval prompt other than the entry point's (``poly``,
    ``encode_cyclic``): the judge defines them itself, so the code cannot rig what the tests call."""
    try:
        body = ast.parse(prompt).body
    except SyntaxError:
        return ""
    keep = (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.ClassDef, ast.Assign)
    return "\n".join(ast.unparse(s) for s in body if isinstance(s, keep) and getattr(s, "name", None) != entry)


def _defined(code: str) -> frozenset[str]:
    try:
        return frozenset(s.name for s in ast.parse(code).body if isinstance(s, ast.FunctionDef))
    except SyntaxError:
        return frozenset()


def load_tasks(
    path: str | Path, *, prompt_field: str = "prompt", tests_field: str = "tests",
    entry_point_field: str | None = "entry_point", reference_field: str | None = None, id_field: str | None = None,
    setup_field: str | None = None,
) -> pl.DataFrame:
    """Load coding tasks from JSONL or Parquet into a :data:`TASK_COLUMNS` frame.

    When the prompt does not mention the entry point, ``"The function must be named `f`."`` is
    appended (MBPP prompts do not name it). A reference indented at its first non-blank line
    (HumanEval's ``canonical_solution``, a body) is appended to the prompt to give the full reference
    code, and the prompt's other definitions become the tests' prelude (:func:`_helpers`).
    ``setup_field`` (MBPP ``test_setup_code``) is run before every test.  The entry point, when not
    given, is the first called function the reference defines (even one named like a builtin, ``sum``),
    else the first called non-builtin.

    Raises
    ------
    ValueError
        Unsupported extension, missing column (names the file, column and the available ones), empty
        prompt, no tests, a test that does not parse, no entry point found, duplicate ids
        (each names the file and the 1-based row).
    """
    path = Path(path)
    records = read_user_records(path, [prompt_field, tests_field, reference_field, id_field, setup_field])
    rows, ids = [], set()
    for i, rec in enumerate(records):
        where = f"{path}: row {i + 1} (1-based)"
        prompt = str(rec.get(prompt_field) or "").rstrip()
        if not prompt.strip():
            msg = f"{where} has an empty or null {prompt_field!r}"
            raise ValueError(msg)
        entry = rec.get(entry_point_field) if entry_point_field else None
        raw = rec.get(tests_field)
        raw = list(raw) if hasattr(raw, "__iter__") and not isinstance(raw, str) else raw or ""
        ref = str(rec.get(reference_field) or "") if reference_field else ""
        body = next((line for line in ref.splitlines() if line.strip()), "")[:1] in (" ", "\t")
        if body:
            ref = f"{prompt}\n{ref.lstrip(chr(10))}"
        defined = _defined(ref)
        try:
            entry = entry or _first_call(split_tests(raw, defined=sorted(defined)), defined)
            prelude = "\n".join(filter(None, [str(rec.get(setup_field) or "") if setup_field else "",
                                               _helpers(prompt, entry) if body else ""]))
            tests = split_tests(raw, entry_point=entry, prelude=prelude, defined=sorted(defined))
        except (SyntaxError, ValueError) as e:
            msg = f"{where}: cannot read {tests_field!r}: {type(e).__name__}: {e}"
            raise ValueError(msg) from e
        if not tests:
            msg = f"{where} has no tests in {tests_field!r}"
            raise ValueError(msg)
        if not entry or not str(entry).isidentifier():
            msg = f"{where}: no entry point (set {entry_point_field!r} or call the function in the tests), got {entry!r}"
            raise ValueError(msg)
        question = prompt if entry in prompt else f"{prompt}\n\nThe function must be named `{entry}`."
        pid = f"{path.stem}-{i:06d}" if id_field is None else ("" if rec.get(id_field) is None else str(rec[id_field]))
        if not pid or pid in ids:
            msg = f"{where} has a null or duplicate {id_field!r}: {pid!r}"
            raise ValueError(msg)
        ids.add(pid)
        rows.append({"prompt_id": pid, "question": question, "answer": ref.strip("\n"), "language": "en",
                     "kind": "user", "operation": None, "solution": None, "source": path.name,
                     "tests": tests, "entry_point": entry})
    return pl.DataFrame(rows, schema=TASK_SCHEMA).select(TASK_COLUMNS)
