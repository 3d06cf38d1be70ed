"""Model checkpoints: save and load HF-format directories (the base model's import: :mod:`.base_import`).

A checkpoint is a Hugging Face directory that loads with
``transformers.AutoModelForCausalLM`` / ``AutoTokenizer`` and with
``vllm.LLM(model=dir)``:

- ``config.json``, ``generation_config.json``, ``model.safetensors``
- ``tokenizer.json``, ``tokenizer_config.json``, ``chat_template.jinja``
- ``grpo_pipeline.json``: this pipeline's metadata (source, sha256, package
  version, ...). No timestamps, so identical inputs give identical files (DVC).

Writes are atomic (:func:`grpo_pipeline.io.atomic_dir`): everything goes into a
temporary sibling of the target, is fsynced, and replaces the target only when
complete. A crash leaves the previous checkpoint untouched.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from grpo_pipeline.io import atomic_dir

__all__ = [
    "METADATA_FILE",
    "check_model_dir",
    "check_tokenizer_dir",
    "load_model",
    "load_tokenizer",
    "read_checkpoint_metadata",
    "save_checkpoint",
    "sha256_file",
    "torch_dtype",
]

METADATA_FILE = "grpo_pipeline.json"
_DTYPES = ("float32", "bfloat16", "float16")
_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def sha256_file(path: str | Path, *, chunk_size: int = 1 << 20) -> str:
    """Hex sha256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_size):
            h.update(chunk)
    return h.hexdigest()



# --------------------------------------------------------------------------- checks
def torch_dtype(dtype: str):
    import torch

    if dtype not in _DTYPES:
        msg = f"Unsupported dtype: {dtype!r}. Supported dtypes are: {list(_DTYPES)}"
        raise ValueError(msg)
    return getattr(torch, dtype)


def _require_dir(path: Path, what: str) -> None:
    if not path.is_dir():
        msg = f"{what} {str(path)!r} does not exist or is not a directory"
        raise FileNotFoundError(msg)


def _require_any(path: Path, names: tuple[str, ...], what: str) -> None:
    if not any((path / n).is_file() for n in names):
        wanted = names[0] if len(names) == 1 else " or ".join(names)
        msg = f"checkpoint {str(path)!r} has no {what} file ({wanted})"
        raise FileNotFoundError(msg)


def check_model_dir(path: Path) -> None:
    _require_dir(path, "checkpoint")
    _require_any(path, ("config.json",), "model config")
    _require_any(path, _WEIGHT_FILES, "weights")


def check_tokenizer_dir(path: Path) -> None:
    _require_dir(path, "checkpoint")
    _require_any(path, ("tokenizer_config.json",), "tokenizer config")
    _require_any(path, _TOKENIZER_FILES, "tokenizer")


def same_weights(a: str | Path, b: str | Path, *, chunk_size: int = 16 << 20) -> bool:
    """Whether checkpoints ``a`` and ``b`` hold the same model: one directory, or the same ``config.json``
    and byte-identical weight files (safetensors, shards included).  Different weights stop at the first
    differing chunk (a few MiB in: the tensors' bytes follow a short header)."""
    a, b = Path(a), Path(b)
    if a.resolve() == b.resolve():
        return True
    names = sorted(p.name for p in a.iterdir() if p.name.endswith(".safetensors") or p.name in _WEIGHT_FILES)
    if not names or names != sorted(p.name for p in b.iterdir()
                                    if p.name.endswith(".safetensors") or p.name in _WEIGHT_FILES):
        return False
    for name in ["config.json", *names]:
        fa, fb = a / name, b / name
        if not (fa.is_file() and fb.is_file()) or fa.stat().st_size != fb.stat().st_size:
            return False
        with fa.open("rb") as x, fb.open("rb") as y:
            while True:
                ca, cb = x.read(chunk_size), y.read(chunk_size)
                if ca != cb:
                    return False
                if not ca:
                    break
    return True


# --------------------------------------------------------------------------- save / load
def save_checkpoint(model: Any, tokenizer: Any, out_dir: str | Path, *, metadata: dict[str, Any],
                    extra: Callable[[Path], None] | None = None) -> None:
    """Write ``model`` + ``tokenizer`` + ``metadata`` to ``out_dir``, atomically.

    Parameters
    ----------
    model : transformers.PreTrainedModel
        Saved as safetensors with its ``generation_config``.
    tokenizer : transformers.PreTrainedTokenizerBase
        Saved with its chat template.
    out_dir : str or pathlib.Path
        Target directory. Replaced as a whole only once the new one is fully
        written and fsynced; on any error it is left as it was.
    metadata : dict
        JSON-serialisable; written to ``grpo_pipeline.json`` with sorted keys.
        Nothing is added (no timestamp), so the file is deterministic.
    extra : callable, optional
        Called with the temporary directory once the weights are in it, before the rename: files it
        writes there (e.g. the AdamW state, ``grpo_pipeline.train_state``) appear atomically with them.
    """
    if not isinstance(metadata, dict):
        msg = f"metadata must be a dict, got {type(metadata).__name__}"
        raise TypeError(msg)
    try:
        meta_text = json.dumps(metadata, indent=2, sort_keys=True, allow_nan=False) + "\n"
    except (TypeError, ValueError) as e:
        msg = f"metadata for {str(out_dir)!r} is not JSON-serialisable: {e}"
        raise ValueError(msg) from None
    out_dir = Path(out_dir)
    with atomic_dir(out_dir) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / METADATA_FILE).write_text(meta_text, encoding="utf-8")
        if extra is not None:
            extra(tmp)
    fd = os.open(out_dir.parent, os.O_RDONLY)  # make the rename itself durable
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_checkpoint_metadata(path: str | Path) -> dict[str, Any]:
    """Return the ``grpo_pipeline.json`` metadata of a checkpoint directory."""
    path = Path(path)
    _require_dir(path, "checkpoint")
    _require_any(path, (METADATA_FILE,), "pipeline metadata")
    file = path / METADATA_FILE
    try:
        meta = json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        msg = f"{str(file)!r} is not valid JSON ({e})"
        raise ValueError(msg) from None
    if not isinstance(meta, dict):
        msg = f"{str(file)!r} must hold a JSON object, got {type(meta).__name__}"
        raise ValueError(msg)  # noqa: TRY004 (bad file contents, not a bad argument)
    return meta


def load_model(path: str | Path, *, dtype: str = "float32", device: str = "cpu", trainable: bool = False) -> Any:
    """Load a checkpoint's ``AutoModelForCausalLM`` in ``dtype`` on ``device``.

    On CPU, transformers leaves weights stored in the checkpoint's dtype as views of the safetensors
    file's private memory map: reading them is free, but the first write to each page (the first
    optimizer step) is a copy-on-write fault (~1 s for SmolLM2-135M's 540 MB on 2 cores, against 0.14 s
    for one copy).  ``trainable``: copy the parameters and buffers into the process's own memory first.
    """
    import torch
    from transformers import AutoModelForCausalLM

    path = Path(path)
    dt = torch_dtype(dtype)
    check_model_dir(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dt).to(device)
    if trainable and torch.device(device).type == "cpu":
        own_memory(model)
    return model


def own_memory(model: Any) -> None:
    """Give every parameter and buffer of ``model`` storage of its own (tied weights stay tied)."""
    import torch

    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            t.data = t.data.clone()


def load_tokenizer(path: str | Path) -> Any:
    """Load a checkpoint's tokenizer (``AutoTokenizer``)."""
    from transformers import AutoTokenizer

    path = Path(path)
    check_tokenizer_dir(path)
    return AutoTokenizer.from_pretrained(path)
