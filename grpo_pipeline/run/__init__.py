"""Stage bodies: read the stage's inputs, call the pure functions, write outputs atomically.

``stages/<name>.py`` parses the command line and calls ``run`` of the module here of the
same name; every ``run`` ends with :func:`summary`, the stage's one line of metrics.
"""

from __future__ import annotations

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
