"""Group-relative advantages: outcome (GRPO) and process supervision (DeepSeekMath, arXiv:2402.03300).

What is implemented (the spec's section 2.1 and its worked example, stage 3)::

    A_i = (r_i - mean_r) / (std_r + delta)      per group = all completions of one prompt_id
    std_r = sqrt(1/G * sum_j (r_j - mean_r)^2)  population std: the DEFAULT (``std="population"``)

Other normalisers, chosen by name (``AdvantageConfig.std``, see ``NORMALISERS``):

* ``"population"`` (default): 1/G inside the divisor, as the spec writes it; ``delta`` = 1e-4 by default.
* ``"sample"``: 1/(G-1) (Bessel), as ``torch.std`` / TRL do.
* ``"batch"``: mean per group, but the std is the population std of *all* valid rewards of the
  batch (raw rewards around the batch mean), one divisor for every group.
* ``"none"``: Dr. GRPO, ``A = r - mean_r``; neither std nor ``delta`` is used.

Rules shared by every normaliser:

* a null reward is left out of its group's statistics; its row gets advantage 0 and
  ``adv_mask = False``. ``G`` above is the number of valid rewards of the group;
* a group whose valid rewards are all equal gets exactly 0 (never NaN, also with ``delta = 0``),
  the equality being tested exactly, not through a floating-point std;
* a NaN or infinite reward is an upstream bug: ``ValueError`` naming the first bad row.

Process supervision (``estimator="process"``, the spec's 002 text): every step ``j`` of
output ``i`` carries a reward; ``R`` is the set of all non-null step rewards of all outputs of
the group, and ``r~_i^j = (r_i^j - mean(R)) / (std(R) + delta)`` with the same normaliser choice.
Token ``t`` then gets ``A_it = sum over steps j ending at or after t of r~_i^j`` (gamma = 1), see
:func:`token_advantages_from_steps` for the precise token rule. A null step reward is left out
of ``R`` and gets value 0; a row without any non-null step reward (``steps`` null or empty)
gets advantage 0 and ``adv_mask = False``. The outcome ``reward`` column is not used.

Everything is vectorised (numpy ``bincount`` over integer group codes, no per-group loops).
Groups written as contiguous runs (as the sampler does) take the fast path (~15 M rows/s on
2 cores); interleaved groups cost a hash rank and cache-unfriendly gathers (~3-4 M rows/s).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import polars as pl
import pyarrow as pa

from grpo_pipeline.config import AdvantageConfig

__all__ = ["ESTIMATORS", "NORMALISERS", "compute_advantages", "group_codes", "normalise_grouped",
           "pad_step_advantages", "token_advantages_batched", "token_advantages_from_steps"]

STEP_ADV_DTYPE = pl.List(pl.Struct({"end": pl.Int32, "value": pl.Float64}))


@dataclass(frozen=True)
class Grouped:
    """Per-row ``values, codes, valid, dev`` (N,) and per-group ``count, mean, varies`` (n_groups,).

    ``dev`` is ``r - mean`` on valid rows of groups whose values vary, exactly 0 elsewhere.
    """

    values: np.ndarray
    codes: np.ndarray
    valid: np.ndarray
    count: np.ndarray
    mean: np.ndarray
    varies: np.ndarray
    dev: np.ndarray


Normaliser = Callable[[Grouped, float], np.ndarray]
Estimator = Callable[[pl.DataFrame, np.ndarray, int, AdvantageConfig], tuple[dict[str, pl.Series], dict]]
NORMALISERS: dict[str, Normaliser] = {}
ESTIMATORS: dict[str, Estimator] = {}


def _register(registry: dict, name: str) -> Callable:
    def deco(fn: Callable) -> Callable:
        registry[name] = fn
        return fn

    return deco


def _lookup(registry: dict, name: str, kind: str) -> Callable:
    if name not in registry:
        msg = f"Unknown {kind}: {name!r}. Valid names are: {sorted(registry)}"
        raise ValueError(msg)
    return registry[name]


# --------------------------------------------------------------------------- normalisers
# Each returns the divisor per group, (n_groups,); A = dev / divisor[codes].
@_register(NORMALISERS, "population")
def _population(g: Grouped, delta: float) -> np.ndarray:
    var = np.bincount(g.codes, weights=g.dev * g.dev, minlength=g.count.size) / np.maximum(g.count, 1)
    return np.sqrt(var) + delta  # std_r = sqrt(1/G sum (r - mean)^2)


@_register(NORMALISERS, "sample")
def _sample(g: Grouped, delta: float) -> np.ndarray:
    ss = np.bincount(g.codes, weights=g.dev * g.dev, minlength=g.count.size)
    return np.sqrt(ss / np.maximum(g.count - 1, 1)) + delta  # 1/(G-1); G = 1 groups have dev = 0


@_register(NORMALISERS, "batch")
def _batch(g: Grouped, delta: float) -> np.ndarray:
    v = g.values[g.valid]
    std = float(np.sqrt(np.mean((v - v.mean()) ** 2))) if v.size else 0.0  # over the whole batch
    return np.full(g.count.size, std + delta)


@_register(NORMALISERS, "none")
def _none(g: Grouped, delta: float) -> np.ndarray:
    return np.ones(g.count.size)  # Dr. GRPO: A = r - mean, no std, no delta


def get_normaliser(name: str) -> Normaliser:
    """Return the normaliser registered as ``name``; unknown names raise ``ValueError``."""
    return _lookup(NORMALISERS, name, "advantage std option")


# --------------------------------------------------------------------------- grouped core
def group_codes(keys: pl.Series) -> tuple[np.ndarray, int]:
    """Dense integer codes ``(N,)`` in ``[0, n_groups)`` for the group key column, and ``n_groups``.

    Exact, with two fast paths: (1) every group is one contiguous run (as the sampler writes
    them) when the runs' key hashes are all distinct (equal keys hash equally), and the run
    number is the code; (2) otherwise codes are dense ranks of the key hashes, checked against
    the keys themselves; a hash clash (never seen) falls back to ranking the strings.
    """
    n = len(keys)
    if n == 0:
        return np.zeros(0, np.int64), 0
    hashes = keys.hash()  # (N,) uint64
    new_run = keys.ne_missing(keys.shift(1)).fill_null(True).to_numpy()  # (N,) bool
    starts = np.flatnonzero(new_run)
    run_hashes = np.sort(hashes.gather(starts).to_numpy())
    if not np.any(run_hashes[1:] == run_hashes[:-1]):
        return np.cumsum(new_run, dtype=np.int64) - 1, int(starts.size)
    codes = hashes.rank("dense").to_numpy().astype(np.int64) - 1
    n_groups = int(codes.max()) + 1
    member = np.empty(n_groups, np.int64)
    member[codes] = np.arange(n)  # some row of each code
    if not keys.gather(member[codes]).eq_missing(keys).all():
        codes = keys.rank("dense").to_numpy().astype(np.int64) - 1
        n_groups = int(codes.max()) + 1
    return codes, n_groups


def normalise_grouped(
    values: np.ndarray, codes: np.ndarray, valid: np.ndarray, n_groups: int, *, std: str, delta: float
) -> tuple[np.ndarray, Grouped]:
    """Group-normalise ``values`` ``(N,)``: ``(v - mean_g) / divisor_g`` on valid rows, 0 elsewhere.

    Parameters
    ----------
    values : (N,) float64; entries where ``valid`` is False are ignored (may be NaN).
    codes : (N,) int64 group codes in ``[0, n_groups)``.
    valid : (N,) bool.
    std : a name in ``NORMALISERS``.
    delta : added to the std (not for ``"none"``).

    Returns (N,) float64 normalised values, and the :class:`Grouped` statistics.

    Examples
    --------
    >>> a, _ = normalise_grouped(np.array([2.0, 2, 2, 1]), np.zeros(4, np.int64), np.ones(4, bool), 1,
    ...                          std="population", delta=0.0)
    >>> np.round(a, 3).tolist()
    [0.577, 0.577, 0.577, -1.732]
    """
    normaliser = get_normaliser(std)
    v = np.where(valid, values, 0.0)  # (N,)
    count = np.bincount(codes, weights=valid, minlength=n_groups)  # (n_groups,)
    mean = np.bincount(codes, weights=v, minlength=n_groups) / np.maximum(count, 1)
    ref = np.zeros(n_groups)  # some valid member of each group, for an exact "all equal" test
    if valid.all():
        ref[codes] = v
    else:
        ref[codes[valid]] = v[valid]
    differs = valid & (v != ref[codes])
    varies = np.bincount(codes, weights=differs, minlength=n_groups) > 0  # (n_groups,)
    keep = valid & varies[codes]
    dev = np.where(keep, v - mean[codes], 0.0)  # (N,)
    g = Grouped(values=v, codes=codes, valid=valid, count=count, mean=mean, varies=varies, dev=dev)
    divisor = normaliser(g, delta)
    divisor = np.where(varies & (divisor > 0), divisor, 1.0)  # constant groups: 0 / 1, never 0 / 0
    return dev / divisor[codes], g


# --------------------------------------------------------------------------- input checks
def _require(df: pl.DataFrame, col: str, kinds: tuple[type, ...], what: str) -> None:
    if col not in df.columns:
        msg = f"scores frame lacks column {col!r} (has {df.columns})"
        raise ValueError(msg)
    if not isinstance(df.schema[col], kinds):
        msg = f"scores column {col!r} must be {what}, got {df.schema[col]}"
        raise TypeError(msg)


def _row_name(df: pl.DataFrame, i: int) -> str:
    return f"prompt_id={df['prompt_id'][i]!r}, sample_idx={df['sample_idx'][i]}"


def _check_finite(df: pl.DataFrame, values: np.ndarray, valid: np.ndarray, rows: np.ndarray, what: str) -> None:
    bad = np.flatnonzero(valid & ~np.isfinite(values))
    if bad.size:
        k = int(bad[0])
        msg = f"{what} is {values[k]} (NaN/inf) at row {int(rows[k])} ({_row_name(df, int(rows[k]))}). " \
              "Hint: nulls are allowed and masked; NaN means a bug in the scoring stage"
        raise ValueError(msg)


# --------------------------------------------------------------------------- estimators
@_register(ESTIMATORS, "grpo")
def _grpo(df: pl.DataFrame, codes: np.ndarray, n_groups: int, cfg: AdvantageConfig):
    _require(df, "reward", (pl.Float64, pl.Float32, pl.Int64, pl.Int32, pl.Int16, pl.Int8), "numeric")
    reward = df["reward"].cast(pl.Float64)
    valid = reward.is_not_null().to_numpy()  # (N,)
    r = reward.to_numpy()  # nulls come back as NaN, told apart by `valid`
    _check_finite(df, r, valid, np.arange(len(r)), "reward")
    adv, g = normalise_grouped(r, codes, valid, n_groups, std=cfg.std, delta=cfg.delta)
    cols = {"advantage": pl.Series(adv), "adv_mask": pl.Series(valid),
            "step_advantages": pl.repeat(None, len(df), dtype=STEP_ADV_DTYPE, eager=True)}
    return cols, _metrics(adv, valid, g)


@_register(ESTIMATORS, "process")
def _process(df: pl.DataFrame, codes: np.ndarray, n_groups: int, cfg: AdvantageConfig):
    _require(df, "steps", (pl.List,), "List(Struct{start, end, reward})")
    n = len(df)
    lengths = df["steps"].list.len().fill_null(0).to_numpy().astype(np.int64)  # (N,)
    flat = df["steps"].explode(empty_as_null=False, keep_nulls=False).struct.unnest()  # (S, 3)
    for field in ("start", "end", "reward"):
        if field not in flat.columns:
            msg = f"scores column 'steps' must hold Struct{{start, end, reward}}; field {field!r} missing"
            raise ValueError(msg)
    row = np.repeat(np.arange(n), lengths)  # (S,) owning row of each step
    start = flat["start"].to_numpy()
    end = flat["end"].to_numpy()
    bad_span = np.flatnonzero(flat["end"].is_null().to_numpy() | ~(start <= end) | ~(start >= 0))
    if bad_span.size:
        k = int(bad_span[0])
        msg = f"steps: bad span [start={start[k]}, end={end[k]}) at row {row[k]} ({_row_name(df, int(row[k]))}); " \
              "need 0 <= start <= end, end not null"
        raise ValueError(msg)
    valid = flat["reward"].is_not_null().to_numpy()  # (S,)
    r = flat["reward"].cast(pl.Float64).to_numpy()
    _check_finite(df, r, valid, row, "step reward")
    step_adv, g = normalise_grouped(r, codes[row], valid, n_groups, std=cfg.std, delta=cfg.delta)  # (S,)
    adv = np.bincount(row, weights=step_adv, minlength=n)  # (N,) sum of a row's r~ = first token's A
    mask = np.bincount(row, weights=valid, minlength=n) > 0  # (N,) row has >= 1 valid step reward
    offsets = np.concatenate([[0], np.cumsum(lengths)])  # (N+1,)
    struct = pa.StructArray.from_arrays([pa.array(end.astype(np.int32)), pa.array(step_adv)], ["end", "value"])
    steps_out = pl.from_arrow(pa.LargeListArray.from_arrays(pa.array(offsets, pa.int64()), struct))
    cols = {"advantage": pl.Series(adv), "adv_mask": pl.Series(mask),
            "step_advantages": steps_out.cast(STEP_ADV_DTYPE)}
    metrics = _metrics(adv, mask, g)
    metrics["advantage/steps"] = int(row.size)
    return cols, metrics


def _metrics(adv: np.ndarray, mask: np.ndarray, g: Grouped) -> dict:
    n_groups = int(g.count.size)
    return {
        "advantage/abs_mean": float(np.abs(adv[mask]).mean()) if mask.any() else 0.0,
        "advantage/zero_std_group_share": float((~g.varies).mean()) if n_groups else 0.0,
        "advantage/masked_rows": int((~mask).sum()),
        "advantage/groups": n_groups,
    }


def compute_advantages(scores: pl.DataFrame, cfg: AdvantageConfig) -> tuple[pl.DataFrame, dict]:
    """Advantages for every scored completion, grouped by ``prompt_id``.

    Parameters
    ----------
    scores : frame with ``prompt_id`` (str, group key), ``sample_idx`` (int), ``reward``
        (Float64, nullable; used by ``"grpo"``) and ``steps`` (List(Struct{start: Int32,
        end: Int32, reward: Float64}); used by ``"process"``). Row order is kept.
    cfg : ``estimator`` ("grpo" | "process"), ``std`` option and ``delta``.

    Returns
    -------
    Frame ``prompt_id, sample_idx, advantage, adv_mask, step_advantages`` (``step_advantages``
    is null for ``"grpo"``; for ``"process"`` it lists ``{end, value}`` per step, value = the
    normalised step reward, and ``advantage`` is the sum of the row's values). Metrics dict:
    ``advantage/abs_mean`` (over unmasked rows), ``advantage/zero_std_group_share`` (groups
    whose valid rewards are all equal, or that have none), ``advantage/masked_rows``,
    ``advantage/groups``.

    Examples
    --------
    >>> df = pl.DataFrame({"prompt_id": ["q"] * 4, "sample_idx": [0, 1, 2, 3], "reward": [2.0, 2, 2, 1]})
    >>> out, m = compute_advantages(df, AdvantageConfig())
    >>> out["advantage"].round(3).to_list(), m["advantage/groups"]
    ([0.577, 0.577, 0.577, -1.732], 1)
    """
    estimator = _lookup(ESTIMATORS, cfg.estimator, "advantage estimator")
    _require(scores, "prompt_id", (pl.String, pl.Categorical), "String")
    _require(scores, "sample_idx", (pl.Int8, pl.Int16, pl.Int32, pl.Int64, pl.UInt32, pl.UInt16), "integer")
    for col in ("prompt_id", "sample_idx"):
        if scores[col].null_count():
            k = int(scores[col].is_null().arg_true()[0])
            msg = f"scores column {col!r} is null at row {k}"
            raise ValueError(msg)
    keys = scores["prompt_id"].cast(pl.String)
    codes, n_groups = group_codes(keys)
    cols, metrics = estimator(scores, codes, n_groups, cfg)
    out = pl.DataFrame({"prompt_id": keys, "sample_idx": scores["sample_idx"].cast(pl.Int32), **cols})
    return out, metrics


# --------------------------------------------------------------------------- dynamic sampling
def filter_groups(
    scores: pl.DataFrame, adv: pl.DataFrame, *, wanted: int | None = None, kept_before: int = 0
) -> tuple[pl.DataFrame, dict[str, int]]:
    """DAPO's dynamic-sampling filter: mask groups whose rewards are all equal, keep ``wanted`` others.

    A group whose valid (non-null) rewards are all equal, or that has fewer than two, has zero
    advantage everywhere: it gives the policy gradient nothing and only dilutes the batch. Such
    groups are masked (``adv_mask`` False); of the informative groups, in the order they appear,
    the first ``wanted - kept_before`` are kept and the rest masked as surplus (``wanted=None``:
    all). ``scores`` and ``adv`` are row-aligned (same ``prompt_id`` order), as the stage writes them.

    Returns the masked ``adv`` and counts ``groups``, ``dropped`` (uninformative), ``kept``, ``surplus``.

    Examples
    --------
    >>> sc = pl.DataFrame({"prompt_id": ["a", "a", "b", "b", "c", "c"], "reward": [1.0, 1, 0, 1, 1, 0]})
    >>> adv = pl.DataFrame({"prompt_id": sc["prompt_id"], "adv_mask": [True] * 6})
    >>> out, n = filter_groups(sc, adv, wanted=1)
    >>> out["adv_mask"].to_list(), n
    ([False, False, True, True, False, False], {'groups': 3, 'dropped': 1, 'kept': 1, 'surplus': 1})
    """
    if scores.height != adv.height or not scores["prompt_id"].equals(adv["prompt_id"]):
        raise ValueError("filter_groups: scores and advantages are not row-aligned")
    groups = (scores.select("prompt_id", "reward")
              .group_by("prompt_id", maintain_order=True)
              .agg(informative=pl.col("reward").drop_nulls().drop_nans().n_unique() > 1))
    rank = groups["informative"].cast(pl.Int64).cum_sum()          # (n_groups,) informative groups so far
    room = None if wanted is None else max(wanted - kept_before, 0)
    keep = groups["informative"] & (rank <= room if room is not None else True)
    groups = groups.with_columns(keep=keep)
    kept_rows = adv.select("prompt_id").join(groups.select("prompt_id", "keep"), on="prompt_id", how="left",
                                             maintain_order="left")["keep"]
    n_inf, n_kept = int(groups["informative"].sum()), int(groups["keep"].sum())
    counts = {"groups": groups.height, "dropped": groups.height - n_inf, "kept": n_kept, "surplus": n_inf - n_kept}
    return adv.with_columns(adv_mask=pl.col("adv_mask") & kept_rows), counts


# --------------------------------------------------------------------------- token expansion
def token_advantages_from_steps(
    step_ends: Sequence[int], step_values: Sequence[float], token_ends: np.ndarray
) -> np.ndarray:
    """Per-token advantages of one completion from its normalised step rewards (gamma = 1).

    Token ``t`` spans characters ``[s_t, token_ends[t])`` of the completion, with
    ``s_0 = 0`` and ``s_t = token_ends[t-1]``. The token is *at or before* step ``j`` iff
    ``s_t < step_ends[j]``, and ``A_t = sum of step_values[j] over those steps``. So a token
    that straddles a step boundary counts for the step it starts in, the first token gets
    the sum of all steps that end after char 0, and tokens starting at or after the last
    step's end (e.g. the ``<answer>`` part) get 0. Step order does not matter.

    Parameters
    ----------
    step_ends : (K,) character end (exclusive) of each step; step_values : (K,) normalised step rewards.
    token_ends : (T,) character end of each token, non-decreasing. Returns (T,) float64.

    Examples
    --------
    >>> token_advantages_from_steps([4, 9], [1.0, -0.5], np.array([2, 4, 6, 9, 12])).tolist()
    [0.5, 0.5, -0.5, -0.5, 0.0]
    """
    ends = np.asarray(step_ends, dtype=np.int64)  # (K,)
    vals = np.asarray(step_values, dtype=np.float64)  # (K,)
    tok = np.asarray(token_ends, dtype=np.int64)  # (T,)
    if ends.shape != vals.shape:
        msg = f"step_ends {ends.shape} and step_values {vals.shape} differ in shape"
        raise ValueError(msg)
    if np.any(np.diff(tok) < 0):
        msg = f"token_ends must be non-decreasing; first drop at token {int(np.argmax(np.diff(tok) < 0)) + 1}"
        raise ValueError(msg)
    order = np.argsort(ends, kind="stable")
    ends, vals = ends[order], vals[order]
    suffix = np.concatenate([np.cumsum(vals[::-1])[::-1], [0.0]])  # (K+1,) suffix[k] = sum vals[k:]
    tok_start = np.concatenate([[0], tok[:-1]]) if tok.size else tok  # (T,)
    first = np.searchsorted(ends, tok_start, side="right")  # (T,) first step with end > start
    return suffix[first]


def token_advantages_batched(
    step_ends: np.ndarray, step_values: np.ndarray, token_ends: np.ndarray, *, step_mask: np.ndarray | None = None
) -> np.ndarray:
    """:func:`token_advantages_from_steps` for a padded batch of completions, without Python loops.

    Parameters
    ----------
    step_ends : (B, K) int; step_values : (B, K) float; step_mask : (B, K) bool, False on padding
        (default: all True). Padded steps contribute nothing.
    token_ends : (B, T) int >= 0, non-decreasing along T within the valid tokens; values after a
        row's last valid token are arbitrary (mask the result).
    Returns (B, T) float64: row ``b`` equals ``token_advantages_from_steps`` on its valid steps.
    """
    ends = np.asarray(step_ends, dtype=np.int64)
    vals = np.asarray(step_values, dtype=np.float64)
    tok = np.asarray(token_ends, dtype=np.int64)
    if ends.ndim != 2 or ends.shape != vals.shape or tok.ndim != 2 or tok.shape[0] != ends.shape[0]:
        msg = f"need step_ends/step_values (B, K) and token_ends (B, T); got {ends.shape}, {vals.shape}, {tok.shape}"
        raise ValueError(msg)
    if (ends.size and ends.min() < 0) or (tok.size and tok.min() < 0):
        msg = "step_ends and token_ends must be >= 0 (character offsets)"
        raise ValueError(msg)
    b, k = ends.shape
    mask = np.ones_like(ends, bool) if step_mask is None else np.asarray(step_mask, bool)
    tok_start = np.concatenate([np.zeros((b, 1), np.int64), tok[:, :-1]], axis=1)  # (B, T)
    span = int(max(ends.max(initial=0), tok_start.max(initial=0), 0)) + 2  # one key block per row
    ends = np.where(mask, ends, span - 1)  # padding sorts last in its row
    vals = np.where(mask, vals, 0.0)
    order = np.argsort(ends, axis=1, kind="stable")
    ends = np.take_along_axis(ends, order, axis=1)  # (B, K) sorted per row
    vals = np.take_along_axis(vals, order, axis=1)
    suffix = np.concatenate([np.cumsum(vals[:, ::-1], axis=1)[:, ::-1], np.zeros((b, 1))], axis=1)  # (B, K+1)
    base = np.arange(b, dtype=np.int64)[:, None] * span  # row-major keys stay globally sorted
    first = np.searchsorted((base + ends).ravel(), (base + tok_start).ravel(), side="right")  # (B*T,)
    first = first.reshape(tok.shape) - np.arange(b)[:, None] * k  # (B, T) index within the row
    return np.take_along_axis(suffix, first, axis=1)


def pad_step_advantages(step_advantages: pl.Series) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The ``step_advantages`` column as padded ``(ends (B, K) int64, values (B, K), mask (B, K))``.

    Null or empty lists give all-False mask rows; feed the result to
    :func:`token_advantages_batched`.
    """
    lengths = step_advantages.list.len().fill_null(0).to_numpy().astype(np.int64)  # (B,)
    b, k = lengths.size, int(lengths.max(initial=0))
    flat = step_advantages.explode(empty_as_null=False, keep_nulls=False).struct.unnest()
    row = np.repeat(np.arange(b), lengths)
    col = np.arange(row.size) - np.repeat(np.cumsum(lengths) - lengths, lengths)  # position in row
    ends, vals, mask = np.zeros((b, k), np.int64), np.zeros((b, k)), np.zeros((b, k), bool)
    ends[row, col] = flat["end"].to_numpy()
    vals[row, col] = flat["value"].fill_null(0.0).to_numpy()
    mask[row, col] = True
    return ends, vals, mask
