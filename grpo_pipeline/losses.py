"""The GRPO objective as pure torch functions (DeepSeekMath, arXiv:2402.03300).

What is implemented (the spec's formula, with the usual variants selectable by name)::

    J(theta) = 1/G sum_i 1/|o_i| sum_t [ min(r_it A_it, clip(r_it, 1-eps_low, 1+eps_high) A_it)
                                         - beta * KL_it(pi_theta || pi_ref) ]
    r_it     = exp(logp_theta - logp_old)                 per-token ratio
    loss     = -J                                         (we minimise)

* clip: ``eps_high`` defaults to ``eps_low``; a larger ``eps_high`` is DAPO's "clip-higher".
* KL: a separate per-token term against the *reference* policy (not folded into the reward),
  estimated by ``"k1"``, ``"k2"`` or ``"k3"`` (default, as in DeepSeekMath), see ``KL_ESTIMATORS``.
  Passing the old policy's log-probs as ``logp_ref`` gives the spec's KL[pi_theta || pi_old] variant.
* aggregation over tokens and sequences: ``"seq_mean_token_mean"`` (the formula above, default),
  ``"token_mean"`` (DAPO) or ``"seq_mean_token_sum_norm"`` (Dr. GRPO), see ``AGGREGATIONS``.
* advantages: ``(B,)`` outcome advantages broadcast over tokens, or ``(B, T)`` per-token
  (process supervision).
* no dual-clip, no entropy bonus, no log-ratio clamping.

Shapes: ``B`` sequences (completions), ``T`` completion tokens (right-padded), ``V`` vocabulary.
``mask`` is ``(B, T)``, nonzero on valid completion tokens. Values at masked positions never
reach the loss or the gradients, even when they are ``inf`` or ``nan``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

Number = int | float | torch.Tensor
KLEstimator = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
Aggregation = Callable[..., torch.Tensor]

KL_ESTIMATORS: dict[str, KLEstimator] = {}
AGGREGATIONS: dict[str, Aggregation] = {}


def register_kl_estimator(name: str) -> Callable[[KLEstimator], KLEstimator]:
    """Register a per-token KL estimator ``f(logp, logp_ref) -> (B, T)`` under ``name``."""

    def deco(fn: KLEstimator) -> KLEstimator:
        KL_ESTIMATORS[name] = fn
        return fn

    return deco


def register_aggregation(name: str) -> Callable[[Aggregation], Aggregation]:
    """Register a loss aggregation ``f(values, mask, *, max_tokens, global_num_seqs, global_num_tokens)``."""

    def deco(fn: Aggregation) -> Aggregation:
        AGGREGATIONS[name] = fn
        return fn

    return deco


def _lookup(registry: dict, name: str, kind: str):
    if name not in registry:
        msg = f"Unknown {kind}: {name!r}. Valid names are: {sorted(registry)}"
        raise ValueError(msg)
    return registry[name]


def get_kl_estimator(name: str) -> KLEstimator:
    """Return the KL estimator registered as ``name``; unknown names raise ``ValueError``."""
    return _lookup(KL_ESTIMATORS, name, "KL estimator")


def get_aggregation(name: str) -> Aggregation:
    """Return the aggregation registered as ``name``; unknown names raise ``ValueError``."""
    return _lookup(AGGREGATIONS, name, "aggregation")


# --------------------------------------------------------------------------- ratio and surrogate
def log_ratio(logp: torch.Tensor, logp_old: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-token ``log r = logp_theta - logp_old`` on valid tokens, 0 on masked ones.

    Parameters
    ----------
    logp, logp_old : (B, T) log-probs of the sampled tokens under pi_theta and pi_old.
    mask : (B, T) nonzero on valid tokens.
    """
    return torch.where(mask.bool(), logp - logp_old, 0.0)  # (B, T)


def clipped_surrogate(
    ratio: torch.Tensor, advantages: torch.Tensor, *, eps_low: float, eps_high: float
) -> torch.Tensor:
    """Per-token PPO surrogate ``min(r A, clip(r, 1-eps_low, 1+eps_high) A)`` (to be maximised).

    Parameters
    ----------
    ratio : (B, T) ``r = pi_theta / pi_old``.
    advantages : (B, T) per-token advantages (broadcast beforehand).
    """
    clipped = ratio.clamp(1.0 - eps_low, 1.0 + eps_high)  # (B, T)
    return torch.minimum(ratio * advantages, clipped * advantages)  # (B, T)


def broadcast_advantages(advantages: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """Expand outcome advantages ``(B,)`` to ``(B, T)``; per-token ``(B, T)`` pass through."""
    if advantages.dim() == 1 and advantages.shape[0] == shape[0]:
        return advantages[:, None].expand(shape)  # (B, T)
    if advantages.shape == shape:
        return advantages  # (B, T)
    msg = f"advantages has shape {tuple(advantages.shape)}; expected ({shape[0]},) or {tuple(shape)} (logp's shape)"
    raise ValueError(msg)


# --------------------------------------------------------------------------- KL estimators
# All take log-probs of the sampled token, (B, T) each, and return a per-token estimate of
# KL(pi_theta || pi_ref) for samples drawn from pi_theta (http://joschu.net/blog/kl-approx.html).
@register_kl_estimator("k1")
def kl_k1(logp: torch.Tensor, logp_ref: torch.Tensor) -> torch.Tensor:
    """``k1 = log(pi_theta / pi_ref)``: unbiased, high variance, can be negative."""
    return logp - logp_ref  # (B, T)


@register_kl_estimator("k2")
def kl_k2(logp: torch.Tensor, logp_ref: torch.Tensor) -> torch.Tensor:
    """``k2 = 0.5 * (log pi_theta - log pi_ref)^2``: biased, low variance, >= 0."""
    return 0.5 * (logp - logp_ref).square()  # (B, T)


@register_kl_estimator("k3")
def kl_k3(logp: torch.Tensor, logp_ref: torch.Tensor) -> torch.Tensor:
    """``k3 = pi_ref/pi_theta - log(pi_ref/pi_theta) - 1``: unbiased, >= 0 (DeepSeekMath eq. 4)."""
    log_q = logp_ref - logp  # (B, T) log(pi_ref / pi_theta)
    return torch.exp(log_q) - log_q - 1.0  # (B, T)


def kl_penalty(
    logp: torch.Tensor, logp_ref: torch.Tensor, mask: torch.Tensor, *, estimator: str = "k3"
) -> torch.Tensor:
    """Per-token KL estimate ``(B, T)``, 0 on masked tokens; ``estimator`` names one of ``KL_ESTIMATORS``."""
    fn = get_kl_estimator(estimator)
    valid = mask.bool()  # (B, T)
    zero = torch.zeros_like(logp)  # (B, T)
    # Mask the inputs, not only the output, so garbage at padding cannot make a nan gradient.
    return torch.where(valid, fn(torch.where(valid, logp, zero), torch.where(valid, logp_ref, zero)), zero)


# --------------------------------------------------------------------------- aggregations
# Each reduces per-token values (B, T) to a scalar. For gradient accumulation over micro-batches
# of one global batch, pass the *global* batch's counts: ``global_num_seqs`` (sequences) and
# ``global_num_tokens`` (valid tokens). Each micro-batch then returns its share of the global
# loss, and the sum of the micro-batch losses (and of their gradients) equals the loss (and
# gradient) on the whole batch. Without them the micro-batch itself is the batch. (Under DDP,
# which averages gradients over ranks, pass the global counts divided by the world size.)
def _masked(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask.bool(), values, 0.0)  # (B, T)


def _denominator(given: Number | None, local: Number, name: str) -> Number:
    if given is None:
        return local
    if bool(torch.as_tensor(given) <= 0):
        msg = f"{name} must be positive, got {given}"
        raise ValueError(msg)
    return given


@register_aggregation("seq_mean_token_mean")
def seq_mean_token_mean(
    values: torch.Tensor,
    mask: torch.Tensor,
    *,
    max_tokens: int | None = None,
    global_num_seqs: Number | None = None,
    global_num_tokens: Number | None = None,
) -> torch.Tensor:
    """``1/G sum_i 1/|o_i| sum_t x_it``: token mean per sequence, then mean over sequences (spec, GRPO).

    ``G = global_num_seqs`` or ``B``. A sequence with no valid token contributes 0 but still counts
    in ``G``. ``max_tokens`` and ``global_num_tokens`` are unused.
    """
    lengths = mask.bool().sum(-1).clamp(min=1)  # (B,)
    per_seq = _masked(values, mask).sum(-1) / lengths  # (B,)
    return per_seq.sum() / _denominator(global_num_seqs, values.shape[0], "global_num_seqs")


@register_aggregation("token_mean")
def token_mean(
    values: torch.Tensor,
    mask: torch.Tensor,
    *,
    max_tokens: int | None = None,
    global_num_seqs: Number | None = None,
    global_num_tokens: Number | None = None,
) -> torch.Tensor:
    """``sum_i sum_t x_it / N``: mean over all valid tokens of the batch (DAPO, arXiv:2503.14476).

    ``N = global_num_tokens`` or the number of valid tokens in ``mask`` (at least 1).
    ``max_tokens`` and ``global_num_seqs`` are unused.
    """
    local = mask.bool().sum().clamp(min=1)  # ()
    return _masked(values, mask).sum() / _denominator(global_num_tokens, local, "global_num_tokens")


@register_aggregation("seq_mean_token_sum_norm")
def seq_mean_token_sum_norm(
    values: torch.Tensor,
    mask: torch.Tensor,
    *,
    max_tokens: int | None = None,
    global_num_seqs: Number | None = None,
    global_num_tokens: Number | None = None,
) -> torch.Tensor:
    """``1/G sum_i (sum_t x_it) / L``: token sum over a constant ``L = max_tokens`` (Dr. GRPO, arXiv:2503.20783).

    ``G = global_num_seqs`` or ``B``; ``max_tokens`` is required (the generation budget, not the
    batch's longest sequence, so that it is the same for every micro-batch). ``global_num_tokens`` is unused.
    """
    if max_tokens is None or max_tokens <= 0:
        msg = f"aggregation 'seq_mean_token_sum_norm' needs a positive max_tokens, got {max_tokens}"
        raise ValueError(msg)
    per_seq = _masked(values, mask).sum(-1) / max_tokens  # (B,)
    return per_seq.sum() / _denominator(global_num_seqs, values.shape[0], "global_num_seqs")


def aggregate(
    values: torch.Tensor,
    mask: torch.Tensor,
    *,
    aggregation: str = "seq_mean_token_mean",
    max_tokens: int | None = None,
    global_num_seqs: Number | None = None,
    global_num_tokens: Number | None = None,
) -> torch.Tensor:
    """Reduce per-token ``values`` (B, T) to a scalar with the aggregation named ``aggregation``."""
    fn = get_aggregation(aggregation)
    return fn(values, mask, max_tokens=max_tokens, global_num_seqs=global_num_seqs, global_num_tokens=global_num_tokens)


# --------------------------------------------------------------------------- the loss
def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return _masked(values, mask).sum() / mask.bool().sum().clamp(min=1)  # ()


def _check_shapes(logp: torch.Tensor, **others: torch.Tensor | None) -> None:
    if logp.dim() != 2:
        msg = f"logp must be (B, T), got shape {tuple(logp.shape)}"
        raise ValueError(msg)
    for name, x in others.items():
        if x is not None and x.shape != logp.shape:
            msg = f"{name} has shape {tuple(x.shape)} but logp has {tuple(logp.shape)}"
            raise ValueError(msg)


def grpo_loss(
    logp: torch.Tensor,
    logp_old: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    logp_ref: torch.Tensor | None = None,
    eps_low: float,
    eps_high: float | None = None,
    beta: float,
    kl_estimator: str,
    aggregation: str,
    max_tokens: int | None = None,
    global_num_seqs: Number | None = None,
    global_num_tokens: Number | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GRPO loss ``agg(-min(r A, clip(r, 1-eps_low, 1+eps_high) A) + beta * KL)``, ``r = exp(logp - logp_old)``.

    Parameters
    ----------
    logp : (B, T) log-probs of the sampled tokens under pi_theta (carries the gradient).
    logp_old : (B, T) the same under the sampling policy pi_old (detached; ``logp.detach()`` when mu = 1).
    advantages : (B,) outcome or (B, T) per-token advantages.
    mask : (B, T) nonzero on valid completion tokens.
    logp_ref : (B, T) log-probs under the reference policy; needed when ``beta > 0``.
    eps_low, eps_high : clip band ``[1 - eps_low, 1 + eps_high]``; ``eps_high=None`` means ``eps_low``.
    beta : KL coefficient; ``0`` (or ``logp_ref=None`` with ``beta=0``) drops the KL term.
    kl_estimator : a name in ``KL_ESTIMATORS``.
    aggregation, max_tokens, global_num_seqs, global_num_tokens : see ``aggregate`` and the
        aggregation functions (micro-batch accumulation).

    Returns
    -------
    loss : () scalar to minimise.
    metrics : detached scalars: ``policy_loss`` (aggregated ``-surrogate``), ``kl`` (mean per valid
        token of this (micro-)batch; nan when ``logp_ref`` is None), ``clip_frac_low`` (share of valid tokens with
        ``r < 1-eps_low`` and ``A < 0``), ``clip_frac_high`` (``r > 1+eps_high`` and ``A > 0``),
        ``ratio_mean``, ``ratio_min``, ``ratio_max`` (over valid tokens; +-inf when there are none).

    Examples
    --------
    >>> logp = torch.zeros(2, 3, requires_grad=True)
    >>> mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    >>> loss, m = grpo_loss(logp, logp.detach(), torch.tensor([1.0, -1.0]), mask, eps_low=0.2, beta=0.0,
    ...                     kl_estimator="k3", aggregation="seq_mean_token_mean")
    >>> loss.item(), m["ratio_mean"].item()
    (0.0, 1.0)
    """
    _check_shapes(logp, logp_old=logp_old, mask=mask, logp_ref=logp_ref)
    get_kl_estimator(kl_estimator)  # a bad name fails even when there is no KL term
    if beta > 0 and logp_ref is None:
        msg = f"beta={beta} > 0 needs logp_ref (reference log-probs). Hint: pass logp_ref or set beta=0."
        raise ValueError(msg)
    eps_high = eps_low if eps_high is None else eps_high
    dtype = torch.promote_types(logp.dtype, torch.float32)  # compute in >= float32
    logp, logp_old = logp.to(dtype), logp_old.to(dtype)  # (B, T) each
    logp_ref = None if logp_ref is None else logp_ref.to(dtype)  # (B, T)
    valid = mask.bool()  # (B, T)
    adv = torch.where(valid, broadcast_advantages(advantages, logp.shape).to(dtype), 0.0)  # (B, T)
    ratio = torch.exp(log_ratio(logp, logp_old, valid))  # (B, T), 1 on masked tokens
    per_token = -clipped_surrogate(ratio, adv, eps_low=eps_low, eps_high=eps_high)  # (B, T)
    agg = {"aggregation": aggregation, "max_tokens": max_tokens}
    agg |= {"global_num_seqs": global_num_seqs, "global_num_tokens": global_num_tokens}
    policy_loss = aggregate(per_token, valid, **agg)  # ()
    loss = policy_loss
    kl = None
    if logp_ref is not None:
        kl = kl_penalty(logp, logp_ref, valid, estimator=kl_estimator)  # (B, T)
        if beta != 0:
            loss = policy_loss + beta * aggregate(kl, valid, **agg)  # ()
    return loss, _metrics(policy_loss, kl, ratio, adv, valid, eps_low=eps_low, eps_high=eps_high)


@torch.no_grad()
def _metrics(
    policy_loss: torch.Tensor, kl: torch.Tensor | None, ratio: torch.Tensor, adv: torch.Tensor, valid: torch.Tensor,
    *, eps_low: float, eps_high: float,
) -> dict[str, torch.Tensor]:  # fmt: skip
    """Detached scalar diagnostics over valid tokens (see ``grpo_loss``)."""
    low = (ratio < 1.0 - eps_low) & (adv < 0)  # (B, T) clipped from below
    high = (ratio > 1.0 + eps_high) & (adv > 0)  # (B, T) clipped from above
    nan = torch.full((), float("nan"), dtype=ratio.dtype, device=ratio.device)
    return {
        "policy_loss": policy_loss.detach(),
        "kl": nan if kl is None else _masked_mean(kl, valid),
        "clip_frac_low": _masked_mean(low.to(ratio.dtype), valid),
        "clip_frac_high": _masked_mean(high.to(ratio.dtype), valid),
        "ratio_mean": _masked_mean(ratio, valid),
        "ratio_min": torch.where(valid, ratio, float("inf")).min(),
        "ratio_max": torch.where(valid, ratio, float("-inf")).max(),
    }
