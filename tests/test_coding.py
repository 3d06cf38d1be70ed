"""Coding tasks (grpo_pipeline.coding), the `tests` reward (rewards/code.py), and their stage wiring."""

from __future__ import annotations

import json
import os

import polars as pl
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from grpo_pipeline import schemas, template
from grpo_pipeline.coding import FAMILIES, TASK_COLUMNS, add_task_columns, generate_tasks, load_tasks, split_tests
from grpo_pipeline.config import DataConfig, Params, RewardConfig, check_names
from grpo_pipeline.data import generate_problems
from grpo_pipeline.rewards import code as code_reward
from grpo_pipeline.rewards import score_frame
from grpo_pipeline.rewards.code import extract_code
from grpo_pipeline.run import prepare, score
from grpo_pipeline.sandbox import Program, run_programs

TESTS = RewardConfig(weights={"tests": 1.0, "format": 0.0, "accuracy": 0.0}, step_scorer=None)
needs_sandbox = pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="Linux sandbox")


@pytest.fixture(scope="module")
def tasks() -> pl.DataFrame:
    return generate_tasks(n=48, seed=3)


# --------------------------------------------------------------------------- generator
def test_generated_frame_shape_and_balance(tasks):
    assert tasks.columns == TASK_COLUMNS
    assert tasks.schema["tests"] == pl.List(pl.String) and tasks.schema["entry_point"] == pl.String
    assert tasks["kind"].value_counts()["count"].to_list() == [48 // len(FAMILIES)] * len(FAMILIES)
    assert tasks["question"].n_unique() == 48 and tasks["prompt_id"].to_list()[:2] == ["code-000000", "code-000001"]
    assert (tasks["tests"].list.len() == 5).all() and tasks["operation"].is_null().all()
    for q, e in tasks.select("question", "entry_point").iter_rows():
        assert f"`{e}(" in q and "Example:" in q


@given(seed=st.integers(0, 10_000))
@settings(max_examples=15, deadline=None)
def test_generator_is_seeded(seed):
    a, b = generate_tasks(n=6, seed=seed), generate_tasks(n=6, seed=seed)
    assert a.equals(b)
    assert not a.equals(generate_tasks(n=6, seed=seed + 1))


def test_example_in_question_matches_reference(tasks):
    for row in tasks.iter_rows(named=True):
        call, shown = row["question"].split("Example: `")[1].split("` returns `")
        scope: dict = {}
        exec(row["answer"], scope)  # noqa: S102 - our own reference code
        assert repr(eval(call, scope)) == shown.rstrip("`.")


def test_hidden_tests_differ_from_the_example(tasks):
    for row in tasks.iter_rows(named=True):
        call = row["question"].split("Example: `")[1].split("`")[0]
        assert all(not t.startswith(f"assert {call} ==") for t in row["tests"])


@needs_sandbox
def test_references_pass_and_a_constant_fails_in_the_sandbox(tasks):
    progs = [Program(a, tuple(t), e) for a, t, e in tasks.select("answer", "tests", "entry_point").iter_rows()]
    wrong = [Program(f"def {p.entry_point}(*args):\n    return None\n", p.tests, p.entry_point) for p in progs]
    vs = run_programs(progs + wrong)
    assert [v.reason for v in vs[: len(progs)]] == ["ok"] * len(progs)
    assert all(v.passed < v.total for v in vs[len(progs):])


def test_unknown_family_lists_valid_ones():
    with pytest.raises(ValueError, match=r"Unknown coding task families \['sort'\].*'add_k'"):
        generate_tasks(n=2, families=["sort"])
    with pytest.raises(ValueError, match=r"data.coding_kinds: unknown name\(s\) \['sort'\]; registered: .*'add_k'"):
        check_names(Params(data=DataConfig(task="coding", coding_kinds=["sort"])), ["data"])


# --------------------------------------------------------------------------- HumanEval / MBPP tests
@pytest.mark.parametrize(("tests", "entry", "expected"), [
    (["assert f(1) == 2", " assert f(2) == 3 "], None, ["assert f(1) == 2", "assert f(2) == 3"]),
    ('["assert f(1) == 2"]', None, ["assert f(1) == 2"]),
    ("assert f(1) == 2\nassert f(2) == 3\n", None, ["assert f(1) == 2", "assert f(2) == 3"]),
    ("import math\nx = f(4)\nassert x == 2\nassert f(9) == 3\n", None,
     ["import math\nx = f(4)\nassert x == 2", "import math\nx = f(4)\nassert f(9) == 3"]),
    ("METADATA = {}\n\ndef check(candidate):\n    assert candidate(1) == 2\n    y = 3\n    assert candidate(y) == 4\n",
     "f", ["METADATA = {}\nassert candidate(1) == 2", "METADATA = {}\ny = 3\nassert candidate(y) == 4"]),
    ("def check(candidate):\n    for i in range(3):\n        assert candidate(i) == i + 1\n", "f",
     ["def check(candidate):\n    for i in range(3):\n        assert candidate(i) == i + 1\ncheck(f)"]),
    ("for i in range(3):\n    assert f(i) == i + 1\n", None, ["for i in range(3):\n    assert f(i) == i + 1"]),
], ids=["list", "json-list", "asserts", "setup", "humaneval", "humaneval-loop", "loop"])
def test_split_tests(tests, entry, expected):
    assert split_tests(tests, entry_point=entry) == expected


def test_split_tests_errors():
    with pytest.raises(ValueError, match="entry_point is needed"):
        split_tests("def check(candidate):\n    for i in range(3):\n        assert candidate(i)\n")
    with pytest.raises(SyntaxError):
        split_tests(["assert f(1) =="])


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


HUMANEVAL = {"task_id": "HumanEval/0", "entry_point": "inc",
             "prompt": 'def inc(x: int) -> int:\n    """Return x + 1."""\n',
             "canonical_solution": "    return x + 1\n",
             "test": "def check(candidate):\n    assert candidate(1) == 2\n    assert candidate(-1) == 0\n"}
MBPP = {"task_id": 2, "text": "Write a function to find the shared elements of two lists.",
        "code": "def similar_elements(a, b):\n    return tuple(sorted(set(a) & set(b)))",
        "test_list": ["assert similar_elements((3, 4, 5), (5, 7, 4)) == (4, 5)",
                      "assert similar_elements((1, 2), (3,)) == ()"]}


@needs_sandbox
def test_load_humaneval_and_mbpp_styles(tmp_path):
    he = load_tasks(write_jsonl(tmp_path / "he.jsonl", [HUMANEVAL]), tests_field="test",
                    reference_field="canonical_solution")
    mb = load_tasks(write_jsonl(tmp_path / "mbpp.jsonl", [MBPP]), prompt_field="text", tests_field="test_list",
                    reference_field="code")
    assert he.columns == mb.columns == TASK_COLUMNS
    assert he["answer"][0] == HUMANEVAL["prompt"] + HUMANEVAL["canonical_solution"].rstrip("\n")
    assert he["tests"][0].to_list() == ["assert candidate(1) == 2", "assert candidate(-1) == 0"]
    assert mb["entry_point"][0] == "similar_elements"  # inferred from the first test
    assert mb["question"][0].endswith("The function must be named `similar_elements`.")
    assert he["question"][0] == HUMANEVAL["prompt"].rstrip() and he["kind"][0] == "user"
    both = pl.concat([he, mb])
    vs = run_programs([Program(a, tuple(t), e) for a, t, e in both.select("answer", "tests", "entry_point").iter_rows()])
    assert [v.reason for v in vs] == ["ok", "ok"]
    pl.DataFrame([MBPP]).write_parquet(tmp_path / "mbpp.parquet")
    assert load_tasks(tmp_path / "mbpp.parquet", prompt_field="text", tests_field="test_list",
                      reference_field="code")["tests"].equals(mb["tests"])


@pytest.mark.parametrize(("rows", "kwargs", "match"), [
    ([{"q": "x"}], {}, r"column 'prompt' not found. Available columns: \['q'\]"),
    ([{"prompt": "p", "tests": []}], {}, r"row 1 \(1-based\) has no tests"),
    ([{"prompt": "p", "tests": ["assert f(1) =="]}], {}, r"row 1 \(1-based\): cannot read 'tests': SyntaxError"),
    ([{"prompt": "p", "tests": ["x = [1]\nassert len(x) == 1"]}], {}, r"row 1 \(1-based\): no entry point"),
    ([{"prompt": "p", "tests": ["assert True", "assert 1 == 1"]}], {}, r"row 1 \(1-based\) has no tests"),
    ([{"prompt": "p", "tests": ["assert f(1)"]}, {"prompt": " ", "tests": ["assert f(1)"]}], {},
     r"row 2 \(1-based\) has an empty or null 'prompt'"),
    ([{"prompt": "p", "tests": ["assert f(1)"], "id": "a"}] * 2, {"id_field": "id"}, r"row 2 .*duplicate 'id'"),
], ids=["column", "no-tests", "syntax", "entry", "vacuous", "empty-prompt", "dup-id"])
def test_load_errors_name_file_row_and_column(tmp_path, rows, kwargs, match):
    path = write_jsonl(tmp_path / "user.jsonl", rows)
    with pytest.raises(ValueError, match=match):
        load_tasks(path, **kwargs)


# --------------------------------------------------------------------------- prompts files
def test_math_frames_get_null_task_columns_and_write(tmp_path):
    df = add_task_columns(generate_problems(n=4, seed=0))
    assert df.columns == TASK_COLUMNS and df["tests"].is_null().all() and df["entry_point"].is_null().all()
    schemas.write_table(df, tmp_path / "p.parquet", "prompts")
    back = schemas.read_table(tmp_path / "p.parquet", "prompts")
    assert back.schema["tests"] == pl.List(pl.String) and back.height == 4


@pytest.mark.parametrize("task", ["math", "coding"])
def test_prepare_writes_both_task_kinds(tmp_path, task):
    cfg = DataConfig(task=task, n_train=10, n_eval=2)
    m = prepare.run(cfg, train_out=str(tmp_path / "train.parquet"), eval_out=str(tmp_path / "eval.parquet"))
    train = schemas.read_table(tmp_path / "train.parquet", "prompts")
    assert m["train"] == train.height == 10
    assert train["tests"].is_not_null().all() == (task == "coding")


# --------------------------------------------------------------------------- template
def test_coding_instruction_shares_the_format():
    coding = template.messages("Write f.", task="coding")
    assert coding[0]["content"] == template.CODING_SYSTEM_PROMPT and template.messages("1+1?")[0]["content"] == \
        template.SYSTEM_PROMPT
    assert "<answer>" in template.CODING_SYSTEM_PROMPT and "<think>" in template.CODING_SYSTEM_PROMPT
    assert template.task_of(["assert f()"]) == "coding" and template.task_of(None) == "math"
    with pytest.raises(ValueError, match=r"Unknown task 'poetry'.*\['math', 'coding'\]"):
        template.system_prompt("poetry")


# --------------------------------------------------------------------------- reward
@pytest.mark.parametrize(("completion", "code"), [
    ("<think>t</think><answer>```python\nx = 1\n```</answer>", "x = 1\n"),
    ("<answer>```\nx = 1\n```</answer>", "x = 1\n"),
    ("<answer>Here it is:\n```py\nx = 1\n```\nDone.</answer>", "x = 1\n"),
    ("<answer>```python\nx = 1\n```\n```python\ny = 2\n```</answer>", "x = 1\n"),
    ("<answer>```python\nx = 1</answer>", "x = 1"),
    ("<answer>x = 1</answer>", "x = 1"),
    ("<answer>  </answer>", None),
    ("x = 1", None),
    ("<answer>a</answer><answer>b</answer>", None),
], ids=["fenced", "bare-fence", "prose", "two-fences", "unclosed", "plain", "empty", "no-tags", "two-answers"])
def test_extract_code(completion, code):
    assert extract_code(pl.Series([completion])).to_list() == [code]


def completions(task: dict, texts: list[str]) -> pl.DataFrame:
    return pl.DataFrame({"prompt_id": [task["prompt_id"]] * len(texts), "sample_idx": list(range(len(texts))),
                         "completion": texts, "answer": [task["answer"]] * len(texts),
                         "tests": [task["tests"]] * len(texts), "entry_point": [task["entry_point"]] * len(texts)})


@needs_sandbox
@pytest.mark.parametrize("all_or_nothing", [False, True])
def test_tests_reward_values_and_reasons(tasks, all_or_nothing):
    task = tasks.filter(pl.col("kind") == "add_k").row(0, named=True)
    ep, ref = task["entry_point"], task["answer"]
    half = f"def {ep}(xs):\n    return xs if len(xs) % 2 else [x + 1000 for x in xs]\n"
    texts = [f"<think>x</think><answer>```python\n{ref}\n```</answer>", f"<answer>{half}</answer>",
             f"<answer>def {ep}(xs) return</answer>", f"<answer>def {ep}(xs):\n    while True: pass</answer>",
             "no answer"]
    cfg = RewardConfig(weights={"tests": 1.0}, step_scorer=None, tests={"all_or_nothing": all_or_nothing,
                                                                        "timeout_s": 1.0})
    out, metrics = score_frame(completions(task, texts), cfg)
    n_half = run_programs([Program(half, tuple(task["tests"]), ep)])[0].passed
    share = n_half / len(task["tests"])
    expect_half = float(share == 1.0) if all_or_nothing else share
    assert out["reward_tests"].to_list() == [1.0, expect_half, 0.0, 0.0, 0.0]
    assert out["tests_reason"].to_list()[0] == "ok" and out["tests_reason"].to_list()[2:] == \
        ["syntax_error", "timeout", "no_code"]
    assert out["tests_total"].to_list() == [5] * 5 and out["tests_passed"][0] == 5
    assert out["reward"].to_list() == out["reward_tests"].to_list() and metrics["rewards/tests/errors"] == 0


@needs_sandbox
def test_math_rows_are_not_applicable_and_duplicates_run_once(tasks, monkeypatch):
    task = tasks.row(0, named=True)
    df = completions(task, [f"<answer>{task['answer']}</answer>"] * 3)
    df = pl.concat([df, df.head(1).with_columns(tests=None, entry_point=None, sample_idx=pl.lit(3, pl.Int64))])
    seen = []
    real = code_reward.run_programs
    monkeypatch.setattr(code_reward, "run_programs", lambda progs, **kw: seen.append(len(progs)) or real(progs, **kw))
    out, _ = score_frame(df, RewardConfig(weights={"format": 1.0}, step_scorer=None))
    assert seen == [1]  # three identical completions, one sandbox run
    assert out["reward_tests"].to_list() == [1.0, 1.0, 1.0, None] and out["reward_error"].null_count() == 4
    assert out["tests_reason"].to_list() == ["ok", "ok", "ok", None]


def test_tests_rule_is_opt_in():
    df = pl.DataFrame({"prompt_id": ["p"], "sample_idx": [0], "completion": ["<answer>1</answer>"], "answer": ["1"]})
    out, _ = score_frame(df, RewardConfig(step_scorer=None))
    assert "reward_tests" not in out.columns and "tests_reason" not in out.columns
    with pytest.raises(ValueError, match="reward.weights.tests is not 0 but the frame has no 'tests' column"):
        score_frame(df, TESTS)


@needs_sandbox
def test_score_stage_joins_tests_from_prompts(tmp_path, tasks):
    prompts = add_task_columns(tasks.head(2))
    schemas.write_table(prompts, tmp_path / "train.parquet", "prompts")
    rows = []
    for k, p in enumerate(prompts.iter_rows(named=True)):
        for j, text in enumerate([f"<think>a</think><answer>{p['answer']}</answer>", "<answer>x = (</answer>"]):
            rows.append({"iteration": "it0", "prompt_id": p["prompt_id"], "sample_idx": j, "question": p["question"],
                         "answer": p["answer"], "operation": None, "prompt": "", "prompt_token_ids": [1],
                         "completion": text, "completion_token_ids": [1], "completion_logprobs": [0.0], "completion_token_ends": [len(text)],
                         "finish_reason": "stop", "prompt_len": 1, "completion_len": 1, "policy": "m"})
    schemas.write_table(pl.DataFrame(rows), tmp_path / "ro" / "part-00000.parquet", "rollouts")
    m = score.run(TESTS, rollouts=str(tmp_path / "ro"), out=str(tmp_path / "s.parquet"), metrics_path=None,
                  prompts=str(tmp_path / "train.parquet"))
    sc = schemas.read_table(tmp_path / "s.parquet", "scores")
    assert sc["reward_tests"].to_list() == [1.0, 0.0, 1.0, 0.0]
    assert sc["tests_reason"].to_list() == ["ok", "syntax_error"] * 2 and sc.schema["tests_passed"] == pl.Int32
    assert m["tests/reason/ok"] == 2 and m["tests/reason/syntax_error"] == 2 and m["tests/mean"] == 0.5
    schemas.write_table(prompts.tail(1), tmp_path / "other.parquet", "prompts")
    with pytest.raises(ValueError, match=r"other.parquet: no prompt 'code-000000'.*Hint"):
        score.run(TESTS, rollouts=str(tmp_path / "ro"), out=str(tmp_path / "s2.parquet"), metrics_path=None,
                  prompts=str(tmp_path / "other.parquet"))


@needs_sandbox
def test_load_mbpp_builtin_name_setup_code_and_ids(tmp_path):
    """MBPP rows: a function named like a builtin (`sum`), `test_setup_code`, integer ids, `assert True`."""
    rows = [{"task_id": 7, "text": "Add two numbers.", "code": "def sum(a, b):\n    return a + b",
             "test_list": ["assert sum(1, 2) == 3", "assert True"], "test_setup_code": ""},
            {"task_id": 8, "text": "Scale by K.", "code": "def scale(x):\n    return x * K",
             "test_list": ["assert scale(2) == 6"], "test_setup_code": "K = 3"}]
    df = load_tasks(write_jsonl(tmp_path / "mbpp.jsonl", rows), prompt_field="text", tests_field="test_list",
                    reference_field="code", id_field="task_id", setup_field="test_setup_code")
    assert df["prompt_id"].to_list() == ["7", "8"] and df["entry_point"].to_list() == ["sum", "scale"]
    assert df["tests"].to_list() == [["assert sum(1, 2) == 3"], ["K = 3\nassert scale(2) == 6"]]
    code = ["def sum(a, b):\n    return a + b", "K = 3\ndef scale(x):\n    return x * K", "def sum(a, b):\n    return 0"]
    vs = run_programs([Program(c, tuple(t), e) for c, (t, e) in
                       zip(code, [*df.select("tests", "entry_point").iter_rows(), ("assert sum(1, 2) == 3", "sum")])])
    assert [v.reason for v in vs[:2]] == ["ok", "ok"] and vs[2].passed == 0  # the judge calls the code's `sum`


def test_humaneval_reference_after_blank_lines_and_prompt_helpers(tmp_path):
    """HumanEval/81 style: the canonical body starts with a blank line; helpers of the prompt go to the tests."""
    row = {"task_id": "HumanEval/x", "entry_point": "g",
           "prompt": "def helper(x):\n    return x * 2\n\n\ndef g(x):\n    \"\"\"Doc.\"\"\"\n",
           "canonical_solution": "\n   \n    return helper(x) + 1\n",
           "test": "def check(candidate):\n    assert candidate(1) == helper(1) + 1\n"}
    df = load_tasks(write_jsonl(tmp_path / "he.jsonl", [row]), tests_field="test", reference_field="canonical_solution")
    compile(df["answer"][0], "<ref>", "exec")
    assert df["tests"][0].to_list() == ["def helper(x):\n    return x * 2\nassert candidate(1) == helper(1) + 1"]
