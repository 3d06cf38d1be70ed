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

BASE = {"lr": 1e-3, "beta": 0.04, "mu": 1, "minibatch_size": 4, "micro_batch_size": 2}
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
