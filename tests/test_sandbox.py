"""grpo_pipeline.sandbox: verdicts, limits and containment of hostile code.

Every hostile program runs under the sandbox's limits; the fork bombs only after a bounded
one (200 forks) has shown the process-count limit holds on this machine.
"""

from __future__ import annotations

import os
import socket
import time
import uuid
from pathlib import Path

import pytest

from grpo_pipeline import sandbox
from grpo_pipeline.sandbox import REASONS, UID_BASE, UID_SPAN, Limits, Program, run_programs

ROOT = Path(__file__).resolve().parent.parent
FAST = Limits(timeout_s=1.0, batch_size=4, max_processes=8, memory_mb=256)
ADD = "def add(a, b):\n    return a + b\n"
ADD_TESTS = ("assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(2, 2) == 4")
CALL = ("assert f() == 1",)  # a test needs a call: it passes when the code loaded


def prog(code: str) -> Program:
    """``code`` (which acts while loading) plus a trivial ``f`` for the one test to call."""
    return Program(code + "\ndef f():\n    return 1\n", CALL)

pytestmark = pytest.mark.skipif(os.name != "posix" or not hasattr(os, "pidfd_open"), reason="Linux only")


def sandbox_pids() -> list[int]:
    """Host processes running as a sandbox uid (there must be none between runs)."""
    out = []
    for p in os.listdir("/proc"):
        try:
            if p.isdigit() and UID_BASE <= os.stat(f"/proc/{p}").st_uid < UID_BASE + UID_SPAN:
                out.append(int(p))
        except OSError:
            pass
    return out


@pytest.fixture(scope="module")
def mode() -> str:
    try:
        return sandbox.isolation()["mode"]
    except sandbox.SandboxUnavailable as e:
        pytest.skip(f"no isolation on this machine: {e}")


# --------------------------------------------------------------------------- verdicts
CASES = [  # (id, code, tests, entry_point, passed, reason)
    ("correct", ADD, ADD_TESTS, "add", 3, "ok"),
    ("wrong", "def add(a, b):\n    return a * b\n", ADD_TESTS, "add", 1, "assertion"),
    ("syntax", "def add(a, b)\n    return a + b\n", ADD_TESTS, "add", 0, "syntax_error"),
    ("null_byte", "x = 1\0", ADD_TESTS, None, 0, "syntax_error"),
    ("timeout", "def add(a, b):\n    while True:\n        pass\n", ADD_TESTS, "add", 0, "timeout"),
    ("timeout_after_one", "def add(a, b):\n    while a < 0:\n        pass\n    return a + b\n", ADD_TESTS, "add", 1,
     "timeout"),
    ("load_loop", "while True:\n    pass\n", ADD_TESTS, None, 0, "timeout"),
    ("sleep", "import time\ntime.sleep(1000)\n", ADD_TESTS, None, 0, "timeout"),
    ("no_entry", "def plus(a, b):\n    return a + b\n", ADD_TESTS, "add", 0, "missing_entry_point"),
    ("raises", "def add(a, b):\n    return a + b + None\n", ADD_TESTS, "add", 0, "error"),
    ("sys_exit", "import sys\nsys.exit(0)\n", ADD_TESTS, None, 0, "exited"),
    ("os_exit_mid", ADD + "import os\ndef boom():\n    os._exit(3)\n", ("assert add(1, 2) == 3", "boom()",
                                                                        "assert add(2, 2) == 4"), "add", 1, "exited"),
    ("segfault", "import ctypes\nctypes.string_at(0)\n", ("pass",), None, 0, "crashed"),
    ("candidate", ADD, ("assert candidate(2, 3) == 5",), "add", 1, "ok"),
    ("bad_test", ADD, ("assert add(1, 2) ==",), "add", 0, "test_error"),
]


@pytest.fixture(scope="module")
def verdicts(mode) -> dict:
    progs = [Program(code, tests, entry) for _, code, tests, entry, _, _ in CASES]
    return dict(zip([c[0] for c in CASES], run_programs(progs, limits=FAST)))


@pytest.mark.parametrize(("case", "passed", "reason"), [(c[0], c[4], c[5]) for c in CASES], ids=[c[0] for c in CASES])
def test_verdicts(verdicts, case, passed, reason):
    v = verdicts[case]
    assert (v.passed, v.reason) == (passed, reason), v
    assert v.total == len(next(c[2] for c in CASES if c[0] == case)) and v.reason in REASONS


def test_timeout_is_enforced_on_time(verdicts):
    for case in ("timeout", "load_loop"):  # a loaded machine may extend these, never past 4x
        # the CPU limit (SIGXCPU) may fire a hair before the wall clock
        assert 0.9 * FAST.timeout_s <= verdicts[case].seconds < 4 * FAST.timeout_s + 0.5, verdicts[case]
    assert FAST.timeout_s <= verdicts["sleep"].seconds < FAST.timeout_s + 1.0, verdicts["sleep"]
    assert verdicts["correct"].seconds < 0.5


def test_starved_means_runnable_and_owed_cpu():
    """The wall clock is extended only for a runnable child that has not had its CPU time."""
    from grpo_pipeline.sandbox_supervisor import _starved

    spin, sleep = os.fork(), None
    if spin == 0:
        while True:
            pass
    try:
        sleep = os.fork()
        if sleep == 0:
            time.sleep(30)
            os._exit(0)
        time.sleep(0.3)
        assert _starved(spin, 100.0) and not _starved(spin, 0.01)  # after 0.3 s it has used over 9 ms
        assert not _starved(sleep, 100.0) and not _starved(1, 100.0)  # sleeping; not our child
    finally:
        for pid in (spin, sleep):
            if pid:
                os.kill(pid, 9)
                os.waitpid(pid, 0)


def test_details_name_the_failure(verdicts):
    assert "test 0" in verdicts["wrong"].detail and "assert add(1, 2) == 3" in verdicts["wrong"].detail
    assert "SyntaxError" in verdicts["syntax"].detail
    assert "'add'" in verdicts["no_entry"].detail
    assert "time limit 1.0s" in verdicts["timeout"].detail
    assert "status 3" in verdicts["os_exit_mid"].detail


def test_empty_and_invalid_inputs():
    assert run_programs([]) == []
    with pytest.raises(ValueError, match="program 0 has no tests"):
        run_programs([Program("x = 1", ())])
    with pytest.raises(ValueError, match="timeout_s must be >= 0.01"):
        Limits(timeout_s=0)


# --------------------------------------------------------------------------- hostile code
@pytest.fixture()
def outside(tmp_path):
    """A visible directory outside the work dir with a file in it (/var/tmp, not hidden, not /tmp)."""
    base = Path("/var/tmp") / f"grpo-sandbox-test-{uuid.uuid4().hex}"
    base.mkdir(mode=0o777)
    os.chmod(base, 0o777)  # even world-writable: only the read-only mount protects it
    (base / "keep.txt").write_text("original")
    yield base
    for p in sorted(base.rglob("*"), reverse=True):
        p.unlink() if p.is_file() else p.rmdir()
    base.rmdir()


def test_memory_bomb_is_stopped(mode):
    bombs = ["x = []\nwhile True:\n    x.append(' ' * 10**6)\n", "x = bytearray(1 << 40)\n",
             "def f():\n    return [0] * (10 ** 10)\n"]
    vs = run_programs([Program(b, ("f()",)) if "def f" in b else prog(b) for b in bombs], limits=FAST)
    assert [v.reason for v in vs] == ["memory"] * 3, vs
    assert all("MemoryError" in v.detail for v in vs)


def test_file_size_limit(mode):
    code = "open('big', 'wb').write(b'x' * (3 << 20))\n"
    (v,) = run_programs([prog(code)], limits=Limits(timeout_s=2, file_size_mb=1))
    assert v.reason == "file_size", v


def test_bounded_fork_bomb_then_unbounded_are_contained(mode):
    if mode == "userns" and os.geteuid() == 0:
        pytest.skip("RLIMIT_NPROC does not apply to a real root")
    bounded = ("import os, time\nfor i in range(200):\n    if os.fork() == 0:\n        time.sleep(60)\n"
               "        os._exit(0)\n")
    (v,) = run_programs([prog(bounded)], limits=FAST)
    assert v.reason == "process_limit" and "Errno 11" in v.detail, v
    assert sandbox_pids() == []  # the 7 sleeping children were killed with the namespace
    bombs = ["import os\nwhile True:\n    os.fork()\n",
             "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n",
             "import threading, time\nwhile True:\n    threading.Thread(target=time.sleep, args=(60,)).start()\n",
             # escape attempt: new sessions, double fork, then keep sleeping
             ("import os, time\nfor i in range(4):\n    if os.fork() == 0:\n        os.setsid()\n"
              "        if os.fork() == 0:\n            time.sleep(60)\n        os._exit(0)\ntime.sleep(0.2)\n")]
    vs = run_programs([prog(b) for b in bombs], limits=FAST)
    assert [v.reason for v in vs] == ["process_limit", "timeout", "process_limit", "ok"], vs
    assert sandbox_pids() == []


def test_writes_and_deletes_outside_are_denied(mode, outside):
    target = outside / "keep.txt"
    progs = {
        "write_outside": f"open({str(outside / 'new.txt')!r}, 'w').write('x')\n",
        "overwrite": f"open({str(target)!r}, 'w').write('changed')\n",
        "delete": f"import os\nos.remove({str(target)!r})\n",
        "rmtree": f"import shutil\nshutil.rmtree({str(outside)!r})\n",
        "chmod": f"import os\nos.chmod({str(target)!r}, 0o777)\n",
        "project": f"open({str(ROOT / f'escape-{uuid.uuid4().hex}.txt')!r}, 'w').write('x')\n",
    }
    vs = dict(zip(progs, run_programs([prog(c) for c in progs.values()], limits=FAST)))
    for name, v in vs.items():
        # denied, or (for a checkout under /tmp, which the sandbox replaces by its own tmpfs) not even visible
        contained = (v.reason == "forbidden" and "filesystem" in v.detail) or (
            name == "project" and v.reason == "error" and "FileNotFoundError" in (v.detail or ""))
        assert contained, (name, v)
    assert target.read_text() == "original" and sorted(p.name for p in outside.iterdir()) == ["keep.txt"]
    assert not list(ROOT.glob("escape-*.txt"))


def test_project_and_home_are_hidden_and_workdir_is_fresh(mode, monkeypatch):
    monkeypatch.chdir(ROOT)
    code = (f"import os\nassert not os.path.exists({str(ROOT)!r}) or os.listdir({str(ROOT)!r}) == []\n"
            f"assert not os.path.exists({str(ROOT / 'pyproject.toml')!r})\n"
            "assert os.listdir('.') == [] and os.getcwd() == os.environ['HOME']\n"
            "open('mine.txt', 'w').write('scratch is fine')\n")
    vs = run_programs([prog(code)] * 2, limits=FAST)  # the 2nd must not see the 1st's file
    assert [v.reason for v in vs] == ["ok", "ok"], vs


def test_parent_environment_is_not_visible(mode, monkeypatch):
    secret = f"s3cr3t-{uuid.uuid4().hex}"
    monkeypatch.setenv("GRPO_FAKE_SECRET", secret)
    search = (f"import os\nfound = [k for k, v in os.environ.items() if {secret!r} in v]\n"
              "for pid in os.listdir('/proc'):\n    if pid.isdigit():\n        try:\n"
              f"            found += [pid] if {secret!r}.encode() in open(f'/proc/{{pid}}/environ', 'rb').read() else []\n"
              "        except OSError:\n            pass\nassert not found, found\n")
    direct = f"print(open('/proc/{os.getpid()}/environ').read())\n"
    vs = run_programs([prog(search), prog(direct)], limits=FAST)
    assert vs[0].reason == "ok", vs[0]  # searched everywhere it can see: no secret
    assert vs[1].reason in ("error", "forbidden") and secret not in (vs[1].detail or ""), vs[1]


def test_network_is_unreachable(mode):
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.1)
    port = server.getsockname()[1]
    progs = ["import socket\nsocket.create_connection(('1.1.1.1', 80), timeout=1)\n",
             f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)\n",
             "import socket\nsocket.getaddrinfo('pypi.org', 443)\n"]
    vs = run_programs([prog(p) for p in progs], limits=FAST)
    assert [v.reason for v in vs] == ["forbidden"] * 3, vs
    assert all("network" in v.detail for v in vs)
    with pytest.raises(TimeoutError):
        server.accept()  # nothing reached the host's loopback
    server.close()


def test_machine_is_untouched(mode):
    mounts = Path("/proc/self/mountinfo").read_text()
    tmp_before = set(os.listdir("/tmp"))
    code = "import os\nopen('/tmp/work/../leak', 'w').write('x')\n"
    # kill(-1) only where the program sees a private pid namespace (init, its judge and itself)
    kill_all = "import os\nif b'sandbox_supervisor' in open('/proc/1/cmdline', 'rb').read():\n    os.kill(-1, 9)\n"
    vs = run_programs([prog(code), prog(kill_all), Program(ADD, ADD_TESTS, "add")], limits=FAST)
    # root mode: the judge runs as another uid, kill(-1) reaches no one; userns mode: it kills the judge (0 reward)
    assert vs[0].reason == "forbidden" and (vs[1].reason, vs[1].passed) in (("ok", 1), ("crashed", 0)), vs
    assert vs[2].reason == "ok", vs  # the next completion keeps its verdict
    assert Path("/proc/self/mountinfo").read_text() == mounts
    assert "leak" not in set(os.listdir("/tmp")) - tmp_before and sandbox_pids() == []


def test_userns_mode_contains_the_same(mode, monkeypatch):
    """The path for non-root users: a user namespace, capabilities dropped instead of a uid change."""
    monkeypatch.setattr(sandbox, "_FORCE_MODE", "userns")
    hello, vs = sandbox._run_batch([
        Program(ADD, ADD_TESTS, "add"),
        prog("while True:\n    pass\n"),
        prog("x = bytearray(1 << 40)\n"),
        prog(f"open({str(ROOT / 'escape.txt')!r}, 'w')\n"),
        prog("import socket\nsocket.create_connection(('1.1.1.1', 80), timeout=1)\n"),
        prog("import ctypes\nassert ctypes.CDLL(None).mount(None, b'/', None, 32 | 4096, None) != 0\n"),
    ], FAST)
    if hello.get("mode") != "userns":
        pytest.skip(f"no user namespaces here: {hello}")
    reasons = [v.reason for v in vs]
    if reasons[3] == "error" and "FileNotFoundError" in (vs[3].detail or ""):  # checkout under /tmp: not visible
        reasons[3] = "forbidden"
    assert reasons == ["ok", "timeout", "memory", "forbidden", "forbidden", "ok"], vs
    assert not (ROOT / "escape.txt").exists()
