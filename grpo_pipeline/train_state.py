"""AdamW state carried from update@itN to update@itN+1, stored inside the checkpoint it belongs to.

What carries over, and where
----------------------------
* the **global step** (warm-up and the learning-rate schedule, ``update.total_steps``) lives in
  each checkpoint's ``grpo_pipeline.json`` as ``train_state.global_step``;
* the **AdamW moments** (two float32 tensors per parameter, twice the model's size) live in the
  checkpoint's ``optimizer/`` folder: ``optimizer.pt`` (keyed by parameter name, so it does not
  depend on the strategy or the number of processes) and ``manifest.json``, which names the
  checkpoint the moments belong to by the sha256 of its weight files.

``update@itN`` writes them into its output checkpoint's temporary directory, so the weights and
the moments appear together in one atomic rename (``checkpoint.save_checkpoint(extra=...)``), and
``update@itN+1`` reads them from its policy directory, which is a declared DVC dependency.  So
the carried state is an ordinary, versioned part of the pipeline:

* a killed update leaves either the old checkpoint with its own moments or the new one with its
  own, never a checkpoint paired with another's moments; ``dvc repro`` after a kill at any point
  gives what an uninterrupted run gives, and ``dvc status`` tells the truth;
* re-running one old iteration alone, or a fresh clone after ``dvc pull``, resumes exactly the
  moments the first run used.

Cost: the moments are 2x the weights in every ``models/itN`` (and in the DVC cache).  vLLM, the
evaluation and ``from_pretrained`` read only the top-level weight files, so they ignore the folder.
``update.optimizer_state: fresh`` writes none and starts new moments every iteration (as TRL does
per run).  The first update (policy ``models/sft``) starts fresh: SFT's optimizer is not GRPO's.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import torch

from grpo_pipeline.checkpoint import sha256_file

STATE_DIR = "optimizer"          # inside the checkpoint directory (not a *.safetensors: vLLM ignores it)
STATE_FILE = "optimizer.pt"
MANIFEST_FILE = "manifest.json"
FORMAT = 2


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


def read_manifest(checkpoint: str | Path) -> dict[str, Any] | None:
    """The manifest of the checkpoint's optimizer state, or ``None`` when it has none.

    A manifest that is present but unreadable is an error naming the file (never a silent fresh start).
    """
    d = Path(checkpoint) / STATE_DIR
    path = d / MANIFEST_FILE
    if not d.exists():
        return None
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: unreadable optimizer state manifest ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or not (d / STATE_FILE).is_file():
        raise ValueError(f"{path}: not an optimizer state of format {FORMAT} beside {STATE_FILE}")
    return meta


def load_state(policy: str | Path) -> tuple[dict | None, str]:
    """The optimizer state stored with ``policy``, and why it is (not) used.

    Returns
    -------
    state : the full optimizer state dict, or ``None`` (start fresh).
    reason : ``"resumed"``, or a sentence saying why the moments start fresh.
    """
    meta = read_manifest(policy)
    if meta is None:
        return None, f"fresh: {str(policy)!r} holds no optimizer state"
    if meta.get("weights_sha256") != weights_fingerprint(policy):
        msg = (f"{Path(policy) / STATE_DIR / MANIFEST_FILE}: the optimizer state belongs to other weights than "
               f"{str(policy)!r}'s (edited checkpoint?); remove {STATE_DIR}/ or set update.optimizer_state: fresh")
        raise ValueError(msg)
    return torch.load(Path(policy) / STATE_DIR / STATE_FILE, map_location="cpu", weights_only=True), "resumed"


def write_state(checkpoint_dir: str | Path, state: dict, *, checkpoint: str | Path, global_step: int) -> None:
    """Write ``state`` into ``checkpoint_dir/optimizer``, paired with the weights already in ``checkpoint_dir``.

    ``checkpoint_dir`` is the checkpoint's temporary directory (``save_checkpoint(extra=...)``),
    ``checkpoint`` its final path, recorded in the manifest.
    """
    d = Path(checkpoint_dir) / STATE_DIR
    d.mkdir()
    crc = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)   # no zip CRC over 2x the weights (0.1-1 s of 1.1 GB on 2
    try:                                           # cores); DVC's md5 and the manifest check the file
        torch.save(state, d / STATE_FILE)
    finally:
        torch.serialization.set_crc32_options(crc)
    _write_manifest(checkpoint_dir, checkpoint=checkpoint, global_step=global_step)


def carry_state(policy: str | Path, checkpoint_dir: str | Path, *, checkpoint: str | Path) -> None:
    """Copy ``policy``'s optimizer state (if any) into ``checkpoint_dir``, which holds the same weights
    (an update with nothing to train on): the next update resumes the moments as if this one were not there."""
    meta = read_manifest(policy)
    if meta is None:
        return
    (Path(checkpoint_dir) / STATE_DIR).mkdir()
    shutil.copyfile(Path(policy) / STATE_DIR / STATE_FILE, Path(checkpoint_dir) / STATE_DIR / STATE_FILE)
    _write_manifest(checkpoint_dir, checkpoint=checkpoint, global_step=meta["global_step"])


def _write_manifest(checkpoint_dir: str | Path, *, checkpoint: str | Path, global_step: int) -> None:
    meta = {"format": FORMAT, "checkpoint": str(checkpoint), "global_step": global_step,
            "weights_sha256": weights_fingerprint(checkpoint_dir)}
    path = Path(checkpoint_dir) / STATE_DIR / MANIFEST_FILE
    path.write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n", encoding="utf-8")
