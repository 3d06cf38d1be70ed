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


def test_frozen_weights_cost_two_forwards_not_three():
    f = flops.forward_flops(100, 10, decoder_tokens=7, head_tokens=5)
    assert flops.update_flops(100, 10, decoder_tokens=7, head_tokens=5, trained_params=100) == 3 * f
    # LoRA-like: 4 of the 100 trained, head frozen: forward + input gradients + the 4's weight gradients
    got = flops.update_flops(100, 10, decoder_tokens=7, head_tokens=5, trained_params=4, head_trained=False,
                             nograd_passes=1)
    assert got == 2 * f + 2 * 4 * 7 + f


@pytest.mark.parametrize("use_lora", [False, True])
def test_counted_flops_match_torch_flop_counter(tiny_model, use_lora):
    """The formula against torch's own count of a real forward+backward (matrix products only; all tokens
    projected by the head, so decoder and head tokens are the same)."""
    from torch.utils.flop_counter import FlopCounterMode

    from grpo_pipeline import lora
    from grpo_pipeline.config import UpdateConfig

    model = load_model(tiny_model, dtype="float32")
    n, head = flops.param_counts(model)
    if use_lora:
        model = lora.attach(model, UpdateConfig.LoRA(rank=4, alpha=8.0))
    n_trained, head_trained = flops.trainable_counts(model)
    assert head_trained is not use_lora
    if use_lora:
        adapters = sum(p.numel() for name, p in model.named_parameters() if "lora_" in name)
        assert n_trained == adapters > 0
    else:
        assert n_trained == n
    ids = torch.randint(3, 500, (2, 16), generator=torch.Generator().manual_seed(0))
    with FlopCounterMode(display=False) as counter:
        model(input_ids=ids).logits.float().sum().backward()
    counts = counter.get_flop_counts()["Global"]
    measured = sum(v for op, v in counts.items() if "mm" in str(op) and "bmm" not in str(op))   # not attention's
    predicted = flops.update_flops(n, head, decoder_tokens=ids.numel(), head_tokens=ids.numel(),
                                   trained_params=n_trained, head_trained=head_trained)
    # N counts the norms' weights too (0.4% here); LoRA: the adapters' forward is left out and layer 0's
    # q/k/v get no input gradient (their input needs none)
    assert measured == pytest.approx(predicted, rel=0.05 if use_lora else 0.01)
    if use_lora:   # and far from the 3 forwards a trained weight costs
        assert measured < 0.8 * flops.update_flops(n, head, decoder_tokens=ids.numel(), head_tokens=ids.numel())
