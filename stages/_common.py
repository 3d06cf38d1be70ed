"""Shared argument handling of the stage scripts: params are validated before heavy imports."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without install


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
