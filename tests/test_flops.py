"""FLOP counting and MFU (grpo_pipeline.flops) and the update stage's phase / FLOP metrics."""

from __future__ import annotations

import pytest
import torch

from grpo_pipeline import flops
from grpo_pipeline.checkpoint import load_model
from grpo_pipeline.run.update import flop_metrics, phase_times
from grpo_pipeline.update import Rollout


@pytest.mark.parametrize("tied", [True, False])
def test_param_counts_leave_out_embedding_and_head(tiny_model, tied):
    model = load_model(tiny_model, dtype="float32")
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight
    else:
        assert model.lm_head.weight is not model.model.embed_tokens.weight
    n, head = flops.param_counts(model)
    layers = sum(p.numel() for p in model.model.layers.parameters()) + model.model.norm.weight.numel()
    assert (n, head) == (layers, model.lm_head.weight.numel())
    emb = 0 if tied else model.model.embed_tokens.weight.numel()
    assert n + head + emb == sum(p.numel() for p in model.parameters())   # parameters() lists a tied one once


def test_update_flops_six_n_d_plus_head_and_forward_passes():
    f = flops.forward_flops(100, 10, decoder_tokens=7, head_tokens=5)
    assert f == 2 * 100 * 7 + 2 * 10 * 5
    assert flops.update_flops(100, 10, decoder_tokens=7, head_tokens=5) == 3 * f
    assert flops.update_flops(100, 10, decoder_tokens=7, head_tokens=5, train_passes=2, nograd_passes=1.5) == 7.5 * f


def test_useful_tokens_count_each_distinct_prompt_once():
    prompts = [[1, 2, 3], [1, 2, 3], [4, 5], [1, 2]]
    completions = [[9], [9, 9], [8, 8, 8], [7]]
    assert flops.useful_tokens(prompts, completions) == (3 + 2 + 2 + 7, 7)


def test_matmul_peak_and_mfu():
    peak = flops.matmul_peak(torch.float32, size=128, seconds=0.05)
    assert 1e6 < peak < 1e15
    assert flops.mfu(50.0, 2.0, 100.0) == 0.25
    assert flops.mfu(1.0, 0.0, 100.0) != flops.mfu(1.0, 0.0, 100.0)   # nan without a duration


def test_stage_phase_times_and_flop_metrics():
    hist = [{"prep_s": 1.0, "old_rows": 2, "forward_s": 2.0, "backward_s": 3.0, "optimizer_s": 0.5, "time_s": 6.0},
            {"forward_s": 1.0, "backward_s": 1.0, "optimizer_s": 0.5, "time_s": 3.0}]
    t = phase_times(hist, {"load_policy": 4.0, "reference": 2.5})
    assert t == {"time/load_policy_s": 4.0, "time/reference_s": 2.5, "time/old_logprobs_s": 1.0,
                 "time/forward_s": 3.0, "time/backward_s": 4.0, "time/optimizer_s": 1.0}
    rows = [Rollout([1, 2], [3, 4, 5], 1.0), Rollout([1, 2], [6], -1.0), Rollout([7], [8, 9], 0.0),
            Rollout([7], [8], 0.0)]
    m = flop_metrics(10**9, 10**8, rows, mu=1, old_share=0.5, reference_pass=True, seconds=2.0)
    # decoder: prompts [1, 2] and [7] once (3) + 7 completion tokens; head: 7 tokens; 3 + 0.5 + 1 forwards
    assert m == {"model_gflop": 4.5 * (2 * 10 + 2 * 0.1 * 7), "gflop_per_s": 4.5 * (2 * 10 + 2 * 0.1 * 7) / 2}
