"""Atomic file output: nothing half-written ever becomes a stage's output.

Every writer here writes into a temporary sibling of the target (same directory, so
the final ``os.replace`` is atomic on POSIX) and swaps it in only when the write
succeeded.  A killed stage leaves at most a ``.tmp-*`` sibling behind, which the
next run removes.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

TMP_PREFIX = ".tmp-"


def _clean_stale(target: Path) -> None:
    """Remove temporaries a killed earlier run left beside ``target``."""
    parent = target.parent
    if not parent.is_dir():
        return
    for p in parent.glob(f"{TMP_PREFIX}{target.name}.*"):
        shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)


@contextlib.contextmanager
def atomic_path(target: str | Path) -> Iterator[Path]:
    """Yield a temporary file path; on success it replaces ``target``, on error it is deleted."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    _clean_stale(target)
    fd, tmp = tempfile.mkstemp(prefix=f"{TMP_PREFIX}{target.name}.", dir=target.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp_path, 0o666 & ~umask)  # mkstemp makes 0600
    try:
        yield tmp_path
        with open(tmp_path, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp_path, target)
    except BaseException:
        tmp_path.unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def atomic_dir(target: str | Path) -> Iterator[Path]:
    """Yield an empty temporary directory; on success it replaces the directory ``target``.

    The temporary directory is ``<parent>/.tmp-<name>.XXXX/<name>``, one level deeper than
    ``target``, and so is the old ``target`` during the swap: a glob over the outputs' files
    (``data/rollouts/*/*.parquet``) never matches half-written or outgoing ones.
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    _clean_stale(target)
    holder = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{target.name}.", dir=target.parent))
    tmp = holder / target.name
    umask = os.umask(0)
    os.umask(umask)
    tmp.mkdir(mode=0o777 & ~umask)
    os.chmod(tmp, 0o777 & ~umask)  # outputs get the usual permissions, whatever mkdir's umask did
    try:
        yield tmp
        for p in tmp.rglob("*"):
            if p.is_file():
                with open(p, "rb") as f:
                    os.fsync(f.fileno())
        if target.is_dir() and not target.is_symlink():
            os.replace(target, holder / "old")
        elif target.exists() or target.is_symlink():
            target.unlink()
        os.replace(tmp, target)
    finally:
        shutil.rmtree(holder, ignore_errors=True)


def write_json(path: str | Path, obj: Any) -> None:
    """Write ``obj`` as pretty JSON (sorted keys: deterministic for DVC), atomically."""
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(obj, indent=2, sort_keys=True, allow_nan=False) + "\n", encoding="utf-8")


def write_text(path: str | Path, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def read_json(path: str | Path) -> Any:
    path = Path(path)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: not found") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
