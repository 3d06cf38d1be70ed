"""The sandbox's judge and candidate sides: tests judged outside the candidate's interpreter.

Stdlib only; loaded by :mod:`grpo_pipeline.sandbox_supervisor` (by file path) and importable by
the scorer.  For one completion the supervisor's init forks the **judge**; the judge enters a
fresh IPC namespace and forks the **candidate** *before* it reads the program, so the
candidate's memory never holds a test.  Then:

- the candidate (confined by the supervisor: rlimits, uid, no fds but two pipes) receives the
  code and the entry point only, runs the code and then answers calls: ``{"f": name, "a": args,
  "k": kwargs}`` -> ``{"v": value}`` or ``{"x": [reason, detail, exception type]}``.
- the judge (a different uid, not dumpable, no candidate code ever runs in it) runs each test
  snippet in a fresh namespace of its own: its builtins, the stdlib modules of ``_MODULES``, and a
  *stub* for every free name of the test (the entry point, ``candidate``, helpers the code
  defines).  A stub sends the call's arguments (plain data) and gets back a plain value, decoded
  by :func:`decode` into new objects of exact builtin types.  So ``==``, ``assert``, ``isclose``
  ... are the judge's own: the candidate cannot patch them, return objects with a rigged
  ``__eq__``, forge a verdict (it has no fd to the verdict channel) or read the tests.

A test passes when it runs to the end *and* called the code at least once (``assert True`` is not a
test).  What the candidate sees: the arguments of each call, in test order (not the expected
values, not the test text).  Not supported (the test fails or is a ``test_error``): arguments or
results that are not plain data (int, float, complex, str, bytes, bool, None, list, tuple, dict,
set, frozenset), tests relying on the code mutating an argument, and tests reading the code's
non-callable globals.
"""

from __future__ import annotations

import ast
import builtins
import json
import os
import struct

__all__ = ["CANDIDATE_REASONS", "decode", "encode", "free_names", "judge_tests", "read_frame", "safe_text",
           "serve_calls", "write_frame"]

#: Reasons a candidate may report for its own failure (never "ok", "sandbox_error", "test_error").
CANDIDATE_REASONS = frozenset({"syntax_error", "missing_entry_point", "assertion", "error", "timeout", "memory",
                               "process_limit", "file_size", "forbidden", "exited", "crashed"})
MAX_FRAME = 8 << 20  # bytes of one message between judge and candidate
_MAX_DEPTH = 64
_MODULES = ("math", "cmath", "re", "string", "collections", "itertools", "functools", "operator", "heapq",
            "bisect", "copy", "random", "statistics", "fractions", "decimal", "datetime", "typing", "hashlib")
# builtin exceptions the code's can become in the judge (so ``except ValueError`` in a test works); never
# StopIteration: raised through ``map`` it would end a test's loop early instead of failing it
_EXCEPTIONS = {n: getattr(builtins, n) for n in dir(builtins)
               if isinstance(getattr(builtins, n), type) and issubclass(getattr(builtins, n), Exception)
               and not issubclass(getattr(builtins, n), (StopIteration, StopAsyncIteration))}


# ---------------------------------------------------------------- plain data <-> JSON
def encode(x: object, depth: int = 0) -> object:
    """JSON-able form of plain data: scalars by exact type (a subclass of ``int`` or ``str`` is
    refused); containers by their contents (a ``Counter`` or a named tuple becomes a plain ``dict``
    or ``tuple``: whatever the candidate's classes do, the judge only ever sees :func:`decode` output).

    >>> encode((1, [2.5, None], {"a": {3}}))
    {'tuple': [1, [2.5, None], {'dict': [['a', {'set': [3]}]]}]}
    """
    t = type(x)
    if depth > _MAX_DEPTH:
        raise ValueError("nested too deeply")
    if x is None or t is bool or t is int or t is float or t is str:
        return x
    if isinstance(x, list):
        return [encode(v, depth + 1) for v in list.__iter__(x)]
    if isinstance(x, (tuple, set, frozenset)):
        tag = next(k for k in (tuple, frozenset, set) if isinstance(x, k)).__name__
        return {tag: [encode(v, depth + 1) for v in x]}
    if isinstance(x, dict):
        return {"dict": [[encode(k, depth + 1), encode(v, depth + 1)] for k, v in dict.items(x)]}
    if t is bytes:
        return {"bytes": x.hex()}
    if t is complex:
        return {"complex": [x.real, x.imag]}
    raise TypeError(f"not plain data: {t.__name__}")


def decode(x: object, depth: int = 0) -> object:
    """Inverse of :func:`encode` on ``json.loads`` output; anything else raises ``ValueError``."""
    t = type(x)
    if depth > _MAX_DEPTH:
        raise ValueError("nested too deeply")
    if x is None or t is bool or t is int or t is float or t is str:
        return x
    if t is list:
        return [decode(v, depth + 1) for v in x]
    if t is dict and len(x) == 1:
        ((tag, v),) = x.items()
        if tag in ("tuple", "set", "frozenset") and type(v) is list:
            return {"tuple": tuple, "set": set, "frozenset": frozenset}[tag](decode(e, depth + 1) for e in v)
        if tag == "dict" and type(v) is list and all(type(p) is list and len(p) == 2 for p in v):
            return {decode(k, depth + 1): decode(e, depth + 1) for k, e in v}
        if tag == "bytes" and type(v) is str:
            return bytes.fromhex(v)
        if tag == "complex" and type(v) is list and len(v) == 2 and all(type(e) in (int, float) for e in v):
            return complex(v[0], v[1])
    raise ValueError(f"not plain data: {str(x)[:60]!r}")


def write_frame(fd: int, obj: object) -> None:
    """One length-prefixed JSON message (``ensure_ascii``: any string survives)."""
    data = json.dumps(obj).encode()
    view = memoryview(struct.pack("<Q", len(data)) + data)
    while view:
        view = view[os.write(fd, view):]


def read_frame(fd: int, cap: int = 1 << 62) -> object:
    """One message from ``fd``; None at end of file; ``ValueError`` when longer than ``cap`` or not JSON."""
    head = _read_exact(fd, 8)
    if head is None:
        return None
    n = struct.unpack("<Q", head)[0]
    if n > cap:
        raise ValueError(f"message of {n} bytes (limit {cap})")
    data = _read_exact(fd, n)
    if data is None:
        return None
    return json.loads(data)


def _read_exact(fd: int, n: int) -> bytes | None:
    parts, got = [], 0
    while got < n:
        chunk = os.read(fd, min(n - got, 1 << 20))
        if not chunk:
            return None
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)


def safe_text(s: object, limit: int = 300) -> str:
    """Printable, valid UTF-8, at most ``limit`` characters: lone surrogates and control characters
    escaped (``\\udc80``, ``\\x1b``); newlines and tabs kept.

    >>> safe_text("a\\udc80\\x1b[31m\\n")
    'a\\\\udc80\\\\x1b[31m\\n'
    """
    s = s if type(s) is str else str(s)
    out = []
    for ch in s[: 4 * limit]:
        o = ord(ch)
        if ch in "\n\t" or (0x20 <= o < 0x7F) or (o > 0x9F and not 0xD800 <= o < 0xE000 and o not in (0x2028, 0x2029)):
            out.append(ch)
        else:
            out.append(f"\\x{o:02x}" if o < 0x100 else f"\\u{o:04x}")
    text = "".join(out)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ---------------------------------------------------------------- candidate side
def serve_calls(rfd: int, wfd: int, classify, describe) -> None:
    """Candidate process: read the code, run it, report the load, then answer calls until EOF.

    ``classify(e) -> [reason, detail]`` names an exception (the supervisor's rules)."""
    me = os.getpid()

    def answer(obj: dict) -> None:
        if os.getpid() != me:  # a fork of the code came back here: it has no say
            os._exit(0)
        write_frame(wfd, obj)

    item = read_frame(rfd)
    if not isinstance(item, dict):
        return
    src, entry = item.get("code", ""), item.get("entry")
    ns: dict = {"__name__": "solution", "__builtins__": builtins}
    item = None
    try:
        code = compile(src, "<solution>", "exec", dont_inherit=True)  # no __future__ of this module
    except (SyntaxError, ValueError, MemoryError, RecursionError) as e:
        fail = ["syntax_error", describe(e)]
    else:
        fail = _attempt(lambda: exec(code, ns), classify)  # noqa: S102 - this is the sandbox
    if fail is None and entry and not callable(ns.get(entry)):
        fail = ["missing_entry_point", f"no function {entry!r} defined"]
    answer({"load": fail})
    if fail is not None:
        return
    while True:
        try:
            req = read_frame(rfd)
        except ValueError:
            return
        if req is None:
            return
        out: dict = {}
        fail = _attempt(lambda out=out, req=req: out.update(v=encode(_call(ns, entry, req))), classify)
        answer(out if fail is None else {"x": fail})


def _call(ns: dict, entry: str | None, req: dict) -> object:
    name = req["f"]
    fn = ns[entry] if name == "candidate" and "candidate" not in ns and entry else ns[name]
    return fn(*decode(req["a"]), **decode(req["k"]))


def _attempt(fn, classify) -> list | None:
    try:
        fn()
    except BaseException as e:  # noqa: BLE001 - every way out is a verdict
        return [*classify(e), type(e).__name__]
    return None


# ---------------------------------------------------------------- judge side
def free_names(tree: ast.AST) -> set[str]:
    """Names a test reads but never binds, that are neither builtins nor :data:`_MODULES` (the code's)."""
    bound, loaded = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (loaded if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
    return loaded - bound - set(dir(builtins)) - set(_MODULES)


class _Dead(Exception):
    """The candidate process is gone or broke the protocol: every later call fails the same way."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


class _Link:
    """The judge's end of the pipes to one candidate process."""

    def __init__(self, wfd: int, rfd: int, death) -> None:
        self.wfd, self.rfd, self.death, self.dead, self.calls = wfd, rfd, death, None, 0

    def receive(self) -> dict:
        try:
            msg = read_frame(self.rfd, MAX_FRAME)
        except (ValueError, RecursionError, MemoryError) as e:
            msg = e
        if not isinstance(msg, dict):
            self.dead = _Dead(*self.death()) if msg is None else _Dead("error", f"bad message from the code: {msg}")
            raise self.dead
        return msg

    def call(self, name: str, args: tuple, kwargs: dict) -> object:
        if self.dead is not None:
            raise self.dead
        try:
            payload = {"f": name, "a": encode(list(args)), "k": encode(kwargs)}
        except (TypeError, ValueError) as e:
            raise _TestProblem(f"the test passes {e} to {name}") from None
        self.calls += 1
        try:
            write_frame(self.wfd, payload)
        except OSError:
            self.dead = _Dead(*self.death())
            raise self.dead from None
        msg = self.receive()
        if "v" in msg:
            try:
                return decode(msg["v"])
            except (ValueError, TypeError, RecursionError, MemoryError) as e:
                raise _Returned(f"{name} returned {e}") from None
        fail = msg.get("x")
        if not (isinstance(fail, list) and len(fail) == 3 and all(type(f) is str for f in fail)):
            self.dead = _Dead("error", "bad message from the code")
            raise self.dead
        try:
            err = _EXCEPTIONS.get(fail[2], _Raised)(safe_text(fail[1]))
        except Exception:  # noqa: BLE001 - an exception type with other arguments
            err = _Raised(safe_text(fail[1]))
        err.sandbox_reason = fail[0] if fail[0] in CANDIDATE_REASONS else "error"
        raise err


class _TestProblem(Exception):
    """The test cannot be run as written (not the code's fault)."""


class _Returned(Exception):
    """The code returned something that is not plain data."""


class _Raised(Exception):
    """The code raised an exception that is not a builtin one."""


def judge_tests(tests: list[str], entry: str | None, link: _Link, progress) -> tuple[int, list | None]:
    """Run each test in the judge; ``progress(ok)`` after each. Returns (passed, first failure as
    ``[reason, detail]`` or None)."""
    load = link.receive() if link.dead is None else None
    if load is None or load.get("load") is not None:
        fail = load.get("load") if load else None
        ok = isinstance(fail, list) and len(fail) >= 2 and all(type(f) is str for f in fail[:2])
        reason = fail[0] if ok and fail[0] in CANDIDATE_REASONS else "error"
        return 0, [reason, safe_text(fail[1]) if ok else "bad load message from the code"]
    passed, first = 0, None
    modules = {m: __import__(m) for m in _MODULES}
    for i, test in enumerate(tests):
        fail = _one_test(test, i, entry, link, modules)
        passed += fail is None
        progress(fail is None)
        if fail is not None and first is None:
            fail[1] = safe_text(f"test {i} {test.strip()[-100:]!r}: {fail[1]}")
            first = fail
    return passed, first


def _one_test(test: str, i: int, entry: str | None, link: _Link, modules: dict) -> list | None:
    try:
        tree = ast.parse(test)
        code = compile(tree, f"<test {i}>", "exec", dont_inherit=True)
    except (SyntaxError, ValueError) as e:
        return ["test_error", f"{type(e).__name__}: {e}"]
    names = free_names(tree) | ({entry, "candidate"} if entry else set())  # the entry point even if named `sum`
    env: dict = {"__name__": "__test__", "__builtins__": builtins, **modules}
    for name in names:
        env[name] = _stub(link, entry if name == "candidate" and entry else name)
    before = link.calls
    try:
        exec(code, env)  # noqa: S102 - the task's own (trusted) test code
    except _Dead as e:
        return [e.reason, str(e)]
    except _TestProblem as e:
        return ["test_error", str(e)]
    except BaseException as e:  # noqa: BLE001 - a raising test fails
        if hasattr(e, "sandbox_reason"):  # raised by the code (its own description)
            return [e.sandbox_reason, str(e)]
        default = {AssertionError: "assertion", MemoryError: "memory"}.get(type(e), "error")
        return [default, f"{type(e).__name__}: {e}"]
    finally:
        env.clear()
    if link.calls == before:
        return ["error", "the test does not call the code"]
    return None


def _stub(link: _Link, name: str):
    def stub(*args, **kwargs):
        return link.call(name, args, kwargs)

    stub.__name__ = stub.__qualname__ = name
    return stub
