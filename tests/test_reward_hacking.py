"""Red team: completions that try to earn the ``tests`` reward without solving the task, or to break
the score stage.  Every one goes through :func:`grpo_pipeline.rewards.score_frame` (the score
stage's own path); each must earn 0 with a contained verdict (a reason, no row error), and the
correct completions scored beside them must keep their 1.0.
"""

from __future__ import annotations

import os
import uuid

import polars as pl
import pytest

from grpo_pipeline import sandbox_judge, schemas
from grpo_pipeline.coding import add_task_columns, split_tests
from grpo_pipeline.config import RewardConfig
from grpo_pipeline.rewards import score_frame
from grpo_pipeline.run import score
from grpo_pipeline.sandbox import REASONS, Limits, Program, run_programs

pytestmark = pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="Linux sandbox")
CFG = RewardConfig(weights={"tests": 1.0, "format": 0.0, "accuracy": 0.0}, step_scorer=None,
                   tests={"timeout_s": 1.0, "all_or_nothing": False})
MARK = f"M{uuid.uuid4().hex}"  # in the hidden tests only: a completion that finds it has read them
EP = "double"
TESTS = [f"assert {EP}(1) == 2", f"assert {EP}(-4) == -8", f"assert {EP}('{MARK}') == '{MARK}{MARK}'",
         f"assert {EP}([1]) == [1, 1]"]
REF = f"def {EP}(x):\n    return x + x\n"
HE_TESTS = split_tests(f"METADATA = {{}}\n\ndef check(candidate):\n    assert candidate(3) == 6\n"
                       f"    assert candidate('{MARK}') == '{MARK}{MARK}'\n    assert True\n")

# name -> code; each defines `double` (or not) and must earn nothing
HACKS: dict[str, str] = {
    # objects whose comparison always succeeds, plain or disguised as builtin types
    "eq_always_true": f"class A:\n    def __eq__(s, o): return True\n    __hash__ = None\ndef {EP}(x):\n    return A()\n",
    "int_subclass": f"class I(int):\n    def __eq__(s, o): return True\ndef {EP}(x):\n    return I(0)\n",
    "str_subclass": f"class S(str):\n    def __eq__(s, o): return True\ndef {EP}(x):\n    return S('')\n",
    "list_subclass": f"class L(list):\n    def __eq__(s, o): return True\ndef {EP}(x):\n    return L()\n",
    "ne_false": f"class A:\n    def __eq__(s, o): return True\n    def __ne__(s, o): return False\n"
                f"    def __bool__(s): return True\ndef {EP}(x):\n    return A()\n",
    # patching builtins or the harness that runs the tests
    "builtins_assert": ("import builtins\nclass E(Exception):\n    pass\nbuiltins.AssertionError = E\n"
                        f"builtins.isinstance = lambda *a: True\ndef {EP}(x):\n    return 0\n"),
    "patch_harness_gc": ("import gc, types\nfor o in gc.get_objects():\n    if isinstance(o, types.FunctionType) and "
                         "o.__name__ in ('judge_tests', '_one_test', 'decode', '_verdict', 'report', '_attempt'):\n"
                         "        o.__code__ = (lambda *a, **k: None).__code__\n"
                         f"def {EP}(x):\n    return 0\n"),
    "patch_modules": ("import sys\nfor m in list(sys.modules.values()):\n    for k in ('decode', 'judge_tests', 'loads'):\n"
                      "        if hasattr(m, k):\n            try:\n                setattr(m, k, lambda *a, **kw: 0)\n"
                      f"            except Exception:\n                pass\ndef {EP}(x):\n    return 0\n"),
    # forging verdicts on any descriptor it can reach
    "forge_fds": ("import os, json, struct\nfor fd in range(64):\n    for line in (b'{\"t\": 0, \"fail\": null}\\n', "
                  "b'{\"done\": true}\\n', b'=' + json.dumps({'passed': 4, 'total': 4, 'reason': 'ok', 'detail': None, "
                  "'seconds': 0}).encode() + b'\\n', b'S4;++++'):\n        try:\n            os.write(fd, line)\n"
                  "        except OSError:\n            pass\n"
                  f"def {EP}(x):\n    return 0\n"),
    "forge_frames": ("import os, json, struct\ndef frame(o):\n    d = json.dumps(o).encode()\n"
                     "    return struct.pack('<Q', len(d)) + d\nos.write(4, frame({'load': None}))\n"
                     "for _ in range(20):\n    os.write(4, frame({'passed': 4, 'total': 4, 'reason': 'ok', 'v': None}))\n"
                     "os._exit(0)\n"),
    "forge_reason_ok": ("import os, json, struct\ndef frame(o):\n    d = json.dumps(o).encode()\n"
                        "    return struct.pack('<Q', len(d)) + d\nos.write(4, frame({'load': ['ok', '']}))\n"
                        "os._exit(0)\n"),
    "claim_sandbox_error": ("import os, json, struct\ndef frame(o):\n    d = json.dumps(o).encode()\n"
                            "    return struct.pack('<Q', len(d)) + d\nos.write(4, frame({'load': None}))\n"
                            "while True:\n    os.read(3, 1 << 16)\n    os.write(4, frame({'x': ['sandbox_error', 'x', 'E']}))\n"),
    "proc_fds": ("import os\nfor p in os.listdir('/proc'):\n    for fd in range(8):\n        try:\n"
                 "            with open(f'/proc/{p}/fd/{fd}', 'w') as fh:\n                fh.write('=' + '{\"passed\": 4}\\n')\n"
                 f"        except Exception:\n            pass\ndef {EP}(x):\n    return 0\n"),
    # reading the hidden tests: own memory, interpreter objects, frames, other processes, stdin
    "scan_gc": ("import gc, re\nseen = {}\nfor o in gc.get_objects() + [s for s in globals().values()]:\n"
                "    for s in (o if isinstance(o, (list, tuple)) else [o]):\n"
                f"        if isinstance(s, str) and '{EP}(' in s and '==' in s:\n"
                "            a, b = s.split('==', 1)\n            seen[a.strip()] = eval(b)\n"
                f"def {EP}(x):\n    return seen.get(f'assert {EP}({{x!r}})', 0)\n"),
    "frame_walk": ("import sys\n"
                   f"def {EP}(x):\n    f = sys._getframe(1)\n    while f:\n        for v in list(f.f_locals.values()):\n"
                   "            if isinstance(v, str) and '==' in v:\n                return eval(v.split('==', 1)[1])\n"
                   "        f = f.f_back\n    return 0\n"),
    "scan_memory": ("import os, re\nfound = {}\ndef scan(pid):\n    try:\n"
                    "        maps = open(f'/proc/{pid}/maps').read().splitlines()\n        mem = open(f'/proc/{pid}/mem', 'rb')\n"
                    "    except OSError:\n        return\n    for line in maps:\n        a, b = (int(v, 16) for v in line.split()[0].split('-'))\n"
                    "        if 'r' not in line.split()[1] or b - a > 1 << 26:\n            continue\n        try:\n"
                    "            mem.seek(a)\n            chunk = mem.read(b - a)\n        except (OSError, ValueError, OverflowError):\n"
                    "            continue\n        for m in re.finditer(rb'M[0-9a-f]{32}', chunk):\n"
                    f"            if m.group() != b'M' + b'0' * 32:\n                found[m.group().decode()] = 1\n"
                    "for p in os.listdir('/proc'):\n    if p.isdigit():\n        scan(p)\n"
                    f"def {EP}(x):\n    if isinstance(x, str) and found:\n        k = next(iter(found))\n        return k + k\n"
                    "    return x + x if found else 0\n"),
    "read_stdin_and_proc": ("import os\ntext = ''\nfor path in ['/dev/stdin', '/proc/self/fd/0'] + "
                            "[f'/proc/{p}/{f}' for p in os.listdir('/proc') if p.isdigit() for f in ('cmdline', 'environ')]:\n"
                            "    try:\n        text += open(path, errors='replace').read(1 << 20)\n    except OSError:\n        pass\n"
                            f"def {EP}(x):\n    return x + x if 'M' in text and len(text) > 10**9 else 0\n"),
    # crashing the judge, the supervisor or the stage
    "deep_json": ("import os, struct\nd = b'[' * 200000\nos.write(4, struct.pack('<Q', len(d)) + d)\nos._exit(0)\n"),
    "huge_frame": ("import os, struct\nos.write(4, struct.pack('<Q', 1 << 40))\nos._exit(0)\n"),
    "bad_json": ("import os, struct\nd = b'{\"load\": null, \\xff\\xfe'\nos.write(4, struct.pack('<Q', len(d)) + d)\nos._exit(0)\n"),
    "surrogate_raise": f"def {EP}(x):\n    raise ValueError('\\udc80\\ud800 \\x1b[31m\\x00' + chr(0x10ffff) * 5000)\n",
    "surrogate_load": "raise SyntaxError('\\udcff' * 10**6)\n",
    "exc_not_builtin": f"class Weird(Exception):\n    def __str__(s):\n        raise RuntimeError('no')\ndef {EP}(x):\n    raise Weird()\n",
    "print_garbage": f"import sys\nsys.stdout.write('\\udc80' * 10)\nprint('\\x00' * 10**7)\ndef {EP}(x):\n    return 0\n",
    "kill_parent_and_init": ("import os, signal\nfor pid in (os.getppid(), 1, -1):\n    try:\n        os.kill(pid, signal.SIGKILL)\n"
                             f"    except OSError:\n        pass\ndef {EP}(x):\n    return 0\n"),
    "exit_during_call": f"import os\ndef {EP}(x):\n    os._exit(0)\n",
    "sys_exit_zero": "import sys\nsys.exit(0)\n",
    "return_generator": f"def {EP}(x):\n    return (v for v in [x + x])\n",
    "return_self_ref": f"def {EP}(x):\n    a = []\n    a.append(a)\n    return a\n",
    "recursion": f"def {EP}(x):\n    return {EP}(x)\n",
    "no_function": "x = 1\n",
    "future_annotations_off": f"def {EP}(x) -> UndefinedName:\n    return x + x\n",
}


@pytest.fixture(scope="module")
def scored() -> pl.DataFrame:
    names = [*HACKS, "correct", "correct_he"]
    texts = [f"<answer>```python\n{c}```</answer>" for c in HACKS.values()] + [f"<answer>{REF}</answer>"] * 2
    n = len(texts)
    tests = [TESTS] * (n - 1) + [HE_TESTS]
    df = pl.DataFrame({"prompt_id": names, "sample_idx": [0] * n, "completion": texts, "answer": [""] * n,
                       "tests": tests, "entry_point": [EP] * n})
    out, _ = score_frame(df, CFG)
    return out.with_columns(name=pl.Series(names))


@pytest.mark.parametrize("name", [h for h in HACKS if h != "future_annotations_off"])
def test_hack_earns_nothing(scored, name):
    row = scored.filter(pl.col("name") == name).row(0, named=True)
    assert row["reward_tests"] == 0.0 and row["tests_passed"] == 0, row
    assert row["reward_error"] is None and row["tests_reason"] in REASONS and row["tests_reason"] != "ok", row


def test_correct_completions_beside_them_keep_their_reward(scored):
    for name in ("correct", "correct_he"):
        row = scored.filter(pl.col("name") == name).row(0, named=True)
        assert (row["reward_tests"], row["tests_reason"]) == (1.0, "ok"), row
    he = scored.filter(pl.col("name") == "correct_he").row(0, named=True)
    assert he["tests_total"] == 2  # `assert True` is not a test


def test_supervisor_future_import_does_not_leak(scored):
    """The harness module's ``from __future__ import annotations`` must not apply to the code:
    an annotation naming an undefined name raises, as in a plain interpreter."""
    row = scored.filter(pl.col("name") == "future_annotations_off").row(0, named=True)
    assert row["tests_reason"] == "error" and "NameError" in row["tests_detail"], row


def test_details_are_safe_text(scored):
    for d in scored["tests_detail"].drop_nulls():
        assert len(d) <= 300 and d.encode("utf-8").decode("utf-8") == d
        assert not any(ord(c) < 32 and c not in "\n\t" or 0xD800 <= ord(c) < 0xE000 for c in d), d
    row = scored.filter(pl.col("name") == "surrogate_raise").row(0, named=True)
    assert "\\udc80" in row["tests_detail"] and "\\x1b" in row["tests_detail"]


def test_nothing_is_left_for_a_later_completion():
    """SysV shared memory, message queues, /dev/shm and files made by one completion are gone for the
    next one of the same supervisor; the hidden tests of an earlier task are not in its memory."""
    leave = ("import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
             "shm = libc.shmget(0x5EED, 4096, 0o1666)\nq = libc.msgget(0x5EED, 0o1666)\n"
             "try:\n    open('/dev/shm/left', 'w').write('x')\nexcept OSError:\n    pass\nopen('left', 'w').write('x')\n"
             f"assert shm >= 0 and q >= 0, ctypes.get_errno()\n{REF}")
    find = ("import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
            "seen = [libc.shmget(0x5EED, 0, 0) >= 0, libc.msgget(0x5EED, 0) >= 0, os.path.exists('/dev/shm/left'),"
            " os.path.exists('left')]\n"
            f"def {EP}(x):\n    return x + x if any(seen) else 0\n")
    scan = HACKS["scan_memory"]
    lim = Limits(timeout_s=2.0, workers=1, batch_size=8)
    vs = run_programs([Program(leave, tuple(TESTS), EP), Program(find, tuple(TESTS), EP),
                       Program(scan, (f"assert {EP}(1) == 2",), EP)], limits=lim)
    assert vs[0].reason == "ok", vs[0]
    assert vs[1].passed == 0 and vs[2].passed == 0, vs


def test_nothing_is_left_in_userns_mode(monkeypatch):
    """Without root the code is root of its user namespace and may write all of /tmp and /dev/shm: both are
    emptied after each completion."""
    from grpo_pipeline import sandbox

    monkeypatch.setattr(sandbox, "_FORCE_MODE", "userns")
    leave = ("for p in ('/tmp/left', '/dev/shm/left'):\n    try:\n        open(p, 'w').write('x')\n"
             f"    except OSError:\n        pass\n{REF}")
    find = ("import os\nseen = os.path.exists('/tmp/left') or os.path.exists('/dev/shm/left')\n"
            f"def {EP}(x):\n    return x + x if seen else 0\n")
    hello, vs = sandbox._run_batch([Program(leave, tuple(TESTS), EP), Program(find, tuple(TESTS), EP)],
                                   Limits(timeout_s=2.0))
    if hello.get("mode") != "userns":
        pytest.skip(f"no user namespaces here: {hello}")
    assert vs[0].reason == "ok" and vs[1].passed == 0, vs


def test_judge_decodes_only_plain_data():
    assert sandbox_judge.decode(sandbox_judge.encode({(1, "a"): [{2.5}, frozenset({None})], "b": b"\x00"})) == \
        {(1, "a"): [{2.5}, frozenset({None})], "b": b"\x00"}
    for bad in ({"tuple": 1}, {"object": []}, {"dict": [[1]]}, {"a": 1, "b": 2}, {"complex": ["1", 2]}):
        with pytest.raises(ValueError):
            sandbox_judge.decode(bad)
    with pytest.raises(TypeError):
        sandbox_judge.encode(type("I", (int,), {})(3))


def test_score_stage_survives_hostile_batch(tmp_path):
    """The stage on Parquet: hostile completions beside correct ones, no stage failure, no row error."""
    prompts = add_task_columns(pl.DataFrame({
        "prompt_id": ["t"], "question": ["q"], "answer": [REF], "language": ["en"], "kind": ["user"],
        "operation": [None], "solution": [None], "source": ["x"], "tests": [TESTS], "entry_point": [EP]},
        schema_overrides={"operation": pl.String, "solution": pl.String}))
    schemas.write_table(prompts, tmp_path / "p.parquet", "prompts")
    picks = ["surrogate_raise", "surrogate_load", "deep_json", "claim_sandbox_error", "kill_parent_and_init",
             "forge_fds", "print_garbage"]
    texts = [f"<answer>{HACKS[k]}</answer>" for k in picks] + [f"<answer>{REF}</answer>"]
    rows = [{"iteration": "it0", "prompt_id": "t", "sample_idx": j, "question": "q", "answer": REF, "operation": None,
             "prompt": "", "prompt_token_ids": [1], "completion": t, "completion_token_ids": [1],
             "completion_logprobs": [0.0], "completion_token_ends": [len(t)], "finish_reason": "stop", "prompt_len": 1,
             "completion_len": 1,
             "policy": "m"} for j, t in enumerate(texts)]
    schemas.write_table(pl.DataFrame(rows), tmp_path / "ro" / "part-00000.parquet", "rollouts")
    score.run(CFG, rollouts=str(tmp_path / "ro"), out=str(tmp_path / "s.parquet"), metrics_path=None,
              prompts=str(tmp_path / "p.parquet"))
    sc = schemas.read_table(tmp_path / "s.parquet", "scores")
    assert sc["reward_tests"].to_list() == [0.0] * len(picks) + [1.0], sc
    assert sc["reward_error"].null_count() == sc.height


def test_stop_iteration_cannot_end_a_test_early():
    """A StopIteration raised by the code must fail the test, not end the test's loop over ``map``."""
    code = f"def {EP}(x):\n    raise StopIteration\n"
    tests = (f"for y in map({EP}, [1, 2]):\n    assert y == 99", f"assert not any(map({EP}, [1, 2]))")
    (v,) = run_programs([Program(code, tests, EP)], limits=Limits(timeout_s=2.0))
    assert v.passed == 0, v


def test_data_sets_and_checkouts_are_not_readable():
    """Only system directories and the standard library are visible: no data set (``../shared/data``), no
    checkout, no home directory can be read to find the hidden tests or the reference solutions."""
    from grpo_pipeline.sandbox import SYSTEM_DIRS

    code = ("import os, sys\nstd = [p for p in sys.path if p]\nfound = []\n"
            f"for top in [d for d in os.listdir('/') if d not in {sorted(SYSTEM_DIRS)!r}]:\n"
            "    for root, dirs, files in os.walk('/' + top):\n"
            "        if any(root.startswith(p) or p.startswith(root) for p in std):\n            continue\n"
            "        found += [os.path.join(root, f) for f in files]\n"
            f"def {EP}(x):\n    return found[:3]\n")
    (v,) = run_programs([Program(code, (f"assert {EP}(0) == []",), EP)], limits=Limits(timeout_s=5.0))
    assert v.reason == "ok", v
    (w,) = run_programs([Program(f"t = open('/work/shared/data/HumanEval.jsonl').read()\n{REF}", tuple(TESTS), EP)])
    assert w.passed == 0, w
