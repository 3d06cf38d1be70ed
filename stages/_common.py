"""Shared argument handling of the stage scripts: params are validated before heavy imports."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without install

from grpo_pipeline.allocator import reexec  # noqa: E402

reexec()  # once, before torch is imported: the allocator (GRPO_ALLOCATOR) is chosen at process start

# Errors about the stage's input (bad data, bad params, a missing file; the project's own error types)
# name the file and row or key in their message: print that one line, not a traceback.
# GRPO_TRACEBACK=1 shows the traceback.
DATA_ERRORS = (ValueError, FileNotFoundError, NotADirectoryError, IsADirectoryError)


def _one_line(kind, value, tb) -> None:
    ours = issubclass(kind, DATA_ERRORS) or kind.__module__.startswith("grpo_pipeline")
    if ours and not os.environ.get("GRPO_TRACEBACK"):
        print(f"error: {value}", file=sys.stderr)
    else:
        sys.__excepthook__(kind, value, tb)


sys.excepthook = _one_line


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--params", default="params.yaml", help="params file (default: params.yaml)")
    return p


def params(args: argparse.Namespace, *sections: str):
    """Validate the whole params file (a typo anywhere fails fast, naming the key), and the registered
    names (estimators, losses, rewards, ...) of the ``sections`` this stage reads."""
    from grpo_pipeline.config import ParamsError, load_params

    try:
        return load_params(args.params, sections=sections)
    except ParamsError as e:
        sys.exit(f"error: {e}")
