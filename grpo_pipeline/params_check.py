"""params.yaml validated before any stage deletes an output: the ``check`` stage and ``grpo-pipeline check``.

DVC deletes a stage's outputs before it runs the stage's command, so a params error that the stage
itself finds is found too late (its uncached metrics are already gone), and a section no stage
lists reaches no stage at all.  The ``check`` stage depends on the *whole* ``params.yaml``, validates
it as the stages and DVC will read it, and writes :data:`MARKER`, whose content never changes.
Every other stage depends on the marker, so ``dvc repro`` runs ``check`` first and stops there on an
error, with nothing else deleted; after a valid edit the marker's hash is what it was, so only the
stages that read the edited section rerun.  (``dvc repro -s STAGE`` skips ``check``: the stage
script still validates, but after DVC removed that stage's outputs.)

What is checked, beyond :func:`grpo_pipeline.config.load_params` (every key, unknown ones and
unknown sections rejected): every section ``dvc.yaml`` names (``params:`` lists, ``foreach``
tables) is present in the file, since DVC refuses a missing one although the stages would use
defaults, and the iterations table is not empty.
"""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from grpo_pipeline.config import SECTIONS, Params, ParamsError, load_params
from grpo_pipeline.io import write_json

MARKER = "data/checked_params.json"
_REF = re.compile(r"^\$\{\s*([A-Za-z_][\w-]*)")


def dvc_sections(dvc_yaml: str | Path) -> set[str]:
    """Top-level params.yaml sections that ``dvc_yaml`` reads: ``params:`` names and ``foreach: ${...}``."""
    doc = yaml.safe_load(Path(dvc_yaml).read_text(encoding="utf-8")) or {}
    out: set[str] = set()
    for stage in (doc.get("stages") or {}).values():
        if not isinstance(stage, dict):
            continue
        m = _REF.match(str(stage.get("foreach", "")))
        if m:
            out.add(m.group(1))
        for entry in (stage.get("do") or stage).get("params") or []:
            if isinstance(entry, str):
                out.add(entry.split(".")[0])
            elif isinstance(entry, dict) and list(entry) == ["params.yaml"]:
                out.update(str(k).split(".")[0] for k in entry["params.yaml"] or [])
    return out


def check(params_path: str | Path = "params.yaml", dvc_yaml: str | Path | None = None) -> Params:
    """Validate ``params_path`` as the stages and DVC read it; raise :class:`ParamsError` naming file and key.

    ``dvc_yaml`` defaults to the ``dvc.yaml`` beside the params file (skipped when there is none).
    """
    path = Path(params_path)
    params = load_params(path, sections=[s for s in SECTIONS if s not in ("iterations", "evaluations")])  # names too
    dvc_yaml = Path(dvc_yaml) if dvc_yaml is not None else path.parent / "dvc.yaml"
    if dvc_yaml.is_file():
        raw = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        missing = sorted(s for s in dvc_sections(dvc_yaml) if s not in raw)
        if missing:
            msg = (f"{path}: missing section {missing[0]!r}, which {dvc_yaml} reads (DVC refuses to run without it). "
                   f"Hint: add `{missing[0]}: {{}}` for the defaults" + (
                       "; the iterations table comes from `grpo-pipeline iterations N`"
                       if missing[0] in ("iterations", "evaluations") else ""))
            raise ParamsError(msg)
    if not params.iterations:
        raise ParamsError(f"{path}: iterations: the table is empty. Hint: `grpo-pipeline iterations N`")
    return params


def write_marker(out: str | Path, params_path: str | Path) -> None:
    """The check stage's output: constant content (see the module docstring)."""
    write_json(out, {"checked": Path(params_path).name})
