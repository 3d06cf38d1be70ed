"""bench/gpu_check.py on CPU: its configuration, its random ~0.5B model, and one real pass through the stages.

The GPU itself is the boundary that cannot run here: the end-to-end test runs the same script with the
tiny random model, the HF backend and float32 on CPU, so what it checks is the plumbing (params that
validate, the stage commands of dvc.yaml in order, metrics read back, MFU reported), not GPU speed.
"""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("bench_gpu_check", ROOT / "bench" / "gpu_check.py")
gpu = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu)


@pytest.mark.parametrize("name", ["w1", "random-0.5b", "w1-random"])
def test_config_is_w1_and_validates(name, tmp_path):
    params = gpu.config_params(gpu.model_overrides(name, tmp_path / "r"), "hf")
    s, u = params["sampling"], params["update"]
    assert (s["prompts_per_iteration"], s["group_size"], s["max_new_tokens"], s["spare_prompts"]) == (8, 8, 128, 0)
    assert (u["minibatch_size"], u["mu"], u["lr"], u["beta"], u["dtype"]) == (64, 1, 1e-6, 0.04, "bfloat16")
    assert params["advantage"]["filter_groups"] is (name == "w1")   # random completions earn nothing
    assert list(params["iterations"]) == ["it0"] and params["evaluations"] == {}
    assert [n for n, _ in gpu.stage_commands(params)] == list(gpu.STAGES)
    with pytest.raises(SystemExit, match="unknown model"):
        gpu.model_overrides("gpt5", tmp_path)


def test_random_model_is_half_a_billion_and_loads(tiny_model, tmp_path):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        big = LlamaForCausalLM(LlamaConfig(vocab_size=49152, **gpu.RANDOM_05B))
    assert 0.45e9 < sum(p.numel() for p in big.parameters()) < 0.55e9
    with torch.device("meta"):   # w1-random: SmolLM2-135M's shapes (134.5M parameters with its 49152 tokens)
        w1 = LlamaForCausalLM(LlamaConfig(vocab_size=49152, **gpu.SMOLLM2_135M))
    assert sum(p.numel() for p in w1.parameters()) == 134_515_008
    small = dict(gpu.RANDOM_05B, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=32)
    n = gpu.build_random_model(Path(tiny_model), tmp_path / "rnd", small)
    from grpo_pipeline.checkpoint import load_model, load_tokenizer

    model = load_model(str(tmp_path / "rnd"))
    assert sum(p.numel() for p in model.parameters()) == n and model.config.num_hidden_layers == 2
    assert len(load_tokenizer(str(tmp_path / "rnd"))) == model.config.vocab_size


def test_one_iteration_through_the_real_stages(tiny_model, tmp_path):
    over = ["base.source=hf", f"base.path={tiny_model}", "sampling.dtype=float32", "update.dtype=float32",
            "sampling.max_new_tokens=16", "advantage.filter_groups=false", "sft.max_examples=8",
            "data.n_train=16", "data.n_eval=8"]
    r = gpu.run_model("w1", over, tmp_path, "hf")
    assert r["failed"] is None, r["log_tail"]
    assert list(r["times"]) == ["check", *gpu.STAGES]
    assert r["sample"]["completions"] == 64 and r["update"]["steps"] == 1
    line = gpu.report(r, peak=1e12)
    assert "update@it0" in line and "MFU" in line and "FAILED" not in line
    assert json.loads((tmp_path / "w1/metrics/iterations/it0/update.json").read_text())["gflop_per_s"] > 0
