"""AdamW state carried from update@itN to update@itN+1, with one copy on disk, not one per iteration.

What carries over, and where
----------------------------
* the **global step** (warm-up and the learning-rate schedule, ``update.total_steps``) lives in
  each checkpoint's ``grpo_pipeline.json`` as ``train_state.global_step``: a declared DVC output,
  so it is reproducible and versioned with the weights;
* the **AdamW moments** (two float32 tensors per parameter, twice the model's size) live in one
  *state directory* (``models/optimizer_state`` in ``dvc.yaml``): ``optimizer.pt`` (keyed by
  parameter name, so it does not depend on the strategy or the number of processes) and
  ``manifest.json``, which names the checkpoint the moments belong to by the sha256 of its
  weight files.  Each update overwrites it, atomically, after its checkpoint is written.

An update resumes the moments only when the manifest's hash equals its input policy's weights,
i.e. when the state was written by the update that produced that policy.  Otherwise (first
iteration, fresh clone, an earlier iteration re-run, ``update.optimizer_state: fresh``) it
starts with fresh moments, and says so: ``optimizer_state`` in the metrics and in the new
checkpoint's ``train_state``.

Why not a DVC output
--------------------
A DVC output is immutable per stage and has one path per stage: ``update@itN`` cannot overwrite
``update@itN-1``'s output, and one state output per iteration is exactly the copy per iteration
we avoid (the DVC cache would keep all of them; AdamW state is 2x the weights).  Deleting the
previous one would mark ``update@itN-1`` as changed and make ``dvc repro`` re-run it.  So the
state is a deliberately *undeclared* side input, guarded by the content hash:

* ``dvc repro`` in order (the normal case) continues AdamW exactly as one long run would
  (``tests/test_update.py`` checks update, stop, update == two updates in one run);
* re-running one old iteration alone (``dvc repro -f update@it1`` after ``it2`` ran) or running on
  a fresh clone after ``dvc pull`` starts that update with fresh moments: the result then differs
  from the first run (the metrics say ``optimizer_state: fresh``), while DVC sees equal inputs;
* for runs that must be a pure function of their declared inputs, set
  ``update.optimizer_state: fresh`` (every iteration starts new moments, as TRL does per run).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch

from grpo_pipeline.checkpoint import sha256_file
from grpo_pipeline.io import atomic_dir

STATE_FILE = "optimizer.pt"
MANIFEST_FILE = "manifest.json"
FORMAT = 1


def weights_fingerprint(checkpoint: str | Path) -> str:
    """sha256 over a checkpoint's weight files (``*.safetensors`` and their index), names included."""
    checkpoint = Path(checkpoint)
    files = sorted(p for p in checkpoint.iterdir() if p.name.endswith((".safetensors", ".safetensors.index.json")))
    if not files:
        msg = f"checkpoint {str(checkpoint)!r} has no safetensors weight files"
        raise FileNotFoundError(msg)
    h = hashlib.sha256()
    for p in files:
        h.update(p.name.encode() + b"\0" + sha256_file(p).encode() + b"\0")
    return h.hexdigest()


def read_manifest(state_dir: str | Path) -> dict[str, Any] | None:
    """The state directory's manifest, or ``None`` when there is no (readable) state."""
    path = Path(state_dir) / MANIFEST_FILE
    if not path.is_file() or not (Path(state_dir) / STATE_FILE).is_file():
        return None
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError:
        return None
    return meta if isinstance(meta, dict) and meta.get("format") == FORMAT else None


def load_state(state_dir: str | Path | None, policy: str | Path) -> tuple[dict | None, str]:
    """The optimizer state written with ``policy``, and why it is (not) used.

    Returns
    -------
    state : the full optimizer state dict, or ``None`` (start fresh).
    reason : ``"resumed"``, or a sentence saying why the moments start fresh.
    """
    if state_dir is None:
        return None, "fresh: no optimizer state directory given"
    meta = read_manifest(state_dir)
    if meta is None:
        return None, f"fresh: no optimizer state in {str(state_dir)!r}"
    if meta.get("weights_sha256") != weights_fingerprint(policy):
        return None, (f"fresh: the optimizer state in {str(state_dir)!r} belongs to {meta.get('checkpoint')!r} "
                      f"(global step {meta.get('global_step')}), not to {str(policy)!r}")
    return torch.load(Path(state_dir) / STATE_FILE, map_location="cpu", weights_only=True), "resumed"


def save_state(state_dir: str | Path, state: dict, *, checkpoint: str | Path, global_step: int) -> None:
    """Replace the state directory atomically with ``state``, paired with the weights of ``checkpoint``."""
    meta = {"format": FORMAT, "checkpoint": str(checkpoint), "global_step": global_step,
            "weights_sha256": weights_fingerprint(checkpoint)}
    with atomic_dir(state_dir) as tmp:
        torch.save(state, tmp / STATE_FILE)
        (tmp / MANIFEST_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n", encoding="utf-8")
