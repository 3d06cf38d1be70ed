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
* importance ratio: per token (``"token"``, the formula above) or GSPO's length-normalised
  sequence ratio (``"sequence"``), see ``IMPORTANCE_RATIOS``.
* policy term: the clipped surrogate (``"grpo"``) or CISPO's clipped, stop-gradient weight on a
  REINFORCE term (``"cispo"``), see ``POLICY_LOSSES``.
* sampler-trainer correction: the per-token policy term times a detached weight from
  ``pi_old / pi_sampler`` (``"none"``, ``"tis"`` truncated, ``"mis"`` masked; token or sequence
  level), see ``ROLLOUT_CORRECTIONS``; the mismatch itself is always reported when the sampler's
  log-probs are given (``rollout_mismatch``).
* no dual-clip, no entropy bonus, no log-ratio clamping.

Shapes: ``B`` sequences (completions), ``T`` completion tokens (right-padded), ``V`` vocabulary.
``mask`` is ``(B, T)``, nonzero on valid completion tokens. Values at masked positions never
reach the loss or the gradients, even when they are ``inf`` or ``nan``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

Number = int | float | torch.Tensor
KLEstimator = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
Aggregation = Callable[..., torch.Tensor]

LogRatio = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
PolicyLoss = Callable[..., torch.Tensor]
Correction = Callable[..., torch.Tensor]

KL_ESTIMATORS: dict[str, KLEstimator] = {}
AGGREGATIONS: dict[str, Aggregation] = {}
IMPORTANCE_RATIOS: dict[str, LogRatio] = {}
POLICY_LOSSES: dict[str, PolicyLoss] = {}
ROLLOUT_CORRECTIONS: dict[str, Correction] = {}


def _register(registry: dict, name: str) -> Callable:
    def deco(fn):
        registry[name] = fn
        return fn

    return deco


def register_kl_estimator(name: str) -> Callable[[KLEstimator], KLEstimator]:
    """Register a per-token KL estimator ``f(logp, logp_ref) -> (B, T)`` under ``name``."""
    return _register(KL_ESTIMATORS, name)


def register_aggregation(name: str) -> Callable[[Aggregation], Aggregation]:
    """Register a loss aggregation ``f(values, mask, *, max_tokens, global_num_seqs, global_num_tokens)``."""
    return _register(AGGREGATIONS, name)


def register_importance_ratio(name: str) -> Callable[[LogRatio], LogRatio]:
    """Register a log importance ratio ``f(logp, logp_old, mask) -> (B, T)`` (0 on masked tokens) under ``name``."""
    return _register(IMPORTANCE_RATIOS, name)


def register_policy_loss(name: str) -> Callable[[PolicyLoss], PolicyLoss]:
    """Register a per-token policy loss ``f(ratio, advantages, logp, *, eps_low, eps_high) -> (B, T)`` (minimised)."""
    return _register(POLICY_LOSSES, name)


def register_rollout_correction(name: str) -> Callable[[Correction], Correction]:
    """Register a sampler-trainer correction ``f(log_w, *, cap) -> (B, T)`` detached weights under ``name``."""
    return _register(ROLLOUT_CORRECTIONS, name)


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


def get_importance_ratio(name: str) -> LogRatio:
    """Return the importance-ratio level registered as ``name``; unknown names raise ``ValueError``."""
    return _lookup(IMPORTANCE_RATIOS, name, "importance sampling level")


def get_policy_loss(name: str) -> PolicyLoss:
    """Return the policy loss registered as ``name``; unknown names raise ``ValueError``."""
    return _lookup(POLICY_LOSSES, name, "policy loss")


def get_rollout_correction(name: str) -> Correction:
    """Return the rollout correction registered as ``name``; unknown names raise ``ValueError``."""
    return _lookup(ROLLOUT_CORRECTIONS, name, "rollout correction")


# --------------------------------------------------------------------------- ratio and surrogate
@register_importance_ratio("token")
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


@register_importance_ratio("sequence")
def sequence_log_ratio(logp: torch.Tensor, logp_old: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """GSPO's length-normalised sequence log-ratio, broadcast over the sequence's tokens (arXiv:2507.18071 eq. 7).

    ``log s_i = 1/|o_i| sum_t (logp_it - logp_old_it)``, i.e. ``s_i = (pi_theta(o_i) / pi_old(o_i))^(1/|o_i|)``;
    every valid token of sequence ``i`` holds ``log s_i`` (its gradient reaches every token, each
    weighted ``1/|o_i|``), masked tokens 0.  GSPO clips ``s_i`` with its own, much smaller epsilons.

    Parameters
    ----------
    logp, logp_old : (B, T) log-probs of the sampled tokens under pi_theta and pi_old.
    mask : (B, T) nonzero on valid tokens.
    """
    valid = mask.bool()  # (B, T)
    lengths = valid.sum(-1, keepdim=True).clamp(min=1)  # (B, 1)
    per_seq = log_ratio(logp, logp_old, valid).sum(-1, keepdim=True) / lengths  # (B, 1)
    return torch.where(valid, per_seq.expand(valid.shape), 0.0)  # (B, T)


@register_policy_loss("grpo")
def clipped_surrogate_loss(
    ratio: torch.Tensor, advantages: torch.Tensor, logp: torch.Tensor, *, eps_low: float, eps_high: float
) -> torch.Tensor:
    """Per-token ``-min(r A, clip(r, 1-eps_low, 1+eps_high) A)`` (PPO / GRPO); ``logp`` is unused.

    Parameters
    ----------
    ratio : (B, T) importance ratio (token or sequence level), carries the gradient.
    advantages : (B, T) per-token advantages (broadcast beforehand).
    logp : (B, T) log-probs under pi_theta (unused here).
    """
    return -clipped_surrogate(ratio, advantages, eps_low=eps_low, eps_high=eps_high)  # (B, T)


@register_policy_loss("cispo")
def cispo_loss(
    ratio: torch.Tensor, advantages: torch.Tensor, logp: torch.Tensor, *, eps_low: float, eps_high: float
) -> torch.Tensor:
    """CISPO per-token ``-sg(min(r, 1+eps_high)) * A * logp`` (MiniMax-M1, arXiv:2506.13585 eq. 4-5).

    The importance weight is clipped from above only (the paper sets no lower bound, so
    ``eps_low`` is unused) and carries no gradient: every token keeps a REINFORCE gradient
    ``-w A grad logp``, also where the PPO clip would have dropped it.  ScaleRL (arXiv:2510.13786)
    and TRL use the cap ``1 + eps_high = 5``.

    Parameters
    ----------
    ratio : (B, T) importance ratio (detached here).
    advantages : (B, T) per-token advantages.
    logp : (B, T) log-probs under pi_theta (carries the gradient; 0 on masked tokens).
    """
    weight = ratio.detach().clamp(max=1.0 + eps_high)  # (B, T)
    return -weight * advantages * logp  # (B, T)


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


# --------------------------------------------------------------------------- sampler-trainer correction
# The sampler (vLLM) and the trainer compute different probabilities for the same weights (kernels,
# precision, batch shapes). With w = pi_old / pi_sampler computed from the trainer's pi_old and the
# sampler's stored log-probs, the per-token policy term is multiplied by a detached correction of w
# (truncated IS: Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL
# Training"; masked IS: Liu et al. 2025, "When Speed Kills Stability", TRL's ``*_mask`` modes, verl's
# rollout correction). The KL term is not corrected (as in TRL).
def rollout_log_weights(
    logp_old: torch.Tensor, logp_sampler: torch.Tensor, mask: torch.Tensor, *, level: str
) -> torch.Tensor:
    """``log w`` per token (B, T), 0 on masked tokens.

    ``"token"``: ``log w_it = logp_old_it - logp_sampler_it``; ``"sequence"``: the whole sequence's
    ``log w_i = sum_t (logp_old_it - logp_sampler_it)`` on each of its tokens (no length
    normalisation: the sequence's true likelihood ratio, as TRL's and verl's sequence modes).
    """
    if level not in ("token", "sequence"):
        msg = f"Unknown rollout correction level: {level!r}. Valid names are: ['sequence', 'token']"
        raise ValueError(msg)
    valid = mask.bool()  # (B, T)
    tok = torch.where(valid, logp_old.detach() - logp_sampler, 0.0)  # (B, T)
    if level == "token":
        return tok  # (B, T)
    return torch.where(valid, tok.sum(-1, keepdim=True).expand(tok.shape), 0.0)  # (B, T)


@register_rollout_correction("none")
def no_correction(log_w: torch.Tensor, *, cap: float) -> torch.Tensor:
    """Weight 1 everywhere: the sampler's tokens are treated as drawn from pi_old."""
    return torch.ones_like(log_w)  # (B, T)


@register_rollout_correction("tis")
def truncated_is(log_w: torch.Tensor, *, cap: float) -> torch.Tensor:
    """Truncated importance sampling ``min(w, C)`` (TRL ``*_truncate``, verl ``rollout_is``)."""
    return torch.exp(log_w.detach()).clamp(max=cap)  # (B, T)


@register_rollout_correction("mis")
def masked_is(log_w: torch.Tensor, *, cap: float) -> torch.Tensor:
    """Masked importance sampling ``w * 1[w <= C]``: tokens (or sequences) beyond the cap get weight 0."""
    w = torch.exp(log_w.detach())  # (B, T)
    return torch.where(w > cap, 0.0, w)  # (B, T)


@torch.no_grad()
def rollout_mismatch(
    logp_old: torch.Tensor, logp_sampler: torch.Tensor, mask: torch.Tensor, *, level: str, cap: float
) -> dict[str, torch.Tensor]:
    """How far the sampler's log-probs are from the trainer's, over valid tokens (scalars).

    ``mismatch/logp_diff_mean`` and ``mismatch/logp_diff_max``: mean and max ``|logp_old - logp_sampler|``;
    ``mismatch/outside_cap_share``: share of tokens whose correction weight ``w`` (at ``level``) exceeds
    ``cap``; ``mismatch/kl_k3``: k3 estimate of ``KL(pi_sampler || pi_old)`` per token from the sampled
    tokens, ``w - log w - 1`` with the token-level ``w``.  0 (max: 0) when there is no valid token.
    Computed in float64 (returned as float64).
    """
    valid = mask.bool()  # (B, T)
    logp_old, logp_sampler = logp_old.double(), logp_sampler.double()  # k3 of ~1e-5 nats cancels in float32
    tok = rollout_log_weights(logp_old, logp_sampler, valid, level="token")  # (B, T)
    diff = tok.abs()  # (B, T)
    outside = (rollout_log_weights(logp_old, logp_sampler, valid, level=level) > math.log(cap)) & valid  # (B, T)
    return {
        "mismatch/logp_diff_mean": _masked_mean(diff, valid),
        "mismatch/logp_diff_max": diff.max() if diff.numel() else diff.new_zeros(()),
        "mismatch/outside_cap_share": _masked_mean(outside.to(diff.dtype), valid),
        "mismatch/kl_k3": _masked_mean(kl_penalty(logp_sampler, logp_old, valid, estimator="k3"), valid),
    }


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
    loss: str,
    importance_sampling_level: str,
    logp_sampler: torch.Tensor | None = None,
    rollout_correction: str,
    rollout_correction_level: str,
    rollout_correction_cap: float,
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
    loss : a name in ``POLICY_LOSSES``: ``"grpo"`` (the clipped surrogate above) or ``"cispo"``
        (``-sg(min(r, 1+eps_high)) A logp``, ``eps_low`` unused).
    importance_sampling_level : a name in ``IMPORTANCE_RATIOS``: ``"token"`` (``r_it``) or ``"sequence"``
        (GSPO's ``s_i`` on every token of sequence ``i``; pass GSPO's own ``eps_low``/``eps_high``).
    logp_sampler : (B, T) the sampler's log-probs of the same tokens (the rollouts' ``completion_logprobs``);
        needed by a correction, and when given the mismatch metrics are reported.
    rollout_correction, rollout_correction_level, rollout_correction_cap : a name in ``ROLLOUT_CORRECTIONS``,
        ``"token"`` or ``"sequence"`` (see ``rollout_log_weights``) and the cap ``C`` on ``pi_old / pi_sampler``;
        the per-token policy term is multiplied by the (detached) corrected weight.

    Returns
    -------
    loss : () scalar to minimise.
    metrics : detached scalars: ``policy_loss`` (aggregated ``-surrogate``), ``kl`` (mean per valid
        token of this (micro-)batch; nan when ``logp_ref`` is None), ``clip_frac_low`` (share of valid tokens with
        ``r < 1-eps_low`` and ``A < 0``), ``clip_frac_high`` (``r > 1+eps_high`` and ``A > 0``),
        ``ratio_mean``, ``ratio_min``, ``ratio_max`` (over valid tokens; +-inf when there are none);
        with ``logp_sampler`` also ``rollout_mismatch``'s ``mismatch/*`` and ``mismatch/weight_mean`` (the
        mean correction weight over valid tokens).

    Examples
    --------
    >>> logp = torch.zeros(2, 3, requires_grad=True)
    >>> mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    >>> loss, m = grpo_loss(logp, logp.detach(), torch.tensor([1.0, -1.0]), mask, eps_low=0.2, beta=0.0,
    ...                     kl_estimator="k3", aggregation="seq_mean_token_mean", loss="grpo",
    ...                     importance_sampling_level="token", rollout_correction="none",
    ...                     rollout_correction_level="token", rollout_correction_cap=3.0)
    >>> loss.item(), m["ratio_mean"].item()
    (0.0, 1.0)
    """
    _check_shapes(logp, logp_old=logp_old, mask=mask, logp_ref=logp_ref, logp_sampler=logp_sampler)
    get_kl_estimator(kl_estimator)  # a bad name fails even when there is no KL term
    policy_fn, ratio_fn = get_policy_loss(loss), get_importance_ratio(importance_sampling_level)
    correct = get_rollout_correction(rollout_correction)
    if beta > 0 and logp_ref is None:
        msg = f"beta={beta} > 0 needs logp_ref (reference log-probs). Hint: pass logp_ref or set beta=0."
        raise ValueError(msg)
    if rollout_correction != "none" and logp_sampler is None:
        msg = f"rollout_correction={rollout_correction!r} needs logp_sampler (the sampler's log-probs)"
        raise ValueError(msg)
    eps_high = eps_low if eps_high is None else eps_high
    dtype = torch.promote_types(logp.dtype, torch.float32)  # compute in >= float32
    logp, logp_old = logp.to(dtype), logp_old.to(dtype)  # (B, T) each
    logp_ref = None if logp_ref is None else logp_ref.to(dtype)  # (B, T)
    valid = mask.bool()  # (B, T)
    adv = torch.where(valid, broadcast_advantages(advantages, logp.shape).to(dtype), 0.0)  # (B, T)
    ratio = torch.exp(ratio_fn(logp, logp_old, valid))  # (B, T), 1 on masked tokens
    per_token = policy_fn(ratio, adv, torch.where(valid, logp, 0.0), eps_low=eps_low, eps_high=eps_high)  # (B, T)
    extra: dict[str, torch.Tensor] = {}
    if logp_sampler is not None:
        logp_sampler = logp_sampler.to(dtype)  # (B, T)
        level, cap = rollout_correction_level, rollout_correction_cap
        weight = correct(rollout_log_weights(logp_old, logp_sampler, valid, level=level), cap=cap)  # (B, T)
        if rollout_correction != "none":
            per_token = per_token * weight  # (B, T)
        extra = rollout_mismatch(logp_old, logp_sampler, valid, level=level, cap=cap)
        extra["mismatch/weight_mean"] = _masked_mean(weight, valid)
    agg = {"aggregation": aggregation, "max_tokens": max_tokens}
    agg |= {"global_num_seqs": global_num_seqs, "global_num_tokens": global_num_tokens}
    policy_loss = aggregate(per_token, valid, **agg)  # ()
    total = policy_loss
    kl = None
    if logp_ref is not None:
        kl = kl_penalty(logp, logp_ref, valid, estimator=kl_estimator)  # (B, T)
        if beta != 0:
            total = policy_loss + beta * aggregate(kl, valid, **agg)  # ()
    eps_low = math.inf if loss == "cispo" else eps_low  # CISPO has no lower clip
    return total, _metrics(policy_loss, kl, ratio, adv, valid, eps_low=eps_low, eps_high=eps_high) | extra


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
