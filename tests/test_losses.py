"""Tests for grpo_pipeline.losses against independent float64 references written with loops."""

from __future__ import annotations

import functools
import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from grpo_pipeline import losses
from grpo_pipeline.config import UpdateConfig
from grpo_pipeline.losses import (
    AGGREGATIONS,
    KL_ESTIMATORS,
    get_aggregation,
    get_kl_estimator,
)

_U = UpdateConfig()  # grpo_loss takes every setting; these tests use params.yaml's defaults unless they say
grpo_loss = functools.partial(losses.grpo_loss, eps_low=_U.epsilon, beta=_U.beta, kl_estimator=_U.kl_estimator,
                              aggregation=_U.aggregation, loss=_U.loss,
                              importance_sampling_level=_U.importance_sampling_level,
                              rollout_correction=_U.rollout_correction,
                              rollout_correction_level=_U.rollout_correction_level,
                              rollout_correction_cap=_U.rollout_correction_cap)

AGGS = ["seq_mean_token_mean", "token_mean", "seq_mean_token_sum_norm"]
ESTS = ["k1", "k2", "k3"]
MAX_TOKENS = 9  # Dr. GRPO's constant normaliser, larger than T below


def make_batch(seed: int, *, B: int = 5, T: int = 7, per_token: bool = False, garbage: float = float("nan")):
    """Random right-padded batch with holes; masked positions hold `garbage`."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = torch.arange(T)[None, :] < lengths[:, None]
    mask &= torch.rand(B, T, generator=g) > 0.2
    mask[:, 0] = True
    logp = -3 * torch.rand(B, T, generator=g, dtype=torch.float64)
    logp_old = logp + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)
    logp_ref = logp + 0.5 * torch.randn(B, T, generator=g, dtype=torch.float64)
    adv = torch.randn((B, T) if per_token else (B,), generator=g, dtype=torch.float64)
    for x in (logp, logp_old, logp_ref):
        x[~mask] = garbage
    if per_token:
        adv[~mask] = garbage
    return logp, logp_old, adv, mask, logp_ref


def reference_loss(logp, logp_old, adv, mask, logp_ref, *, eps_low, eps_high, beta, est, agg, max_tokens=MAX_TOKENS):
    """Straightforward float64 loops over sequences and tokens."""
    B, T = mask.shape
    sums, counts = [], []
    for i in range(B):
        s, n = torch.zeros((), dtype=torch.float64), 0
        for t in range(T):
            if not mask[i, t]:
                continue
            a = float(adv[i] if adv.dim() == 1 else adv[i, t])
            r = torch.exp(logp[i, t] - logp_old[i, t])
            surr = torch.minimum(r * a, torch.clamp(r, 1 - eps_low, 1 + eps_high) * a)
            d = logp[i, t] - logp_ref[i, t]  # log(pi_theta / pi_ref)
            kl = {"k1": d, "k2": 0.5 * d * d, "k3": torch.exp(-d) + d - 1}[est]
            s = s - surr + beta * kl
            n += 1
        sums.append(s)
        counts.append(n)
    if agg == "seq_mean_token_mean":
        return sum(s / n if n else s * 0 for s, n in zip(sums, counts, strict=True)) / B
    if agg == "token_mean":
        return sum(sums) / sum(counts)
    return sum(s / max_tokens for s in sums) / B


def loss_and_grad(fn, logp):
    leaf = logp.detach().clone().requires_grad_(True)
    out = fn(leaf)
    loss = out[0] if isinstance(out, tuple) else out
    loss.backward()
    return loss.detach(), leaf.grad


@pytest.mark.parametrize("per_token", [False, True], ids=["outcome_adv", "token_adv"])
@pytest.mark.parametrize("est", ESTS)
@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("seed", [0, 1])
def test_loss_and_grad_match_loop_reference(seed, agg, est, per_token):
    logp, logp_old, adv, mask, logp_ref = make_batch(seed, per_token=per_token)
    kw = {"eps_low": 0.2, "eps_high": 0.28, "beta": 0.1}
    got, got_grad = loss_and_grad(
        lambda lp: grpo_loss(
            lp, logp_old, adv, mask, logp_ref=logp_ref, kl_estimator=est, aggregation=agg, max_tokens=MAX_TOKENS, **kw
        ),
        logp,
    )
    want, want_grad = loss_and_grad(
        lambda lp: reference_loss(lp, logp_old, adv, mask, logp_ref, est=est, agg=agg, **kw), logp
    )
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-10, atol=1e-12)
    assert torch.all(got_grad[~mask] == 0)


@pytest.mark.parametrize("agg", AGGS)
def test_float32_inputs_match_float64_reference(agg):
    logp, logp_old, adv, mask, logp_ref = make_batch(3, per_token=True)
    f32 = [x.float() for x in (logp_old, adv, logp_ref)]
    got, got_grad = loss_and_grad(
        lambda lp: grpo_loss(lp, f32[0], f32[1], mask, logp_ref=f32[2], aggregation=agg, max_tokens=MAX_TOKENS),
        logp.float(),
    )
    kw = {"eps_low": 0.2, "eps_high": 0.2, "beta": 0.04, "est": "k3", "agg": agg}
    want, want_grad = loss_and_grad(lambda lp: reference_loss(lp, logp_old, adv, mask, logp_ref, **kw), logp)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_grad.double(), want_grad, rtol=1e-4, atol=1e-6)


def test_without_kl_term():
    logp, logp_old, adv, mask, logp_ref = make_batch(4)
    kw = {"eps_low": 0.2, "eps_high": 0.2, "est": "k3", "agg": "seq_mean_token_mean"}
    want = reference_loss(logp, logp_old, adv, mask, logp_ref, beta=0.0, **kw)
    no_ref, m = grpo_loss(logp, logp_old, adv, mask, beta=0.0)
    zero_beta, m0 = grpo_loss(logp, logp_old, adv, mask, logp_ref=logp_ref, beta=0.0)
    torch.testing.assert_close(no_ref, want)
    torch.testing.assert_close(zero_beta, want)
    assert math.isnan(m["kl"]) and m0["kl"] > 0  # still measured when the reference is given


def kl_grad(est, logp, logp_ref):
    """d KL_t / d logp_t for each estimator, by hand."""
    return {"k1": torch.ones_like(logp), "k2": logp - logp_ref, "k3": 1 - torch.exp(logp_ref - logp)}[est]


@pytest.mark.parametrize("est", ESTS)
@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("per_token", [False, True], ids=["outcome_adv", "token_adv"])
def test_mu_one_is_policy_gradient_plus_kl_gradient(est, agg, per_token):
    logp, _, adv, mask, logp_ref = make_batch(5, per_token=per_token, garbage=0.0)
    beta = 0.1
    kw = {"logp_ref": logp_ref, "beta": beta, "kl_estimator": est, "aggregation": agg, "max_tokens": MAX_TOKENS}
    _loss, grad = loss_and_grad(lambda lp: grpo_loss(lp, lp.detach(), adv, mask, **kw), logp)
    _, m = grpo_loss(logp, logp, adv, mask, logp_ref=logp_ref, beta=beta, kl_estimator=est)
    assert m["ratio_min"] == 1 and m["ratio_max"] == 1 and m["clip_frac_low"] == 0 and m["clip_frac_high"] == 0
    B = mask.shape[0]
    lengths = mask.sum(-1, keepdim=True).double()
    weight = {  # d loss / d x_it for a per-token value x_it under each aggregation
        "seq_mean_token_mean": 1 / (lengths * B),
        "token_mean": 1 / mask.sum().double(),
        "seq_mean_token_sum_norm": torch.full_like(lengths, 1 / (MAX_TOKENS * B)),
    }[agg]
    a = adv[:, None] if adv.dim() == 1 else adv
    want = torch.where(mask, weight * (-a + beta * kl_grad(est, logp, logp_ref)), 0.0)
    torch.testing.assert_close(grad, want, rtol=1e-12, atol=1e-14)


def test_clipping_zeroes_exactly_the_tokens_the_min_picks_clipped():
    # token:        clipped-high  clipped-low   r>1+e,A<0    r<1-e,A>0   inside       inside
    r = torch.tensor([[1.5, 0.5, 1.5, 0.5, 1.1, 0.9]], dtype=torch.float64)
    adv = torch.tensor([[1.0, -1.0, -1.0, 1.0, 1.0, -1.0]], dtype=torch.float64)
    mask = torch.ones_like(r, dtype=torch.bool)
    logp_old = torch.zeros_like(r)
    _, grad = loss_and_grad(lambda lp: grpo_loss(lp, logp_old, adv, mask, beta=0.0, aggregation="token_mean"), r.log())
    want = torch.tensor([[0.0, 0.0, 1.5, -0.5, -1.1, 0.9]], dtype=torch.float64) / 6  # -A * r / N off the clip
    torch.testing.assert_close(grad, want, rtol=1e-12, atol=0)
    assert grad[0, 0] == 0 and grad[0, 1] == 0
    _, m = grpo_loss(r.log(), logp_old, adv, mask, beta=0.0)
    assert m["clip_frac_low"] == pytest.approx(1 / 6) and m["clip_frac_high"] == pytest.approx(1 / 6)
    assert m["ratio_min"] == pytest.approx(0.5) and m["ratio_max"] == pytest.approx(1.5)


def test_clip_higher_widens_only_the_upper_band():
    r = torch.tensor([[1.25, 0.78]], dtype=torch.float64)  # inside [0.8, 1.28] upper, outside lower
    adv = torch.tensor([1.0], dtype=torch.float64)
    mask = torch.ones_like(r, dtype=torch.bool)
    zeros = torch.zeros_like(r)
    _, sym = loss_and_grad(lambda lp: grpo_loss(lp, zeros, adv, mask, beta=0.0, eps_low=0.2), r.log())
    _, hi = loss_and_grad(lambda lp: grpo_loss(lp, zeros, adv, mask, beta=0.0, eps_low=0.2, eps_high=0.28), r.log())
    assert sym[0, 0] == 0 and hi[0, 0] != 0  # 1.25 is clipped at eps=0.2 but not with eps_high=0.28
    assert sym[0, 1] != 0 and hi[0, 1] == sym[0, 1]  # A>0 and r<1-eps: the min keeps r*A either way
    same, _ = grpo_loss(r.log(), zeros, adv, mask, beta=0.0, eps_low=0.2, eps_high=0.2)
    assert same == grpo_loss(r.log(), zeros, adv, mask, beta=0.0, eps_low=0.2)[0]


@settings(max_examples=60, deadline=None)
@given(
    tokens=st.lists(
        st.tuples(st.floats(-1.0, 1.0), st.floats(-3.0, 3.0).filter(lambda a: abs(a) > 1e-3)), min_size=1, max_size=8
    ),
    eps_low=st.floats(0.05, 0.4),
    eps_high=st.floats(0.05, 0.4),
)
def test_clipping_property(tokens, eps_low, eps_high):
    log_r = torch.tensor([[lr for lr, _ in tokens]], dtype=torch.float64)
    adv = torch.tensor([[a for _, a in tokens]], dtype=torch.float64)
    r = log_r.exp()
    assume(bool(((r - (1 - eps_low)).abs() > 1e-6).all() and ((r - (1 + eps_high)).abs() > 1e-6).all()))
    mask = torch.ones_like(r, dtype=torch.bool)
    _, grad = loss_and_grad(
        lambda lp: grpo_loss(
            lp, torch.zeros_like(r), adv, mask, beta=0.0, eps_low=eps_low, eps_high=eps_high, aggregation="token_mean"
        ),
        log_r,
    )
    clipped = ((r > 1 + eps_high) & (adv > 0)) | ((r < 1 - eps_low) & (adv < 0))
    assert torch.all(grad[clipped] == 0)
    torch.testing.assert_close(grad[~clipped], (-adv * r / r.numel())[~clipped], rtol=1e-12, atol=0)
    assert torch.all(grad[~clipped] != 0)


@pytest.mark.parametrize("split", [1, 2, 5])
@pytest.mark.parametrize("per_token", [False, True], ids=["outcome_adv", "token_adv"])
@pytest.mark.parametrize("agg", AGGS)
def test_micro_batches_sum_to_the_full_batch(agg, per_token, split):
    logp, logp_old, adv, mask, logp_ref = make_batch(6, B=6, per_token=per_token)
    kw = {"logp_ref": logp_ref, "beta": 0.1, "aggregation": agg, "max_tokens": MAX_TOKENS}
    full, full_grad = loss_and_grad(lambda lp: grpo_loss(lp, logp_old, adv, mask, **kw), logp)
    leaf = logp.clone().requires_grad_(True)
    total, local_total = 0.0, 0.0
    for sl in (slice(0, split), slice(split, None)):
        micro_kw = {**kw, "logp_ref": logp_ref[sl]}
        args = (leaf[sl], logp_old[sl], adv[sl], mask[sl])
        loss, _ = grpo_loss(*args, global_num_seqs=mask.shape[0], global_num_tokens=mask.sum(), **micro_kw)
        loss.backward()
        total += loss.detach()
        local_total += grpo_loss(*args, **micro_kw)[0].detach()
    torch.testing.assert_close(total, full, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(leaf.grad, full_grad, rtol=1e-12, atol=1e-14)
    assert not torch.isclose(local_total, full)  # the global counts are what make it add up


def test_empty_sequence_contributes_zero_but_counts():
    logp, logp_old, adv, mask, logp_ref = make_batch(7, B=4)
    mask[2] = False
    loss, _ = grpo_loss(logp, logp_old, adv, mask, logp_ref=logp_ref)
    keep = [0, 1, 3]
    rest, _ = grpo_loss(logp[keep], logp_old[keep], adv[keep], mask[keep], logp_ref=logp_ref[keep])
    torch.testing.assert_close(loss, rest * 3 / 4)


@pytest.mark.parametrize("garbage", [float("nan"), float("inf"), -float("inf"), 1e30])
def test_masked_positions_have_no_effect(garbage):
    clean = make_batch(8, per_token=True, garbage=0.0)
    dirty = make_batch(8, per_token=True, garbage=garbage)
    outs = []
    for logp, *rest, logp_ref in (clean, dirty):
        loss, grad = loss_and_grad(lambda lp, rest=rest, ref=logp_ref: grpo_loss(lp, *rest, logp_ref=ref), logp)
        metrics = grpo_loss(logp, *rest, logp_ref=logp_ref)[1]
        outs.append((loss, grad, metrics))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    assert all(torch.equal(outs[0][2][k], outs[1][2][k]) for k in outs[0][2])


# --------------------------------------------------------------------------- registries and errors
def test_registries_hold_the_documented_names():
    assert sorted(KL_ESTIMATORS) == sorted(ESTS) and sorted(AGGREGATIONS) == sorted(AGGS)


@pytest.mark.parametrize(
    ("kwargs", "valid"),
    [({"kl_estimator": "k4"}, ESTS), ({"aggregation": "seq_sum"}, AGGS)],
)
def test_unknown_names_list_the_valid_ones(kwargs, valid):
    logp, logp_old, adv, mask, logp_ref = make_batch(10)
    for ref, beta in ((logp_ref, 0.04), (None, 0.0)):  # also when no KL term is computed
        with pytest.raises(ValueError, match="Valid names") as info:
            grpo_loss(logp, logp_old, adv, mask, logp_ref=ref, beta=beta, **kwargs)
        assert all(name in str(info.value) for name in valid)
    getter = get_kl_estimator if "kl_estimator" in kwargs else get_aggregation
    with pytest.raises(ValueError, match=next(iter(kwargs.values()))):
        getter(next(iter(kwargs.values())))


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"logp_ref": None}, "needs logp_ref"),
        ({"aggregation": "seq_mean_token_sum_norm"}, "needs a positive max_tokens"),
        ({"advantages": torch.zeros(3)}, r"advantages has shape \(3,\)"),
        ({"mask": torch.ones(5, 6, dtype=torch.bool)}, r"mask has shape \(5, 6\)"),
        ({"global_num_seqs": 0}, "global_num_seqs must be positive"),
        ({"aggregation": "token_mean", "global_num_tokens": torch.tensor(0)}, "global_num_tokens must be positive"),
    ],
)
def test_bad_arguments_raise_clear_errors(change, match):
    logp, logp_old, adv, mask, logp_ref = make_batch(11)
    kw = {"advantages": adv, "mask": mask, "logp_ref": logp_ref, **change}
    adv, mask = kw.pop("advantages"), kw.pop("mask")
    with pytest.raises(ValueError, match=match):
        grpo_loss(logp, logp_old, adv, mask, **kw)
