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
import json
import math
import os
import resource
import select
import shutil
import signal
import struct
import sys
import time

_WORK, _CAP = "/tmp/work", 1 << 20  # work dir inside the namespace; bytes read from a child
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


def _read_frame(fd: int = 0) -> dict | None:
    """Exactly one length-prefixed JSON object from ``fd`` (no read-ahead: later items stay in the pipe)."""
    head = _read_exact(fd, 8)
    return None if head is None else json.loads(_read_exact(fd, struct.unpack("<Q", head)[0]) or b"{}")


def _read_exact(fd: int, n: int) -> bytes | None:
    buf = b""
    while len(buf) < n:
        chunk = os.read(fd, n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return buf


def _emit(obj: dict) -> None:
    os.write(1, (json.dumps(obj) + "\n").encode())


def _supervise() -> None:
    cfg = _read_frame()
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
    _emit({"mode": mode, "notes": notes})
    i = 0
    while (item := _read_frame()) is not None:
        _emit({"i": i, **_run_one(item, cfg, mode)})
        i += 1
    os._exit(0)


def _run_one(item: dict, cfg: dict, mode: str) -> dict:
    """Fork the child for one completion, wait with the deadline, kill and clean everything."""
    work = _WORK if mode != "none" else __import__("tempfile").mkdtemp(prefix="grpo-sandbox-")
    os.makedirs(work, mode=0o700, exist_ok=True)
    if os.geteuid() == 0 and mode != "userns":
        os.chown(work, cfg["uid"], cfg["uid"])
    total = len(item["tests"])
    r, w = os.pipe()
    t0 = time.monotonic()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            _child(item, cfg, mode, work, w)
        finally:
            os._exit(70)
    os.close(w)
    item.clear()  # the next child must not find this one's code in memory
    buf, stopped, status = b"", None, None
    pidfd = os.pidfd_open(pid)
    limit = cfg["timeout_s"]
    deadline, cap = t0 + limit, t0 + _WALL_CAP * limit
    while _DONE not in buf:
        left = deadline - time.monotonic()
        if left <= 0:
            if time.monotonic() < cap and _starved(pid, limit, own_proc=mode != "none" and _OWN_PROC[0]):
                deadline += 0.05  # runnable but not yet given its CPU time (a loaded machine): wait on
                continue
            stopped = ("timeout", f"time limit {limit}s (wall {time.monotonic() - t0:.1f}s)")
            break
        if r not in select.select([r], [], [], left)[0]:
            continue
        chunk = os.read(r, 65536)
        buf += chunk[: max(0, _CAP - len(buf))]
        if not chunk:  # every writer closed: the child is exiting (or closed its report pipe)
            break
    if stopped is None and _DONE not in buf:
        if select.select([pidfd], [], [], max(0.0, deadline - time.monotonic()))[0]:
            status = os.waitpid(pid, 0)[1]
        else:
            stopped = ("timeout", f"time limit {limit}s (wall {time.monotonic() - t0:.1f}s)")
    st = _kill_and_reap(pid, mode)
    status = st if status is None else status
    os.close(r), os.close(pidfd)
    shutil.rmtree(work, ignore_errors=True)
    if mode != "none":
        for name in os.listdir("/dev/shm"):
            shutil.rmtree(os.path.join("/dev/shm", name), ignore_errors=True)
    return _verdict(buf, stopped, status, total, time.monotonic() - t0)


_DONE = b'{"done": true}'
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


def _verdict(buf: bytes, stopped: tuple | None, status: int | None, total: int, seconds: float) -> dict:
    passed, first, load = 0, None, None
    for line in buf.split(b"\n"):
        try:
            obj = json.loads(line)
        except ValueError:
            continue
        if isinstance(obj, dict) and "load" in obj:
            load = obj["load"]
        elif isinstance(obj, dict) and "t" in obj:
            if obj.get("fail") is None:
                passed += 1
            elif first is None:
                first = obj["fail"]
    if load:
        return {"passed": 0, "total": total, "reason": load[0], "detail": load[1], "seconds": round(seconds, 4)}
    if stopped is None and _DONE not in buf:
        stopped = _death(status)
    reason, detail = stopped or (("ok", None) if passed >= total else (first or ("error", "a test gave no result")))
    return {"passed": min(passed, total), "total": total, "reason": reason, "detail": detail,
            "seconds": round(seconds, 4)}


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


# ============================================================== child side (one completion)
_RESERVE = [bytearray(1 << 20)]  # freed on MemoryError, so the report can still be written


def _child(item: dict, cfg: dict, mode: str, work: str, w: int) -> None:
    """Confine this process, then run the completion and its tests (see the module docstring)."""
    os.chdir(work)
    os.setsid()
    cpu = math.ceil(cfg["timeout_s"])
    drop_uid = os.geteuid() == 0 and mode != "userns"
    nproc = cfg["max_processes"] + (0 if drop_uid else cfg["nproc_base"])
    for res, value in ((resource.RLIMIT_AS, cfg["memory_mb"] << 20), (resource.RLIMIT_CPU, (cpu, cpu + 1)),
                       (resource.RLIMIT_FSIZE, cfg["file_size_mb"] << 20), (resource.RLIMIT_NOFILE, 64),
                       (resource.RLIMIT_CORE, 0), (resource.RLIMIT_NPROC, nproc)):
        soft, hard = value if isinstance(value, tuple) else (value, value)
        cur = resource.getrlimit(res)[1]
        cap = hard if cur == resource.RLIM_INFINITY else min(hard, cur)
        resource.setrlimit(res, (min(soft, cap), cap))
    if mode == "userns":
        _check(_prctl(28, 0xC3), "securebits")  # PR_SET_SECUREBITS: NOROOT, NO_CAP_AMBIENT_RAISE, locked
    if drop_uid or mode == "userns":
        for cap_no in range(64):
            _prctl(24, cap_no)  # PR_CAPBSET_DROP
    if drop_uid:
        os.setgroups([])
        os.setresgid(cfg["uid"], cfg["uid"], cfg["uid"])
        os.setresuid(cfg["uid"], cfg["uid"], cfg["uid"])  # clears every capability
    elif mode == "userns":
        header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
        _check(_libc.capset(header, (ctypes.c_uint32 * 6)()), "capset")
    _check(_prctl(38, 1), "no_new_privs")  # PR_SET_NO_NEW_PRIVS
    _prctl(1, signal.SIGKILL)  # parent-death signal (cleared by the uid change)
    out = os.dup(w)
    null = os.open("/dev/null", os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.dup2(out, 3)
    os.closerange(4, 1 << 16)
    os.environ.clear()
    os.environ.update({"PATH": "/usr/bin:/bin", "HOME": work, "TMPDIR": work, "LANG": "C.UTF-8"})
    _harness(item, 3)


def _harness(item: dict, out: int) -> None:
    me = os.getpid()

    def report(obj: dict) -> None:
        if os.getpid() != me:  # a fork of the code came back here: it has no say
            os._exit(0)
        os.write(out, (json.dumps(obj) + "\n").encode())

    tests, entry, src = item.pop("tests"), item.pop("entry_point"), item.pop("code")
    ns: dict = {"__name__": "solution", "__builtins__": __builtins__}
    try:
        code = compile(src, "<solution>", "exec")
    except (SyntaxError, ValueError, MemoryError, RecursionError) as e:
        fail = ["syntax_error", _describe(e)]
    else:
        fail = _attempt(code, ns)
    if fail is None and entry and not callable(ns.get(entry)):
        fail = ["missing_entry_point", f"no function {entry!r} defined"]
    if fail is not None:
        ns.clear()
        report({"load": fail})
    else:
        for i, test in enumerate(tests):
            try:
                compiled = compile(test, f"<test {i}>", "exec")
            except (SyntaxError, ValueError) as e:
                report({"t": i, "fail": ["test_error", _describe(e)]})
                continue
            env = dict(ns, candidate=ns[entry]) if entry else dict(ns)
            fail = _attempt(compiled, env)
            env = None
            if fail is not None:
                fail[1] = f"test {i} {test.strip()[:100]!r}: {fail[1]}"
            report({"t": i, "fail": fail})
    report({"done": True})
    os._exit(0)


def _attempt(code: object, env: dict) -> list | None:
    try:
        exec(code, env)  # noqa: S102 - this is the sandbox
    except BaseException as e:  # noqa: BLE001 - every way out is a verdict
        return _classify(e)
    return None


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
