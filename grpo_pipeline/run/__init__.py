"""Stage bodies: read the stage's inputs, call the pure functions, write outputs atomically.

``stages/<name>.py`` parses the command line and calls ``run`` of the module here of the
same name; every ``run`` ends with :func:`summary`, the stage's one line of metrics.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from grpo_pipeline.io import write_json


def summary(stage: str, metrics: dict[str, Any], *, path: str | Path | None = None) -> None:
    """Write ``metrics`` as DVC metrics JSON (if ``path``) and print them on one line."""
    if path is not None:
        write_json(path, metrics)
    flat = []
    for k, v in metrics.items():
        if isinstance(v, dict):
            continue
        flat.append(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}")
    print(f"[{stage}] " + " ".join(flat), flush=True)


def deterministic() -> None:
    """Same machine, same inputs, same bytes: deterministic kernels and a fixed reduction order.

    On CPU torch's kernels are deterministic for a fixed intra-op thread count (the default: the
    physical cores; ``OMP_NUM_THREADS`` changes it, and with it the last bits).  On CUDA cuBLAS
    needs a fixed workspace and the atomics-based kernels (the embedding's backward, ...) are
    swapped for deterministic ones; an op that has none warns, naming itself, instead of failing.
    """
    import sys

    import torch

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    # torch.use_deterministic_algorithms also sets inductor's flag, importing torch._inductor and with it
    # torch._dynamo (~1.2 s a stage, which compiles nothing): inductor reads the same flag from this variable
    # when it is imported later, so set both without the import
    os.environ.setdefault("TORCHINDUCTOR_DETERMINISTIC", "1")
    inductor = sys.modules.get("torch._inductor.config")
    if inductor is not None:
        inductor.deterministic = True
    set_mode = getattr(torch._C, "_set_deterministic_algorithms", None)
    if set_mode is None:              # a torch without the private setter: the public call (and its import)
        torch.use_deterministic_algorithms(True, warn_only=True)
    else:
        set_mode(True, warn_only=True)
    # Deterministic mode also NaN-fills every torch.empty (45k fills in W1's update step, 1.7 s of its 15.8 s
    # under torch.profiler on 2 cores): a guard against kernels that read memory before writing it
    torch.utils.deterministic.fill_uninitialized_memory = False
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
