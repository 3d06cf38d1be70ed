"""GSPO, CISPO and the sampler-trainer correction (TIS / MIS) against independent float64 loops of
their papers' formulas (value and gradient), and against TRL's own ``GRPOTrainer._compute_loss``
when TRL is installed (the ``bench`` extra)."""

from __future__ import annotations

import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from grpo_pipeline.losses import (
    IMPORTANCE_RATIOS,
    POLICY_LOSSES,
    ROLLOUT_CORRECTIONS,
    rollout_mismatch,
)
from tests.test_losses import AGGS, MAX_TOKENS, grpo_loss, loss_and_grad, make_batch

CAP = 1.05  # small enough that the random batches have weights on both sides of it


def sampler_logprobs(logp_old: torch.Tensor, mask: torch.Tensor, seed: int, scale: float = 0.05) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + seed)
    out = logp_old + scale * torch.randn(logp_old.shape, generator=g, dtype=torch.float64)  # (B, T)
    return torch.where(mask, out, float("nan"))


def _agg(sums, counts, B, agg):
    if agg == "seq_mean_token_mean":
        return sum(s / n if n else s * 0 for s, n in zip(sums, counts, strict=True)) / B
    if agg == "token_mean":
        return sum(sums) / sum(counts)
    return sum(s / MAX_TOKENS for s in sums) / B


def paper_loss(logp, logp_old, adv, mask, logp_ref, logp_s=None, *, loss="grpo", level="token", eps_low=0.2,
               eps_high=0.28, beta=0.04, agg="seq_mean_token_mean", corr="none", corr_level="token", cap=CAP):
    """Loops over sequences and tokens, written from the papers:

    GSPO (arXiv:2507.18071 eq. 5-7): s_i = (pi(o_i) / pi_old(o_i))^(1/|o_i|), term -min(s_i A, clip(s_i) A);
    CISPO (arXiv:2506.13585 eq. 4): -sg(clip(r, 0, 1+eps_high)) A log pi; TIS: * min(w, C); MIS: * w 1[w <= C],
    w = pi_old / pi_sampler per token or per sequence (product over its tokens).
    """
    B, T = mask.shape
    sums, counts = [], []
    for i in range(B):
        toks = [t for t in range(T) if mask[i, t]]
        log_s = sum(logp[i, t] - logp_old[i, t] for t in toks) / len(toks) if toks else None
        log_w_seq = sum(logp_old[i, t] - logp_s[i, t] for t in toks) if logp_s is not None and toks else None
        s = torch.zeros((), dtype=torch.float64)
        for t in toks:
            a = float(adv[i] if adv.dim() == 1 else adv[i, t])
            r = torch.exp(log_s) if level == "sequence" else torch.exp(logp[i, t] - logp_old[i, t])
            if loss == "cispo":
                term = -torch.clamp(r.detach(), max=1 + eps_high) * a * logp[i, t]
            else:
                term = -torch.minimum(r * a, torch.clamp(r, 1 - eps_low, 1 + eps_high) * a)
            if corr != "none":
                w = math.exp(float(log_w_seq if corr_level == "sequence" else logp_old[i, t] - logp_s[i, t]))
                term = term * (min(w, cap) if corr == "tis" else (w if w <= cap else 0.0))
            d = logp[i, t] - logp_ref[i, t]
            s = s + term + beta * (torch.exp(-d) + d - 1)
        sums.append(s)
        counts.append(len(toks))
    return _agg(sums, counts, B, agg)


def check(seed, *, per_token=False, agg="seq_mean_token_mean", with_sampler=False, **kw):
    logp, logp_old, adv, mask, logp_ref = make_batch(seed, per_token=per_token)
    logp_s = sampler_logprobs(logp_old, mask, seed) if with_sampler else None
    names = {"loss": "loss", "level": "importance_sampling_level", "corr": "rollout_correction",
             "corr_level": "rollout_correction_level", "cap": "rollout_correction_cap"}
    ours_kw = {names.get(k, k): v for k, v in kw.items()}
    eps = {"eps_low": kw.get("eps_low", 0.2), "eps_high": kw.get("eps_high", 0.28)}
    ours_kw.update(eps, rollout_correction_cap=kw.get("cap", CAP))
    got, g_got = loss_and_grad(lambda lp: grpo_loss(lp, logp_old, adv, mask, logp_ref=logp_ref, beta=0.04,
                                                    aggregation=agg, max_tokens=MAX_TOKENS, logp_sampler=logp_s,
                                                    **ours_kw), logp)
    want, g_want = loss_and_grad(lambda lp: paper_loss(lp, logp_old, adv, mask, logp_ref, logp_s, agg=agg, **kw),
                                 logp)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(g_got[mask], g_want[mask], rtol=1e-12, atol=1e-14)
    assert (g_got[~mask] == 0).all()
    return got


@pytest.mark.parametrize("per_token", [False, True], ids=["outcome_adv", "token_adv"])
@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gspo_matches_the_paper(seed, agg, per_token):
    check(seed, per_token=per_token, agg=agg, level="sequence", eps_low=0.03, eps_high=0.04)


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_cispo_matches_the_paper(seed, agg, level):
    check(seed, agg=agg, loss="cispo", level=level, eps_high=0.1)


@pytest.mark.parametrize("loss", ["grpo", "cispo"])
@pytest.mark.parametrize("corr_level", ["token", "sequence"])
@pytest.mark.parametrize("corr", ["none", "tis", "mis"])
@pytest.mark.parametrize("seed", [0, 1])
def test_rollout_corrections_match_the_formula(seed, corr, corr_level, loss):
    check(seed, with_sampler=True, loss=loss, corr=corr, corr_level=corr_level)


def test_correction_changes_the_loss_and_none_keeps_it_exact():
    base = check(0)
    assert check(0, with_sampler=True) == base  # logp_sampler only adds metrics
    assert check(0, with_sampler=True, corr="tis") != base
    assert check(0, with_sampler=True, corr="mis", cap=1e9) == check(0, with_sampler=True, corr="tis", cap=1e9)


def test_cispo_gradient_is_the_clipped_weight_times_advantage():
    """d loss / d logp_it = -min(r_it, 1+eps_high) A_i / (|o_i| B) for seq_mean_token_mean: clipped tokens keep it."""
    logp, logp_old, adv, mask, _ = make_batch(3)
    _, grad = loss_and_grad(lambda lp: grpo_loss(lp, logp_old, adv, mask, beta=0.0, loss="cispo", eps_high=0.1), logp)
    r = torch.exp(logp - logp_old).clamp(max=1.1)
    want = -r * adv[:, None] / mask.sum(-1, keepdim=True) / mask.shape[0]
    torch.testing.assert_close(grad[mask], want[mask], rtol=1e-12, atol=0)
    assert (r[mask] == 1.1).any() and (grad[mask] != 0).all()


def test_gspo_ratio_is_one_per_sequence():
    logp, logp_old, adv, mask, _ = make_batch(4)
    _, m = grpo_loss(logp, logp_old, adv, mask, beta=0.0, importance_sampling_level="sequence")
    want = [math.exp(float((logp[i][mask[i]] - logp_old[i][mask[i]]).mean())) for i in range(mask.shape[0])]
    assert float(m["ratio_max"]) == pytest.approx(max(want), rel=1e-12)
    assert float(m["ratio_min"]) == pytest.approx(min(want), rel=1e-12)


def test_mismatch_metrics_match_loops():
    _, logp_old, _, mask, _ = make_batch(5)
    logp_s = sampler_logprobs(logp_old, mask, 5, scale=0.5)
    for level in ("token", "sequence"):
        m = rollout_mismatch(logp_old, logp_s, mask, level=level, cap=1.2)
        d, k3, out = [], [], []
        for i in range(mask.shape[0]):
            seq = float(sum(logp_old[i, t] - logp_s[i, t] for t in range(mask.shape[1]) if mask[i, t]))
            for t in range(mask.shape[1]):
                if mask[i, t]:
                    x = float(logp_old[i, t] - logp_s[i, t])
                    d.append(abs(x))
                    k3.append(math.exp(x) - x - 1)  # KL(sampler || trainer), samples from the sampler
                    out.append(math.exp(seq if level == "sequence" else x) > 1.2)
        assert float(m["mismatch/logp_diff_mean"]) == pytest.approx(sum(d) / len(d), rel=1e-12)
        assert float(m["mismatch/logp_diff_max"]) == pytest.approx(max(d), rel=1e-12)
        assert float(m["mismatch/kl_k3"]) == pytest.approx(sum(k3) / len(k3), rel=1e-12)
        assert float(m["mismatch/outside_cap_share"]) == pytest.approx(sum(out) / len(out), rel=1e-12)
        assert 0 < float(m["mismatch/outside_cap_share"]) < 1


def test_registries_and_errors():
    assert set(IMPORTANCE_RATIOS) == {"token", "sequence"} and set(POLICY_LOSSES) == {"grpo", "cispo"}
    assert set(ROLLOUT_CORRECTIONS) == {"none", "tis", "mis"}
    logp, logp_old, adv, mask, _ = make_batch(0)
    for kw, match in [({"loss": "ppo"}, r"policy loss: 'ppo'.*\['cispo', 'grpo'\]"),
                      ({"importance_sampling_level": "seq"}, r"importance sampling level: 'seq'"),
                      ({"rollout_correction": "is"}, r"rollout correction: 'is'.*\['mis', 'none', 'tis'\]"),
                      ({"rollout_correction": "tis"}, "needs logp_sampler"),
                      ({"logp_sampler": logp[:, :2]}, "logp_sampler has shape")]:
        with pytest.raises(ValueError, match=match):
            grpo_loss(logp, logp_old, adv, mask, beta=0.0, **kw)


# --------------------------------------------------------------------------- TRL's own loss code
def trl_loss(logp, logp_old, adv, mask, logp_ref, *, loss_type, level, eps_low, eps_high, beta, is_ratio=None):
    """``GRPOTrainer._compute_loss`` (TRL's code, unchanged) on a stand-in ``self``: the model forward is
    replaced by returning ``logp`` (the only boundary mocked), distributed helpers by identities."""
    from trl import GRPOTrainer

    acc = SimpleNamespace(gather=lambda x: x.reshape(-1), gather_for_metrics=lambda x: x, num_processes=1,
                          reduce=lambda x, reduction="sum": x, sync_gradients=True)
    fake = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (logp, torch.zeros_like(logp), None),
        top_entropy_quantile=1.0, off_policy_mask_threshold=None, importance_sampling_level=level, beta=beta,
        loss_type=loss_type, epsilon_low=eps_low, epsilon_high=eps_high, use_vllm=is_ratio is not None,
        vllm_importance_sampling_correction=is_ratio is not None, model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1, accelerator=acc, _entropy_bonus_enabled=False, aux_loss_enabled=False,
        args=SimpleNamespace(use_bias_correction_kl=False, delta=None, steps_per_generation=1),
        _metrics={"train": defaultdict(list)},
    )
    n = mask.shape[1]
    inputs = {"prompt_ids": torch.zeros(mask.shape[0], 1, dtype=torch.long), "prompt_mask": torch.ones(mask.shape[0], 1),
              "completion_ids": torch.zeros(mask.shape[0], n, dtype=torch.long), "completion_mask": mask.double(),
              "advantages": adv, "old_per_token_logps": logp_old, "ref_per_token_logps": logp_ref,
              "num_items_in_batch": mask.sum().double()}
    if is_ratio is not None:
        inputs["importance_sampling_ratio"] = is_ratio
    return GRPOTrainer._compute_loss(fake, None, inputs)


def trl_is_ratio(logp_old, logp_s, mask, *, mode, cap):
    """TRL's vLLM importance-sampling ratio (transcribed from GRPOTrainer._generate_and_score_completions,
    where it is computed inline), modes ``{token,sequence}_{truncate,mask}`` with ``clip_max=cap``."""
    diff = torch.nan_to_num((logp_old - logp_s) * mask, nan=0.0)
    ratio = torch.exp(diff.sum(-1, keepdim=True) if mode.startswith("sequence") else diff)
    return ratio.clamp(max=cap) if mode.endswith("truncate") else ratio.masked_fill(ratio > cap, 0.0)


TRL_CASES = [  # (our kwargs, TRL loss_type, TRL level, our aggregation)
    ({}, "grpo", "token", "seq_mean_token_mean"),
    ({"importance_sampling_level": "sequence"}, "grpo", "sequence", "seq_mean_token_mean"),
    ({"loss": "cispo"}, "cispo", "token", "token_mean"),
    ({"loss": "cispo", "importance_sampling_level": "sequence"}, "cispo", "sequence", "token_mean"),
]


@pytest.mark.parametrize("corr", [None, "token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
@pytest.mark.parametrize("case", range(len(TRL_CASES)))
@pytest.mark.parametrize("seed", [0, 1])
def test_against_trl(seed, case, corr):
    pytest.importorskip("trl")
    ours_kw, loss_type, level, agg = TRL_CASES[case]
    logp, logp_old, adv, mask, logp_ref = make_batch(seed, garbage=-1.5)  # TRL multiplies by the mask: finite
    logp_s = torch.where(mask, sampler_logprobs(logp_old, mask, seed), -1.5)
    eps_low, eps_high = (0.03, 0.04) if level == "sequence" else (0.2, 0.28)
    trl_eps_high = 1 + eps_high if loss_type == "cispo" else eps_high  # TRL's CISPO cap is epsilon_high itself
    is_ratio = None if corr is None else trl_is_ratio(logp_old, logp_s, mask, mode=corr, cap=CAP)
    if corr is not None:
        ours_kw = {**ours_kw, "logp_sampler": logp_s, "rollout_correction": "tis" if corr.endswith("truncate") else "mis",
                   "rollout_correction_level": corr.split("_")[0], "rollout_correction_cap": CAP}
    got, g_got = loss_and_grad(lambda lp: grpo_loss(lp, logp_old, adv, mask, logp_ref=logp_ref, beta=0.04,
                                                    eps_low=eps_low, eps_high=eps_high, aggregation=agg,
                                                    **ours_kw), logp)
    want, g_want = loss_and_grad(lambda lp: trl_loss(lp, logp_old, adv[:, None], mask, logp_ref, loss_type=loss_type,
                                                     level=level, eps_low=eps_low, eps_high=trl_eps_high, beta=0.04,
                                                     is_ratio=is_ratio), logp)
    torch.testing.assert_close(got, want, rtol=1e-13, atol=1e-15)
    torch.testing.assert_close(g_got, g_want, rtol=1e-13, atol=1e-15)
