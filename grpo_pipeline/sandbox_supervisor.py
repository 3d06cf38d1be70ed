"""The sandbox's supervisor and per-completion child; run as ``python -I -S sandbox_supervisor.py --supervise``.

Started by :class:`grpo_pipeline.sandbox._Supervisor`, never imported by the scorer: stdlib only,
no package imports (``-I -S``: no site-packages, no environment).  Protocol: length-prefixed
JSON frames on stdin (the config, then one program at a time, read with no read-ahead so later
programs stay in the pipe), one JSON line per program on stdout (after a hello line with the
isolation mode).  What each part confines is documented in :mod:`grpo_pipeline.sandbox`.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import importlib.util
import json
import math
import os
import resource
import select
import shutil
import signal
import sys
import time

_WORK, _CAP = "/tmp/work", 1 << 20  # work dir inside the namespace; bytes of one judge report


def _load_judge():  # by path: the package directory must not shadow the stdlib (``io.py``, ``inspect.py``)
    spec = importlib.util.spec_from_file_location(
        "grpo_sandbox_judge", os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_judge.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


_J = _load_judge()
_PRELOAD = ("math", "cmath", "re", "string", "collections", "collections.abc", "itertools", "functools",
            "operator", "heapq", "bisect", "array", "copy", "random", "statistics", "fractions", "decimal",
            "numbers", "datetime", "calendar", "typing", "enum", "hashlib", "textwrap", "unicodedata")
_NET_ERRNOS = {errno.ENETUNREACH, errno.ENETDOWN, errno.EHOSTUNREACH, errno.ECONNREFUSED, errno.EADDRNOTAVAIL}

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
NEWNS, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET = 0x20000, 0x4000000, 0x8000000, 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 2, 4, 8, 32, 4096, 16384, 1 << 18
_MOUNT_FLAGS = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC, "noatime": 1024,
                "nodiratime": 2048, "relatime": 1 << 21, "strictatime": 1 << 24}


def _check(ret: int, what: str) -> None:
    if ret != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"{what}: {os.strerror(e)}")


def _mount(src: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    enc = lambda s: None if s is None else s.encode()
    _check(_libc.mount(enc(src), enc(target), enc(fstype), flags, enc(data)), f"mount {target}")


def _prctl(option: int, arg: int = 0) -> int:
    return _libc.prctl(option, ctypes.c_ulong(arg), ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0))


def _mounts() -> list[tuple[str, int]]:
    """(mount point, per-mount flags to keep) from /proc/self/mountinfo, parents first."""
    out = []
    with open("/proc/self/mountinfo", encoding="utf-8") as fh:
        lines = fh.read().splitlines()
    for line in lines:
        f = line.split()
        point = f[4].encode().decode("unicode_escape")  # \040 for spaces
        out.append((point, sum(_MOUNT_FLAGS.get(o, 0) for o in f[5].split(","))))
    return out


class _NoNamespaces(OSError):
    """unshare itself failed: nothing was changed, running without namespaces is possible."""


def _isolate(cfg: dict) -> tuple[str, list[str]]:
    """Enter fresh namespaces and make the filesystem read-only except the tmpfs work areas.

    Raises :class:`_NoNamespaces` when they cannot be created; any later failure is fatal.
    """
    if cfg["force"] == "none":
        raise _NoNamespaces(errno.EPERM, "namespaces disabled (forced)")
    root = os.geteuid() == 0 and cfg["force"] != "userns"
    uid, gid = os.geteuid(), os.getegid()
    if _libc.unshare(NEWNS | NEWNET | NEWPID | NEWIPC | NEWUTS | (0 if root else NEWUSER)) != 0:
        e = ctypes.get_errno()
        raise _NoNamespaces(e, f"unshare: {os.strerror(e)}")
    if not root:
        for name, text in (("setgroups", "deny"), ("uid_map", f"0 {uid} 1"), ("gid_map", f"0 {gid} 1")):
            with open(f"/proc/self/{name}", "w") as fh:
                fh.write(text)
    _mount(None, "/", None, MS_REC | MS_PRIVATE)  # first: nothing below may propagate to the host
    notes, keep = [], {}
    stdlib = [p for p in sys.path if p and os.path.exists(p)]
    hide = [h for h in cfg["hide"] if os.path.isdir(h) and not any(
        (s + "/").startswith(h.rstrip("/") + "/") for s in ("/tmp", "/proc", "/dev", "/sys", "/usr", "/etc", "/bin"))]
    for s in stdlib:  # stdlib dirs under a hidden dir are bound back (via an O_PATH fd)
        if any(s == h or s.startswith(h.rstrip("/") + "/") for h in hide):
            keep[s] = os.open(s, os.O_PATH)
    for h in hide:
        _mount("tmpfs", h, "tmpfs", MS_NOSUID | MS_NODEV, "size=64k,mode=0755")
    for s, fd in keep.items():
        if os.path.isdir(f"/proc/self/fd/{fd}"):
            os.makedirs(s, exist_ok=True)
        else:
            os.makedirs(os.path.dirname(s), exist_ok=True)
            open(s, "a").close()
        _mount(f"/proc/self/fd/{fd}", s, None, MS_BIND | MS_REC)
        os.close(fd)
    for point, flags in _mounts():
        if point == "/proc" or point.startswith("/proc/"):
            continue
        try:
            _mount(None, point, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | flags)
        except OSError as e:
            if point == "/":
                raise
            notes.append(f"left writable: {point} ({e.strerror})")
    _mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, f"size={4 * cfg['file_size_mb']}m,mode=0755")
    if os.path.isdir("/dev/shm"):
        _mount("tmpfs", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=1m,mode=0755")
    return ("root" if root else "userns"), notes


def _emit(obj: dict) -> None:
    os.write(1, (json.dumps(obj) + "\n").encode())


def _supervise() -> None:
    cfg = _J.read_frame(0)
    _prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: die with the scorer
    try:
        mode, notes = _isolate(cfg)
    except OSError as e:
        if cfg["require_isolation"] or not isinstance(e, _NoNamespaces):
            _emit({"error": str(e)})
            os._exit(3)
        mode, notes = "none", [f"no namespaces ({e}): rlimits only"]
    if mode != "none":
        pid = os.fork()  # the child is pid 1 of the new pid namespace
        if pid:
            _, status = os.waitpid(pid, 0)
            os._exit(os.waitstatus_to_exitcode(status) & 0xFF)
        _prctl(1, signal.SIGKILL)
        try:
            _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
            _OWN_PROC[0] = True
        except OSError as e:
            notes.append(f"host /proc still visible ({e.strerror})")
    for name in _PRELOAD:  # imports the code may need, done while the stdlib is readable
        __import__(name)
    _prctl(4, 0)  # PR_SET_DUMPABLE 0: in userns mode the code's uid is init's; no ptrace, no /proc/1/mem
    _emit({"mode": mode, "notes": notes})
    while _run_one(cfg, mode):
        pass
    os._exit(0)


_BUF = bytearray(_CAP)  # the judge's report, relayed without copies and zeroed after: init keeps no test text
_EOF = 64  # judge exit status: no more programs


def _run_one(cfg: dict, mode: str) -> bool:
    """Fork the judge for the next program, wait with the deadline, relay its verdict (or write one:
    timeout, crash), kill and clean everything.  False when there are no more programs.

    The judge reports on a pipe: ``S<total>;`` once it has the program (the clock starts), ``+`` or
    ``-`` per test, then ``=<verdict JSON>\\n``.  Init never reads the program itself."""
    work = _WORK if mode != "none" else __import__("tempfile").mkdtemp(prefix="grpo-sandbox-")
    os.makedirs(work, mode=0o700, exist_ok=True)
    if os.geteuid() == 0 and mode != "userns":
        os.chown(work, cfg["uid"], cfg["uid"])
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            _judge(cfg, mode, work, w)
        finally:
            os._exit(71)
    os.close(w)
    view, n, t0, stopped, status = memoryview(_BUF), 0, None, None, None
    while t0 is None and (got := os.readv(r, [view[n:]])):
        n += got
        t0 = time.monotonic() if _BUF.find(b";", 0, n) >= 0 else None
    if t0 is None:  # the judge found no program (end of input) or failed before reading one
        status = _kill_and_reap(pid, mode)
        os.close(r)
        shutil.rmtree(work, ignore_errors=True)
        if status is not None and os.WIFEXITED(status) and os.WEXITSTATUS(status) == _EOF:
            return False
        _emit({"error": f"sandbox judge failed before reading a program: {_death(status)[1]}"})
        os._exit(4)
    pidfd = os.pidfd_open(pid)
    limit = cfg["timeout_s"]
    deadline, cap = t0 + limit, t0 + _WALL_CAP * limit
    while _BUF.find(b"\n", 0, n) < 0 and n < _CAP:
        left = deadline - time.monotonic()
        if left <= 0:
            if time.monotonic() < cap and _starved(pid, limit, own_proc=mode != "none" and _OWN_PROC[0]):
                deadline += 0.05  # runnable but not yet given its CPU time (a loaded machine): wait on
                continue
            stopped = ("timeout", f"time limit {limit}s (wall {time.monotonic() - t0:.1f}s)")
            break
        if r not in select.select([r], [], [], left)[0]:
            continue
        got = os.readv(r, [view[n:]])
        if not got:  # the judge is exiting
            break
        n += got
    if stopped is None and _BUF.find(b"\n", 0, n) < 0:
        if select.select([pidfd], [], [], max(0.0, deadline - time.monotonic()))[0]:
            status = os.waitpid(pid, 0)[1]
        else:
            stopped = ("timeout", f"time limit {limit}s (wall {time.monotonic() - t0:.1f}s)")
    st = _kill_and_reap(pid, mode)
    status = st if status is None else status
    os.close(r), os.close(pidfd)
    shutil.rmtree(work, ignore_errors=True)
    if mode != "none":  # the namespace's own tmpfs: in userns mode the code may write anywhere in them
        for d in ("/dev/shm", "/tmp"):
            for name in os.listdir(d):
                path = os.path.join(d, name)
                with _suppress():
                    shutil.rmtree(path, ignore_errors=True) if os.path.isdir(path) and not os.path.islink(path) \
                        else os.unlink(path)
    head = _BUF.find(b";", 0, n)
    eq, nl = _BUF.find(b"=", head, n), _BUF.find(b"\n", head, n)
    if stopped is None and 0 <= eq < nl:
        os.write(1, view[eq + 1: nl + 1])
    else:
        total = int(bytes(view[1:head]))
        reason, detail = stopped or ("crashed", "the judge process died: " + _death(status)[1])
        _emit({"passed": _BUF.count(b"+", head, eq if eq >= 0 else n), "total": total, "reason": reason,
               "detail": detail, "seconds": round(time.monotonic() - t0, 4)})
    view.release()
    _BUF[:n] = bytes(n)
    return True


_WALL_CAP = 4  # wall clock never exceeds this many times timeout_s
_TICK = os.sysconf("SC_CLK_TCK")
_OWN_PROC = [False]  # /proc is this pid namespace's


def _starved(pid: int, limit: float, *, own_proc: bool = False) -> bool:
    """True when the sandbox is runnable but has had under 90% of ``limit`` CPU seconds: the machine
    is busy, not the code slow.  With ``own_proc`` (this pid namespace's /proc) every process of the
    sandbox counts, so a fork bomb's children do not make their parent look starved."""
    running, ticks = False, 0
    for p in [q for q in os.listdir("/proc") if q.isdigit() and q != "1"] if own_proc else [str(pid)]:
        try:
            with open(f"/proc/{p}/stat", "rb") as fh:
                f = fh.read().rsplit(b")", 1)[1].split()  # fields after "(comm)": state, ppid, ...
        except OSError:
            continue
        if not own_proc and int(f[1]) != os.getpid():  # a /proc of another pid namespace
            return False
        running |= f[0] == b"R"
        ticks += sum(int(x) for x in f[11:15])  # utime, stime, cutime, cstime
    return running and ticks / _TICK < 0.9 * limit


def _kill_and_reap(pid: int, mode: str) -> int | None:
    """SIGKILL the child and all it started; return the child's wait status if reaped here."""
    status = None
    if mode == "none":
        with _suppress():
            os.killpg(pid, signal.SIGKILL)
        with _suppress():
            status = os.waitpid(pid, 0)[1]
        return status
    if os.getpid() != 1:  # never kill(-1) outside a private pid namespace
        raise RuntimeError("sandbox: kill(-1) refused: not pid 1 of a private pid namespace")
    while True:
        with _suppress():
            os.kill(-1, signal.SIGKILL)  # every process of this namespace but init
        try:
            got, st = os.waitpid(-1, 0)
        except ChildProcessError:
            return status
        if got == pid:
            status = st


class _suppress:  # contextlib costs an import per supervisor
    def __enter__(self) -> None:
        return None

    def __exit__(self, typ, exc, tb) -> bool:
        return typ is not None and issubclass(typ, OSError)


def _death(status: int | None) -> tuple[str, str]:
    if status is None:
        return "crashed", "no exit status"
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        name = signal.Signals(sig).name if sig in signal.valid_signals() else str(sig)
        if sig == signal.SIGXCPU:
            return "timeout", "CPU time limit (SIGXCPU)"
        if sig == signal.SIGXFSZ:
            return "file_size", "file-size limit (SIGXFSZ)"
        return "crashed", f"killed by {name}" + (" (CPU hard limit or out of memory)" if sig == signal.SIGKILL else "")
    code = os.WEXITSTATUS(status)
    if code == 70:
        return "crashed", "the sandboxed process failed while reporting (often memory exhaustion)"
    return "exited", f"the process exited with status {code} before the tests finished"


# ============================================================== judge and candidate (one completion)
_RESERVE = [bytearray(1 << 20)]  # freed on MemoryError, so the report can still be written


def _judge(cfg: dict, mode: str, work: str, w: int) -> None:
    """The judge (see :mod:`grpo_pipeline.sandbox_judge`): a fresh IPC namespace, the candidate forked
    before the program is read, then the program read, the code sent, itself confined, the tests run."""
    t0 = time.monotonic()
    if mode == "none":
        os.setsid()  # killed as a process group with the candidate
    else:
        _check(_libc.unshare(NEWIPC), "unshare(ipc)")  # SysV shm / queues die with this completion
    req_r, req_w = os.pipe()
    resp_r, resp_w = os.pipe()
    cpid = os.fork()
    if cpid == 0:
        try:
            for fd in (w, req_w, resp_r):
                os.close(fd)
            _child(cfg, mode, work, req_r, resp_w)
        finally:
            os._exit(70)
    os.close(req_r), os.close(resp_w)
    item = _J.read_frame(0)
    if item is None:
        os._exit(_EOF)
    t0 = time.monotonic()
    tests, entry = item["tests"], item["entry_point"]
    os.write(w, b"S%d;" % len(tests))
    null = os.open("/dev/null", os.O_RDWR)
    os.dup2(null, 0), os.dup2(null, 1), os.close(null)
    _confine(cfg, mode, judge=True)  # before any candidate code runs
    try:
        _J.write_frame(req_w, {"code": item["code"], "entry": entry})
    except OSError:
        pass  # the candidate is gone: the first receive says how
    item = None

    def death() -> tuple[str, str]:
        return _death(os.waitpid(cpid, 0)[1])

    link = _J._Link(req_w, resp_r, death)
    try:
        passed, first = _J.judge_tests(tests, entry, link, lambda ok: os.write(w, b"+" if ok else b"-"))
    except _J._Dead as e:
        passed, first = 0, [e.reason, str(e)]
    except MemoryError as e:
        _RESERVE.clear()
        passed, first = 0, ["error", f"the judge ran out of memory ({e})"]
    reason, detail = ("ok", None) if first is None else first
    out = {"passed": passed, "total": len(tests), "reason": reason, "detail": detail,
           "seconds": round(time.monotonic() - t0, 4)}
    os.write(w, b"=" + (json.dumps(out) + "\n").encode())
    os._exit(0)


def _confine(cfg: dict, mode: str, *, judge: bool = False) -> None:
    """rlimits, then the uid change (root mode; the judge gets uid + 1) or every capability dropped
    (userns mode), ``no_new_privs``; the judge is also made non-dumpable (no ptrace, no /proc/pid/mem)."""
    cpu = math.ceil(cfg["timeout_s"]) + (1 if judge else 0)
    drop_uid = os.geteuid() == 0 and mode != "userns"
    nproc = 1 if judge else cfg["max_processes"] + (0 if drop_uid else cfg["nproc_base"])
    memory = cfg["memory_mb"] + (256 if judge else 0)
    for res, value in ((resource.RLIMIT_AS, memory << 20), (resource.RLIMIT_CPU, (cpu, cpu + 1)),
                       (resource.RLIMIT_FSIZE, cfg["file_size_mb"] << 20), (resource.RLIMIT_NOFILE, 64),
                       (resource.RLIMIT_CORE, 0), (resource.RLIMIT_NPROC, nproc)):
        if judge and res == resource.RLIMIT_NPROC and not drop_uid:
            continue  # counted per real user outside a uid change: leave it
        soft, hard = value if isinstance(value, tuple) else (value, value)
        cur = resource.getrlimit(res)[1]
        cap = hard if cur == resource.RLIM_INFINITY else min(hard, cur)
        resource.setrlimit(res, (min(soft, cap), cap))
    if mode == "userns":
        _check(_prctl(28, 0xC3), "securebits")  # PR_SET_SECUREBITS: NOROOT, NO_CAP_AMBIENT_RAISE, locked
    if drop_uid or mode == "userns":
        for cap_no in range(64):
            _prctl(24, cap_no)  # PR_CAPBSET_DROP
    uid = cfg["uid"] + (1 if judge else 0)
    if drop_uid:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)  # clears every capability
    elif mode == "userns":
        header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
        _check(_libc.capset(header, (ctypes.c_uint32 * 6)()), "capset")
    _check(_prctl(38, 1), "no_new_privs")  # PR_SET_NO_NEW_PRIVS
    if judge:
        _check(_prctl(4, 0), "dumpable")  # PR_SET_DUMPABLE 0: the candidate cannot read its memory
    _prctl(1, signal.SIGKILL)  # parent-death signal (cleared by the uid change)


def _child(cfg: dict, mode: str, work: str, rfd: int, wfd: int) -> None:
    """The candidate: confined (module docstring of :mod:`grpo_pipeline.sandbox`), fds 3 (calls in)
    and 4 (answers out) only, then :func:`grpo_pipeline.sandbox_judge.serve_calls`."""
    os.chdir(work)
    if mode != "none":
        os.setsid()
    _confine(cfg, mode)
    fds = [fcntl.fcntl(fd, fcntl.F_DUPFD, 10) for fd in (rfd, wfd)]
    null = os.open("/dev/null", os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.dup2(fds[0], 3), os.dup2(fds[1], 4)
    os.closerange(5, 1 << 16)
    os.environ.clear()
    os.environ.update({"PATH": "/usr/bin:/bin", "HOME": work, "TMPDIR": work, "LANG": "C.UTF-8"})
    _J.serve_calls(3, 4, _classify, _describe)
    os._exit(0)


def _describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"[:300]


def _classify(e: BaseException) -> list:
    """[reason, detail] for an exception raised by the code or a test."""
    if isinstance(e, MemoryError):
        _RESERVE.clear()
        return ["memory", _describe(e)]
    d = _describe(e)
    if isinstance(e, AssertionError):
        return ["assertion", d]
    if isinstance(e, SystemExit):
        return ["exited", d]
    if isinstance(e, RuntimeError) and "can't start new thread" in str(e):
        return ["process_limit", d]
    if isinstance(e, OSError):
        n = e.errno
        if n == errno.EAGAIN:
            return ["process_limit", d]
        if n in (errno.EFBIG, errno.ENOSPC, errno.EDQUOT):
            return ["file_size", d]
        if n in (errno.EACCES, errno.EPERM, errno.EROFS):
            return ["forbidden", f"filesystem/permission: {d}"]
        if n in _NET_ERRNOS or type(e).__name__ in ("gaierror", "herror"):
            return ["forbidden", f"network: {d}"]
        if n in (errno.EMFILE, errno.ENFILE):
            return ["forbidden", f"open-files limit: {d}"]
    return ["error", d]


if __name__ == "__main__" and sys.argv[1:] == ["--supervise"]:
    _supervise()
