"""base: import the base model into an HF-format checkpoint dir."""

from __future__ import annotations

from grpo_pipeline.base_import import find_packaged_file, import_base
from grpo_pipeline.config import BaseModelConfig
from grpo_pipeline.run import summary


def run(cfg: BaseModelConfig, *, out: str) -> dict:
    if cfg.source == "gguf_package":
        meta = import_base(out, gguf_path=find_packaged_file(cfg.package, cfg.file), dtype=cfg.dtype)
    elif cfg.source == "gguf":
        meta = import_base(out, gguf_path=cfg.path, dtype=cfg.dtype)
    else:
        meta = import_base(out, hf_dir=cfg.path, dtype=cfg.dtype)
    summary("base", {"out": out, **{k: v for k, v in meta.items() if isinstance(v, str | int | float)}})
    return meta
