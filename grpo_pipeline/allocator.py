"""The memory allocator a stage process runs with: chosen before the process imports torch.

PyTorch's CPU tensors come from the C allocator.  glibc's default hands every block above its
(adaptive, at most 32 MiB) mmap threshold to ``mmap`` and gives it back with ``munmap`` when freed,
so each micro-batch's activations, logits chunks and gradients are fresh pages again: a page fault and
a zero-fill per 4 KiB, every pass.  Measured on the update stage (W1's it0 inputs, bf16, 2-core AMD
EPYC, two alternating rounds; ``bench/iteration.py`` prints the same stage's breakdown):

=====================  ==========  ========  ===============  =========
allocator              tokens/s    wall      kernel (sys) s   peak
=====================  ==========  ========  ===============  =========
glibc defaults         197 / 203   34.9 s    19.0 / 18.2      4977 MiB
glibc, tuned (below)   254 / 266   28.1 s    12.1 / 11.9      5234 MiB
tcmalloc (gperftools)  307 / 308   26.9 s    11.7 / 11.2      4374 MiB
=====================  ==========  ========  ===============  =========

``GRPO_ALLOCATOR`` picks (an environment setting, like ``OMP_NUM_THREADS``: it changes no result,
so DVC does not track it):

- ``auto`` (default): tcmalloc where its library is installed (Debian/Ubuntu:
  ``apt-get install libtcmalloc-minimal4``; ``.ci/install`` does it where it can), else glibc tuned;
- ``tcmalloc``: the same, an error where the library is missing;
- ``glibc``: glibc with ``GLIBC_TUNABLES`` that keep freed memory in the process (blocks up to 4 GiB
  from the heap, no trimming): the pages are faulted in once;
- ``system``: whatever the process was started with.

A stage script calls :func:`reexec` first thing (``stages/_common.py``): where the environment
lacks the choice it re-executes itself once with it (``LD_PRELOAD`` and ``GLIBC_TUNABLES`` are
read only when a process starts), before any heavy import.  Child processes (torchrun's ranks,
vLLM's workers) inherit it.
"""

from __future__ import annotations

import ctypes.util
import os
import sys
from pathlib import Path

ENV = "GRPO_ALLOCATOR"
CHOICES = ("auto", "tcmalloc", "glibc", "system")
MARK = "GRPO_ALLOCATOR_APPLIED"       # set in the re-executed process: never re-execute twice
GLIBC = {"glibc.malloc.mmap_threshold": str(4 << 30), "glibc.malloc.trim_threshold": str(16 << 30),
         "glibc.malloc.top_pad": str(1 << 30)}
TCMALLOC_NAMES = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4")
TCMALLOC_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib",
                 "/usr/local/lib")


def find_tcmalloc(dirs: tuple[str, ...] = TCMALLOC_DIRS) -> str | None:
    """Path of an installed tcmalloc shared library, or None."""
    for d in dirs:
        for name in TCMALLOC_NAMES:
            if (Path(d) / name).is_file():
                return str(Path(d) / name)
    found = ctypes.util.find_library("tcmalloc_minimal")
    return found if found and Path(found).is_absolute() and Path(found).is_file() else None


def _merge_tunables(current: str, wanted: dict[str, str]) -> str:
    """``GLIBC_TUNABLES`` with ``wanted`` added; a tunable the user set keeps the user's value."""
    items = [kv for kv in current.split(":") if kv]
    have = {kv.split("=", 1)[0] for kv in items}
    return ":".join(items + [f"{k}={v}" for k, v in wanted.items() if k not in have])


def environment(env: dict[str, str], *, tcmalloc: str | None = None) -> tuple[dict[str, str], str]:
    """``(changes, description)``: the variables to set for the allocator ``env[GRPO_ALLOCATOR]`` asks for.

    ``tcmalloc``: the library's path (None: look for it).  No changes: the process already runs as asked.
    """
    choice = env.get(ENV, "auto") or "auto"
    if choice not in CHOICES:
        msg = f"{ENV}={choice!r}: expected one of {list(CHOICES)}"
        raise ValueError(msg)
    if choice == "system":
        return {}, "system allocator"
    lib = tcmalloc if tcmalloc is not None else (find_tcmalloc() if choice in ("auto", "tcmalloc") else None)
    if choice == "tcmalloc" and lib is None:
        msg = (f"{ENV}=tcmalloc but no tcmalloc library was found in {list(TCMALLOC_DIRS)}. "
               "Hint: apt-get install libtcmalloc-minimal4, or GRPO_ALLOCATOR=glibc")
        raise ValueError(msg)
    if lib is not None:
        preload = env.get("LD_PRELOAD", "")
        if lib in preload.split():
            return {}, f"tcmalloc ({lib})"
        # tcmalloc reports every allocation over 1 GiB on stderr; the update's state is larger
        return ({"LD_PRELOAD": f"{lib} {preload}".strip(), "TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD": str(1 << 40)},
                f"tcmalloc ({lib})")
    tunables = _merge_tunables(env.get("GLIBC_TUNABLES", ""), GLIBC)
    if tunables == env.get("GLIBC_TUNABLES", ""):
        return {}, "glibc, tuned"
    return {"GLIBC_TUNABLES": tunables}, "glibc, tuned"


def reexec() -> None:
    """Re-execute this process once with the chosen allocator (a no-op where it already runs with it)."""
    if os.environ.get(MARK) or sys.platform != "linux":
        return
    try:
        changes, _ = environment(dict(os.environ))
    except ValueError as e:
        sys.exit(f"error: {e}")
    if not changes:
        return
    env = {**os.environ, **changes, MARK: "1"}
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


def release_free_memory() -> str | None:
    """Give the allocator's cached free pages back to the operating system; the allocator's name, or None.

    tcmalloc and the tuned glibc keep freed memory in the process (that is their point: no fault per page
    per pass).  Before the update's first optimizer step that cache holds the last micro-batch's
    activations while AdamW allocates its two moments (2x the trained weights): returned here, the moments
    take fresh pages instead of adding to the cached ones, so the process's peak is the larger of the two,
    not their sum.  Cheap (one call; the pages are faulted in again as used).
    """
    if sys.platform != "linux":
        return None
    lib = ctypes.CDLL(None)
    fn = getattr(lib, "MallocExtension_ReleaseFreeMemory", None)
    if fn is not None:                       # tcmalloc (gperftools), preloaded
        fn.restype = None
        fn()
        return "tcmalloc"
    trim = getattr(lib, "malloc_trim", None)
    if trim is not None:                     # glibc
        trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
        trim(0)
        return "glibc"
    return None
