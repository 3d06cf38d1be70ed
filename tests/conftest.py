"""Shared fixtures: a tiny random Llama built offline, once per session."""

from __future__ import annotations

import os

import pytest

from tests.tiny import build_tiny_model

# `dtype: auto` resolves to bfloat16 on CPUs with AVX512-BF16/AMX and to float32 elsewhere; the tests
# compare updates, checkpoints and ranks at float32 tolerances, so here auto means float32 on every machine
# (stages and torchrun workers the tests start inherit it). tests/test_dynamic.py tests the resolution itself.
os.environ.setdefault("GRPO_AUTO_DTYPE", "float32")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    """An HF checkpoint dir of a 2-layer random Llama with its own trained tokenizer."""
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny") / "model"))


@pytest.fixture(scope="session")
def tiny_problems():
    from grpo_pipeline.data import generate_problems

    return generate_problems(n=24, seed=0)


@pytest.fixture(scope="session")
def tiny_vllm(tiny_model):
    """One vLLM engine (``VLLMBackend``) on the tiny model, started once for the whole session."""
    pytest.importorskip("vllm")
    from grpo_pipeline.sampling import VLLMBackend

    backend = VLLMBackend(tiny_model, dtype="float32", max_model_len=512, gpu_memory_utilization=0.15,
                          kv_cache_gib=0.25, seed=0)
    yield backend
    backend.close()


def install_module(monkeypatch, name: str, *functions):
    """A module ``name`` importable for this test, holding ``functions`` (leading ``_`` dropped)."""
    import sys
    import types

    mod = types.ModuleType(name)
    for f in functions:
        setattr(mod, f.__name__.lstrip("_"), f)
    monkeypatch.setitem(sys.modules, name, mod)
    return mod
