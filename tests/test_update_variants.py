"""The update stage body with each loss variant, correction and LoRA, on a tiny Llama and real Parquet inputs:
each option writes a loadable checkpoint, takes effect, and reports the sampler-trainer mismatch it was given."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from grpo_pipeline.checkpoint import load_model
from grpo_pipeline.config import UpdateConfig
from grpo_pipeline.update import Rollout, rollout_logprobs
from tests.test_update import ckpts, one_thread, rand_rollouts, stage_run, weights, write_stage_inputs  # noqa: F401

BASE = {"lr": 1e-3, "beta": 0.04, "mu": 1, "minibatch_size": 4, "micro_batch_size": 2, "lora": None}  # full FT
NOISE = 0.3  # |logp_sampler - logp_trainer| injected per token
OPTIONS = {
    "default": {},
    "cispo": {"loss": "cispo"},
    "gspo": {"importance_sampling_level": "sequence"},
    "tis_token": {"rollout_correction": "tis", "rollout_correction_cap": 1.2},
    "mis_sequence": {"rollout_correction": "mis", "rollout_correction_level": "sequence"},
}


@pytest.fixture(scope="module")
def variant_runs(tmp_path_factory, ckpts):  # noqa: F811
    """Rows whose stored sampler log-probs are the policy's own plus +-NOISE, and one update per option."""
    tmp = tmp_path_factory.mktemp("variants")
    rows = rand_rollouts(8, seed=3, groups=True)
    lp = rollout_logprobs(load_model(ckpts["policy"]), rows, range(len(rows)), pad_id=0,
                          cfg=UpdateConfig(**BASE), device=torch.device("cpu"))      # (N, C_max)
    sign = torch.Generator().manual_seed(0)
    rows = [Rollout(r.prompt_ids, r.completion_ids, r.advantage, r.key, sampler_logprobs=[
        float(x) + NOISE * (1 if bool(torch.rand(1, generator=sign) < 0.5) else -1)
        for x in lp[i, : len(r.completion_ids)]]) for i, r in enumerate(rows)]
    data = write_stage_inputs(tmp, rows)
    return tmp, {name: stage_run(UpdateConfig(**{**BASE, **kw}), ckpts, data, tmp / name) for name, kw in OPTIONS.items()}


@pytest.mark.parametrize("name", list(OPTIONS))
def test_each_option_trains_and_reports_the_mismatch(variant_runs, ckpts, name):  # noqa: F811
    tmp, metrics = variant_runs
    m = metrics[name]
    assert m["steps"] == 2
    # the stored log-probs differ from the trainer's by exactly NOISE (float32 forward noise aside)
    assert m["mismatch/logp_diff_mean"] == pytest.approx(NOISE, abs=1e-4)
    assert m["mismatch/logp_diff_max"] == pytest.approx(NOISE, abs=1e-4)
    k3 = 0.5 * (torch.tensor(NOISE).exp() - NOISE - 1) + 0.5 * (torch.tensor(-NOISE).exp() + NOISE - 1)
    assert m["mismatch/kl_k3"] == pytest.approx(float(k3), rel=0.2)     # about half the tokens each sign
    steps = json.loads(Path(f"{tmp / name}.steps.json").read_text())
    assert all("mismatch/outside_cap_share" in s for s in steps)
    w, w0 = weights(tmp / name), weights(ckpts["policy"])
    assert any(not torch.equal(w[k], w0[k]) for k in w0)                 # it trained
    assert load_model(str(tmp / name)) is not None                        # a plain HF checkpoint
    if name != "default":                                                 # and the option took effect
        assert any(not torch.equal(w[k], weights(tmp / "default")[k]) for k in w)


def test_corrections_weight_as_configured(variant_runs):
    _, m = variant_runs
    assert m["default"]["mismatch/weight_mean"] == 1.0
    # token TIS at cap 1.2: weight exp(+-0.3) -> min(., 1.2) = 1.2 or 0.741
    assert 0.741 < m["tis_token"]["mismatch/weight_mean"] < 1.2 and m["tis_token"]["mismatch/outside_cap_share"] > 0.2
    # sequence MIS at cap 3: sequences whose summed log-weight exceeds log 3 are dropped
    assert 0 <= m["mis_sequence"]["mismatch/outside_cap_share"] < 1


LORA = {"rank": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj", "up_proj"]}


def test_lora_writes_a_merged_checkpoint_and_carries_adapters(tmp_path, ckpts, capsys):  # noqa: F811
    """Two LoRA updates with carried state == the same two updates on one PeftModel; only targets change."""
    from grpo_pipeline import lora
    from grpo_pipeline.update import train

    cfg = UpdateConfig(**{**BASE, "lora": LORA, "seed": 3})
    rows_a, rows_b = rand_rollouts(8, seed=11, groups=True), rand_rollouts(8, seed=12, groups=True)
    da, db = write_stage_inputs(tmp_path / "a", rows_a), write_stage_inputs(tmp_path / "b", rows_b, iteration="it1")
    m1 = stage_run(cfg, ckpts, da, tmp_path / "it1")
    m2 = stage_run(cfg, ckpts, db, tmp_path / "it2", policy=str(tmp_path / "it1"))
    assert (m1["optimizer_state"], m2["optimizer_state"]) == ("fresh", "resumed")
    w0, w1, w2 = weights(ckpts["policy"]), weights(tmp_path / "it1"), weights(tmp_path / "it2")
    assert set(w1) == set(w0)                                             # merged: plain HF names, no lora_*
    changed = {k for k in w0 if not torch.equal(w0[k], w2[k])}
    assert changed and all(any(t in k for t in LORA["target_modules"]) for k in changed)

    # the same in one process: one PeftModel, one optimizer over its adapters
    torch.manual_seed(3)
    model = lora.attach(load_model(ckpts["policy"]), cfg.lora)
    ref = load_model(ckpts["reference"]).eval()
    h1, opt = train(model, rows_a, cfg, pad_id=0, ref_model=ref, max_tokens=8)
    train(model, rows_b, cfg, pad_id=0, ref_model=ref, optimizer=opt, start_step=len(h1), max_tokens=8)
    for k, v in lora.merged(model).state_dict().items():
        torch.testing.assert_close(w2[k], v, rtol=0, atol=2e-6, msg=k)

    # a full fine-tuning update after LoRA does not take the adapters' moments
    capsys.readouterr()
    m3 = stage_run(UpdateConfig(**BASE), ckpts, db, tmp_path / "it3", policy=str(tmp_path / "it2"))
    assert m3["optimizer_state"] == "fresh" and "written with LoRA adapters" in capsys.readouterr().out


def test_lora_bf16_base_copies_change_no_product_and_not_the_checkpoint(tmp_path, ckpts, monkeypatch):  # noqa: F811
    """Under bf16 autocast the update stores the frozen base weights in bf16 (no cast per product): the losses
    and the merged float32 weights equal those of float32 base weights bit for bit, and the stage does it."""
    from grpo_pipeline import lora
    from grpo_pipeline.update import train

    cfg = UpdateConfig(**{**BASE, "lora": LORA, "seed": 3, "dtype": "bfloat16"})
    rows = rand_rollouts(8, seed=11, groups=True)
    ref = load_model(ckpts["reference"], dtype="bfloat16").eval()   # as the stage loads it under bf16
    runs = {}
    for copies in (False, True):
        torch.manual_seed(3)
        model = lora.attach(load_model(ckpts["policy"]), cfg.lora)
        originals = lora.compute_copies(model, torch.bfloat16) if copies else None
        bases = {n: m.get_base_layer().weight for n, m in lora._layers(model).items()}
        if copies:
            assert set(originals) == set(bases) and len(bases) == 3 * 2            # 3 targets x 2 layers
            assert all(w.dtype == torch.bfloat16 and not w.requires_grad for w in bases.values())
            assert all(w.dtype == torch.float32 for w in originals.values())
        history, _ = train(model, rows, cfg, pad_id=0, ref_model=ref, max_tokens=8)
        runs[copies] = ([h["loss"] for h in history], {k: v.clone() for k, v in
                                                         lora.merged(model, originals).state_dict().items()})
    assert runs[True][0] == runs[False][0] and len(runs[True][0]) == 2
    w_plain, w_copies = runs[False][1], runs[True][1]
    assert all(v.dtype == torch.float32 for v in w_copies.values())
    for k in w_plain:
        assert torch.equal(w_plain[k], w_copies[k]), k                  # not rounded to bf16 by the copies
    w0 = weights(ckpts["policy"])
    assert any(not torch.equal(w0[k], w_copies[k]) for k in w0)        # it trained

    # the stage (which makes the copies under bf16) writes the same float32 checkpoint
    made, real = [], lora.compute_copies
    monkeypatch.setattr(lora, "compute_copies", lambda m, dt: made.append(dt) or real(m, dt))
    data = write_stage_inputs(tmp_path, rows)
    stage_run(cfg, ckpts, data, tmp_path / "it1")
    assert made == [torch.bfloat16]
    for k, v in weights(tmp_path / "it1").items():
        torch.testing.assert_close(v, w_plain[k], rtol=0, atol=2e-6, msg=k)


def test_frozen_head_cast_once_per_call_and_results_unchanged(ckpts, monkeypatch):  # noqa: F811
    """LoRA under bf16 autocast: the frozen LM head is cast to bf16 once per train() call, not per chunk and
    pass, and the losses and merged weights equal those of a cast at every use bit for bit."""
    from grpo_pipeline import lora, policy
    from grpo_pipeline.update import train

    cfg = UpdateConfig(**{**BASE, "lora": LORA, "seed": 3, "dtype": "bfloat16", "micro_batch_size": 2})
    rows = rand_rollouts(8, seed=11, groups=True)
    ref = load_model(ckpts["reference"], dtype="bfloat16").eval()
    real, runs = policy.frozen_cast, {}
    for cached in (True, False):
        torch.manual_seed(3)
        model = lora.attach(load_model(ckpts["policy"]), cfg.lora)
        head = model.get_output_embeddings().weight
        casts = []

        def spy(w, dtype, cached=cached, head=head, casts=casts):
            out = real(w, dtype) if cached else w.to(dtype)
            if w is head:
                casts.append(out.data_ptr())
            return out

        monkeypatch.setattr(policy, "frozen_cast", spy)
        history, _ = train(model, rows, cfg, pad_id=0, ref_model=ref, max_tokens=8)
        runs[cached] = ([h["loss"] for h in history], {k: v.clone() for k, v in lora.merged(model).state_dict().items()})
        # 2 steps x 2 micro-batches x (1 forward + 1 backward use) + pi_old's pass over step 2's rows
        assert len(casts) >= 2 * 2 * 2
        if cached:
            assert len(set(casts)) == 1
    assert runs[True][0] == runs[False][0]
    for k, v in runs[False][1].items():
        assert torch.equal(v, runs[True][1][k]), k


def test_frozen_cast_is_kept_only_for_unchanged_frozen_weights_inside_the_block():
    from grpo_pipeline.policy import frozen_cast, frozen_casts

    w = torch.randn(5, 3)
    assert frozen_cast(w, torch.bfloat16) is not frozen_cast(w, torch.bfloat16)    # outside: a cast per use
    with frozen_casts():
        a = frozen_cast(w, torch.bfloat16)
        assert frozen_cast(w, torch.bfloat16) is a and torch.equal(a, w.to(torch.bfloat16))
        with torch.no_grad():
            w.add_(1.0)                                     # an in-place change: a new copy of the new values
        b = frozen_cast(w, torch.bfloat16)
        assert b is not a and torch.equal(b, w.to(torch.bfloat16))
        t = torch.nn.Parameter(torch.randn(5, 3))          # a weight that trains: never kept
        assert frozen_cast(t, torch.bfloat16) is not frozen_cast(t, torch.bfloat16)
        assert frozen_cast(w, torch.float32) is w


def test_bad_inputs_name_the_row_or_key(tiny_model):
    from grpo_pipeline import lora
    from grpo_pipeline.update import train

    model = load_model(tiny_model)
    with pytest.raises(ValueError, match=r"target_modules \['qkv'\] match no linear layer.*'q_proj'"):
        lora.attach(model, UpdateConfig.LoRA(target_modules=["qkv"]))
    rows = rand_rollouts(4, seed=1)
    with pytest.raises(ValueError, match="rollout_correction is 'tis' but rollout 'p0/0' has no sampler log-probs"):
        train(model, rows, UpdateConfig(**{**BASE, "rollout_correction": "tis"}), pad_id=0, max_tokens=8)
    rows[2].sampler_logprobs = [-1.0] * (len(rows[2].completion_ids) + 1)
    for r in rows[:2] + rows[3:]:
        r.sampler_logprobs = [-1.0] * len(r.completion_ids)
    with pytest.raises(ValueError, match=r"rollout 'p0/2' has \d+ sampler log-probs for \d+ completion tokens"):
        train(model, rows, UpdateConfig(**{**BASE, "beta": 0.0}), pad_id=0, max_tokens=8)
