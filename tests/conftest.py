"""Shared fixtures: a tiny random Llama built offline, once per session."""

from __future__ import annotations

import pytest

from tests.tiny import build_tiny_model


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    """An HF checkpoint dir of a 2-layer random Llama with its own trained tokenizer."""
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny") / "model"))


@pytest.fixture(scope="session")
def tiny_problems():
    from grpo_pipeline.data import generate_problems

    return generate_problems(n=24, seed=0)
