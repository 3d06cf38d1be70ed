"""Run untrusted Python (model completions) against unit tests, contained; stdlib only.

:func:`run_programs` scores many :class:`Program` s (code + test snippets) and returns one
:class:`Verdict` each (tests passed, a reason from :data:`REASONS`, a detail).
``limits.workers`` *supervisor* processes (``python -I -S`` on :mod:`.sandbox_supervisor`,
clean environment) run at a time, each fed one completion after another and replaced after
``limits.batch_size``; a supervisor forks one child per completion, so one hostile completion
cannot spoil another's verdict.  The code gets the standard library only (no site-packages).

Layout of one supervisor (``root`` mode: the scorer runs as root, as on this project's machines)::

    scorer --Popen(env={}, cwd=/)--> supervisor:  unshare(mount, net, pid, ipc, uts)
                                       | mounts: make / private, remount every mount
                                       | read-only + nosuid, tmpfs on /tmp and /dev/shm,
                                       | empty tmpfs over the scorer's cwd, $HOME and every
                                       | top-level dir but SYSTEM_DIRS (/work, /home, /opt, ...;
                                       | stdlib directories bound back, read-only)
                                       +--fork--> init (pid 1 of the new pid namespace, fresh /proc)
                                                    +--fork--> judge, one per completion: unshare(ipc),
                                                                 reads the program, runs the tests
                                                                 +--fork--> candidate: runs the code,
                                                                            answers the judge's calls

Tests are judged outside the candidate's interpreter (:mod:`grpo_pipeline.sandbox_judge`): the
candidate only computes the values of the calls the tests make and sends them back as plain data;
the judge compares.  The candidate is forked before the judge reads the program (its memory never
holds a test) and gets the code, then one call at a time.  The judge runs as ``uid + 1``, not
dumpable; the candidate is confined as follows.

The candidate, before it runs any completion code: ``chdir`` to an empty ``/tmp/work``; rlimits
``RLIMIT_AS`` (memory_mb), ``RLIMIT_CPU`` (ceil(timeout_s)), ``RLIMIT_FSIZE`` (file_size_mb),
``RLIMIT_NPROC`` (max_processes), ``RLIMIT_NOFILE`` 64, no core files; gid/uid set to a
random unused id (2**30 range, one per supervisor, so ``RLIMIT_NPROC`` counts only its
processes: as root it would not apply); bounding set dropped, ``no_new_privs``; fds 0-2 on /dev/null,
3 and 4 the pipes from and to the judge; environment cleared.  Init waits up to ``timeout_s`` of
wall clock from the moment the judge has the program, longer while the completion is runnable
but has had under 90% of ``timeout_s`` of CPU (a loaded machine must not
fail correct code), at most ``4 timeout_s``; then ``kill(-1, SIGKILL)`` inside the namespace, which kills
judge, candidate and everything it forked (also what called ``setsid``), reaps, and empties
``/tmp/work`` and ``/dev/shm``; the IPC namespace dies with its last process.  The judge's report
(``+``/``-`` per test, then the verdict) is relayed through a fixed buffer zeroed after each
completion, so init, which every later judge and candidate are forked from, keeps no test text.  The
scorer kills a supervisor that gives no verdict within ``4 timeout_s + 10`` s; init then dies
(parent-death signal) and the kernel kills the whole namespace with it.

``userns`` mode (not root, unprivileged user namespaces allowed): the same, inside a new
user namespace that maps the caller to root; instead of a uid change the child drops every
capability (bounding set, securebits ``NOROOT``, ``capset`` to zero, ``no_new_privs``) and
``RLIMIT_NPROC`` is the caller's current process count plus ``max_processes`` (the kernel
counts all of the real user's processes).  With ``require_isolation=False`` and no
namespaces (``none`` mode), only the rlimits, the uid change when root, a session per
completion killed as a process group, and a temporary directory remain: weak, see below.

What it protects against (root and userns modes; the tests in ``tests/test_sandbox.py``
run each one): endless loops and sleeps (wall and CPU limits); memory bombs
(``MemoryError`` under ``RLIMIT_AS``); fork bombs (``RLIMIT_NPROC``; all killed at the end);
writing or deleting files outside the work directory (everything is read-only; the project,
``$HOME``, data sets and any top-level directory outside :data:`SYSTEM_DIRS` are not even visible); big files (``RLIMIT_FSIZE``, size-capped tmpfs);
reading the scorer's environment (cleared, and the scorer's ``/proc`` is not visible);
network access (an empty network namespace: no interface up, abstract Unix sockets
separate); setuid binaries; leftover processes and files.

It also protects against reward hacking (``tests/test_reward_hacking.py``): objects with a rigged
``__eq__``, patched builtins or harness, forged verdicts, reading the hidden tests; and details are
stored safely (:func:`grpo_pipeline.sandbox_judge.safe_text`).

What it does not protect against: reading world-readable files in :data:`SYSTEM_DIRS`
(``/etc``, ``/usr``, ``/var``, world-writable Unix sockets such as the D-Bus system bus); kernel exploits (there is no seccomp filter, the full syscall surface is
open); CPU and memory pressure on the machine within the limits (``workers`` x
``max_processes`` x ``memory_mb`` is the worst case; no cgroup caps the total).  ``none`` mode
protects against loops, memory and file size only: the code has the machine's network and
filesystem (as root: as an unused uid), shares the caller's IPC namespace, and run by a non-root
user it runs as that user and can signal the user's other processes (its judge too).

Example
-------
>>> v = run_programs([Program("def f(x):\\n    return x + 1", ("assert f(1) == 2", "assert f(2) == 4"))])
>>> (v[0].passed, v[0].total, v[0].reason)
(1, 2, 'assertion')
"""

from __future__ import annotations

import json
import os
import secrets
import select
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from grpo_pipeline.config import TestsRewardConfig
from grpo_pipeline.sandbox_judge import safe_text

__all__ = ["REASONS", "SYSTEM_DIRS", "Limits", "Program", "SandboxUnavailable", "Verdict", "hidden_paths", "isolation",
           "run_programs"]

REASONS: dict[str, str] = {
    "ok": "every test passed",
    "syntax_error": "the code does not compile",
    "missing_entry_point": "the code does not define the function the tests call",
    "assertion": "a test's assertion failed",
    "error": "the code or a test raised another exception",
    "timeout": "time limit hit (wall clock, or CPU time on a loaded machine): the process was killed",
    "memory": "MemoryError under the address-space limit",
    "process_limit": "fork / thread creation refused by the process-count limit",
    "file_size": "file-size limit or work-directory space exhausted",
    "forbidden": "an operation the sandbox denies: writing outside the work dir, network, ...",
    "exited": "the code ended the process (sys.exit, os._exit) before the tests finished",
    "crashed": "the process died from a signal (segfault, ...) before the tests finished",
    "test_error": "a test snippet does not compile (a data problem, not the completion's)",
    "sandbox_error": "the sandbox itself failed; no verdict on the code",
}
UID_BASE, UID_SPAN = 1 << 30, 1 << 24  # random uid/gid per supervisor, far from real accounts
_SUPERVISOR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_supervisor.py")


class SandboxUnavailable(RuntimeError):
    """Namespaces cannot be created here and ``require_isolation`` is set."""


_TESTS = TestsRewardConfig()  # defaults: reward.tests in params.yaml (config.py), not values of its own


@dataclass(frozen=True)
class Limits:
    """Per-completion limits and the pool shape (``reward.tests`` in params.yaml)."""

    timeout_s: float = _TESTS.timeout_s          # time per completion (load + all tests), see the module docstring
    memory_mb: int = _TESTS.memory_mb            # RLIMIT_AS of each sandboxed process
    file_size_mb: int = _TESTS.file_size_mb      # RLIMIT_FSIZE; the work tmpfs holds 4x this
    max_processes: int = _TESTS.max_processes    # RLIMIT_NPROC of its uid (the process itself counts)
    workers: int = _TESTS.workers                # supervisors at a time; 0: the usable cores
    batch_size: int = _TESTS.batch_size          # completions per supervisor process, then a fresh one
    require_isolation: bool = _TESTS.require_isolation  # False: without namespaces rlimits only (weak)

    def __post_init__(self) -> None:
        for name, lo in (("timeout_s", 0.01), ("memory_mb", 32), ("file_size_mb", 1), ("max_processes", 1),
                         ("workers", 0), ("batch_size", 1)):
            if getattr(self, name) < lo:
                msg = f"sandbox limit {name} must be >= {lo}, got {getattr(self, name)!r}"
                raise ValueError(msg)


@dataclass(frozen=True)
class Program:
    """Code to test: ``tests`` are snippets (usually one ``assert`` each) run one by one in a
    copy of the code's globals; with ``entry_point`` that function must exist and is also
    bound as ``candidate`` (HumanEval's ``check(candidate)`` style)."""

    code: str
    tests: tuple[str, ...]
    entry_point: str | None = None


@dataclass(frozen=True)
class Verdict:
    passed: int            # tests that passed
    total: int             # tests of the program
    reason: str            # a key of REASONS: "ok" or what stopped / failed first
    detail: str | None = None
    seconds: float = 0.0   # wall time of the completion inside the sandbox


# ============================================================== scorer side
def run_programs(programs: Sequence[Program], *, limits: Limits | None = None) -> list[Verdict]:
    """Run every program in the sandbox; one verdict each, in order (see module docstring).

    ``limits.workers`` threads each drive one supervisor at a time, handing it the next program
    when it answers (so slow programs do not hold up a fixed batch); a supervisor is replaced
    after ``limits.batch_size`` programs, or when it fails (its program gets ``sandbox_error``).

    Raises
    ------
    ValueError
        A program without tests.
    SandboxUnavailable
        No namespaces here and ``limits.require_isolation``.
    """
    limits = limits or Limits()
    for i, p in enumerate(programs):
        if not p.tests:
            msg = f"program {i} has no tests"
            raise ValueError(msg)
    if not programs:
        return []
    isolation(limits)  # fail early, once, with the reason
    todo = iter(range(len(programs)))
    lock = threading.Lock()
    out: list[Verdict | None] = [None] * len(programs)

    def take() -> int | None:
        with lock:
            return next(todo, None)

    def work() -> None:
        done = False
        while not done:
            with _Supervisor(limits) as sup:
                flight: list[int] = []  # sent, no verdict yet: at most 2 (the next one waits in the pipe)
                for _ in range(limits.batch_size):
                    i = None if done else take()
                    done = i is None
                    if i is not None:
                        sup.send(programs[i])
                        flight.append(i)
                    if len(flight) == 2 or (done and flight):
                        j = flight.pop(0)
                        out[j] = sup.receive(programs[j])
                    if done and not flight or sup.failed:
                        break
                for j in flight:
                    out[j] = sup.receive(programs[j])

    workers = min(limits.workers or len(os.sched_getaffinity(0)), len(programs))
    threads = [threading.Thread(target=work, daemon=True) for _ in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out  # type: ignore[return-value]


_ISOLATION: dict[bool, dict] = {}
_FORCE_MODE: str | None = None  # tests only: "userns" (even as root) or "none"


def isolation(limits: Limits | None = None) -> dict:
    """What this machine allows: ``{"mode": "root" | "userns" | "none", "notes": [...]}`` (probed once)."""
    limits = limits or Limits()
    if limits.require_isolation not in _ISOLATION:
        with _Supervisor(limits) as sup:
            hello = sup.hello
        if hello.get("mode") is None:
            msg = (f"sandbox: cannot isolate untrusted code here: {hello.get('error', 'supervisor failed')}. "
                   "Hint: run as root or allow unprivileged user namespaces; or set "
                   "reward.tests.require_isolation: false to run with rlimits only (weak, see grpo_pipeline/sandbox.py)")
            raise SandboxUnavailable(msg)
        _ISOLATION[limits.require_isolation] = hello
    return _ISOLATION[limits.require_isolation]


def _frame(obj: object) -> bytes:
    data = json.dumps(obj).encode()
    return struct.pack("<Q", len(data)) + data


class _Supervisor:
    """One supervisor process (``python -I -S sandbox.py --supervise``), fed one program at a time."""

    def __init__(self, limits: Limits) -> None:
        self.limits, self.failed, self.buf = limits, False, b""
        cfg = {**asdict(limits), "uid": UID_BASE + secrets.randbelow(UID_SPAN), "nproc_base": 0,
               "force": _FORCE_MODE, "hide": hidden_paths()}
        if os.geteuid() != 0 or _FORCE_MODE == "userns":
            cfg["nproc_base"] = _count_processes(os.getuid())
        self.proc = subprocess.Popen([sys.executable, "-I", "-S", _SUPERVISOR, "--supervise"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}, cwd="/",
                                     start_new_session=True)
        self.proc.stdin.write(_frame(cfg))
        self.proc.stdin.flush()
        self.hello = self._line(10.0) or {"error": self.why}

    def _line(self, timeout: float) -> dict | None:
        """The next JSON line from the supervisor, or None (and ``failed``) when it dies or is late."""
        fd, deadline = self.proc.stdout.fileno(), time.monotonic() + timeout
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            chunk = os.read(fd, 65536) if left > 0 and select.select([fd], [], [], left)[0] else None
            if not chunk:
                self.failed = True
                self.why = (f"sandbox supervisor gave no answer within {timeout:.0f}s" if chunk is None
                            else f"sandbox supervisor exited ({self.proc.poll()})")
                return None
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        try:
            obj = json.loads(line)
        except ValueError:
            obj = None
        if not isinstance(obj, dict):
            self.failed, self.why = True, f"sandbox supervisor wrote a bad line: {safe_text(line[:100])}"
            return None
        return obj

    def send(self, program: Program) -> None:
        """Queue ``program`` (the supervisor reads it when it is done with the previous one)."""
        if not self.failed:
            try:
                self.proc.stdin.write(_frame(asdict(program)))
                self.proc.stdin.flush()
            except OSError as e:
                self.failed, self.why = True, f"sandbox supervisor closed its input ({e})"

    def receive(self, program: Program) -> Verdict:
        """The verdict of the oldest program sent (``sandbox_error`` once the supervisor failed)."""
        r = None if self.failed else self._line(4 * self.limits.timeout_s + 10)
        if r is None:
            return Verdict(0, len(program.tests), "sandbox_error", self.why)
        return _checked(r, program) or Verdict(0, len(program.tests), "sandbox_error", "malformed verdict")

    def run(self, program: Program) -> Verdict:
        self.send(program)
        return self.receive(program)

    def __enter__(self) -> _Supervisor:  # noqa: PYI034
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.proc.stdin.close()  # EOF: the supervisor finishes and exits
        except OSError:
            pass
        try:
            self.proc.wait(timeout=0 if self.failed else 5)
        except subprocess.TimeoutExpired:
            self.proc.kill()  # init has a parent-death signal: the namespace dies with it
            self.proc.wait()
        self.proc.stdout.close()


def _checked(r: dict, program: Program) -> Verdict | None:
    """The supervisor's verdict line as a :class:`Verdict` (detail made safe to store), None if malformed."""
    passed, total, reason, detail, seconds = (r.get(k) for k in ("passed", "total", "reason", "detail", "seconds"))
    if (type(passed) is not int or total != len(program.tests) or not 0 <= passed <= total or reason not in REASONS
            or type(seconds) not in (int, float) or (reason == "ok" and passed != total)):
        return None
    return Verdict(passed, total, reason, None if detail is None else safe_text(detail), float(seconds))


#: Top-level directories the code may see (read-only); every other one is hidden (data sets, checkouts, homes).
SYSTEM_DIRS = frozenset({"bin", "sbin", "lib", "lib32", "lib64", "libx32", "usr", "etc", "dev", "proc", "sys", "tmp",
                         "run", "var"})


def hidden_paths() -> list[str]:
    """What the sandbox covers with an empty tmpfs: the scorer's cwd, ``$HOME``, ``/root`` and every top-level
    directory outside :data:`SYSTEM_DIRS` (``/work``, ``/home``, ``/mnt``, ``/opt``, ...); the standard
    library is bound back read-only where it lies below one of them."""
    top = [f"/{d}" for d in os.listdir("/") if d not in SYSTEM_DIRS and os.path.isdir(f"/{d}")
           and not os.path.islink(f"/{d}")]
    paths = sorted({os.getcwd(), os.path.expanduser("~"), "/root", *top} - {"/"})
    return [p for p in paths if not any(p.startswith(q.rstrip("/") + "/") for q in paths)]  # outermost only


def _run_batch(programs: Sequence[Program], limits: Limits) -> tuple[dict, list[Verdict]]:
    """All ``programs`` through one supervisor: its hello line and the verdicts (for tests)."""
    with _Supervisor(limits) as sup:
        return sup.hello, [sup.run(p) for p in programs]


def _count_processes(uid: int) -> int:
    n = 0
    for pid in os.listdir("/proc"):
        try:
            n += pid.isdigit() and os.stat(f"/proc/{pid}").st_uid == uid
        except OSError:
            pass
    return n
