"""CaM-adapted disposition: merge the loser into its most similar survivor, behind a gate."""

from __future__ import annotations

import math
from typing import Optional

import mlx.core as mx

from kvpolicy_core.parts.base import CacheView, Disposition, MergeUpdate, Needs
from kvpolicy_core.parts.traits import traits

#: The counters CaM's dispositions report (``cache.stats()``, ``cache.gate_draws``, ``cache.merges``).
STATS = {"gate_draws": "losers that drew the Bernoulli merge gate", "merges": "losers merged into survivors"}


def take(x: mx.array, idx: mx.array) -> mx.array:
    """Gather along the slot axis: x [B, H, L, ...], idx [B, H, E] -> [B, H, E, ...]."""
    if x.ndim == 3:
        return mx.take_along_axis(x, idx, axis=2)
    return mx.take_along_axis(x, idx[..., None], axis=2)


def per_row(flags: mx.array) -> mx.array:
    """[B, ...] bool -> [B] int32 counts: counters per batch row (parts.base.BATCH_ROWS)."""
    return flags.reshape(flags.shape[0], -1).astype(mx.int32).sum(axis=-1)


def cosine_to_all(view: CacheView, rows: mx.array) -> mx.array:
    """cos(k_r, k_j) [B, H, E, L] float32 for the slots ``rows`` [B, H, E] against every slot::

        cos(k_r, k_j) = (k_r . k_j) / (max(|k_r|, eps) max(|k_j|, eps))

    The norms come from ``view.key_norms`` (kept by the cache, O(D) per written slot), so a step costs one
    product of the keys with the E rows, not a pass that normalises every key; a zero key has cosine 0 with
    anything. The product is taken as keys [L, D] x rows^T [D, E] (the keys untransposed: BLAS reads them
    row by row in memory order, faster at decode than rows x keys^T, and the same dot products bit for bit).
    """
    k = view.keys if view.keys.dtype == mx.float32 else view.keys.astype(mx.float32)
    norms = getattr(view, "key_norms", None)
    if norms is None:
        norms = mx.sqrt((k * k).sum(axis=-1))
    norms = mx.maximum(norms, 1e-12)
    dots = (k @ take(k, rows).swapaxes(-1, -2)).swapaxes(-1, -2)  # [B, H, E, L]
    return dots / (take(norms, rows)[..., None] * norms[:, :, None, :])


def loser_mask(losers: mx.array, L: int) -> mx.array:
    """bool [B, H, L]: True at the loser slots."""
    zeros = mx.zeros((*losers.shape[:2], L), dtype=mx.bool_)
    return mx.put_along_axis(zeros, losers, mx.array(True), axis=2)


def merge_targets(view: CacheView, losers: mx.array, n_sink: int):
    """The most similar surviving non-sink token of each loser, by key cosine.

    Returns (target [B, H, E] int32, cos [B, H, E] float32, has_target [B, H, E] bool).
    Excluded: sinks (positions < n_sink), every loser of this step (its own slot
    included), tokens outside a sliding window and non-finite similarities. No
    candidate -> has_target False.
    """
    L = view.keys.shape[2]
    sim = cosine_to_all(view, losers)  # [B, H, E, L]
    invalid = (view.positions < n_sink) | loser_mask(losers, L)
    if view.dead is not None:
        invalid = invalid | view.dead
    sim = mx.where(invalid[:, :, None, :] | mx.isnan(sim), mx.array(-math.inf, mx.float32), sim)
    target = mx.argmax(sim, axis=-1).astype(mx.int32)
    cos = mx.take_along_axis(sim, target[..., None], axis=-1)[..., 0]
    return target, cos, cos > -math.inf


def finite_rows(x: mx.array, idx: mx.array) -> mx.array:
    """bool [B, H, E]: the rows ``idx`` of x [B, H, L, D] are all finite."""
    return mx.isfinite(take(x, idx)).all(axis=-1)


def blend_update(
    view: CacheView,
    losers: mx.array,
    target: mx.array,
    merge: mx.array,
    coef: mx.array,
    s_l: mx.array,
    draws: mx.array,
    merge_keys: bool,
    d_log_weights=None,
) -> MergeUpdate:
    """The MergeUpdate of a blend ``x_t' = x_t + coef (x_l - x_t)`` for each merged loser (``merge`` [B, H, E]
    bool, ``coef`` [B, H, E]): values always, keys with ``merge_keys``; ``s_t' = s_t + s_l``."""

    def delta(x):  # where(), not a product: 0 * NaN would still be NaN
        d = coef[..., None] * (take(x, losers).astype(mx.float32) - take(x, target).astype(mx.float32))
        return mx.where(merge[..., None], d, 0.0)  # float32: the cache adds it in float32 (no overflow in float16)

    return MergeUpdate(
        targets=target,
        d_keys=delta(view.keys) if merge_keys else None,
        d_values=delta(view.values),
        d_scores=mx.where(merge, s_l, 0.0),
        stats={"gate_draws": draws, "merges": per_row(merge)},
        d_log_weights=d_log_weights,
    )


def gate_probability(s_loser: mx.array, s_target: mx.array) -> mx.array:
    """p = clamp(s_loser / s_target, 0, 1); for s_target <= 0: p = 1 if s_loser > 0 else 0."""
    safe = mx.where(s_target > 0, s_target, mx.ones_like(s_target))
    ratio = mx.clip(s_loser / safe, 0.0, 1.0)
    fallback = (s_loser > 0).astype(mx.float32)
    return mx.where(s_target > 0, ratio, fallback)


def bernoulli(p: mx.array, key: mx.array, head_offset: int = 0, heads_total: Optional[int] = None) -> mx.array:
    """One independent draw per element: u ~ U[0, 1), merge iff u < p (p=1 always, p=0 never).

    For p [B, H, E] holding global heads ``head_offset .. head_offset + H - 1`` of ``heads_total``
    (a tensor-parallel rank's slice), u is the same slice of the draw over all heads,
    ``uniform(key, [B, heads_total, E])[:, head_offset : head_offset + H]``: a head's draw is a
    function of (key, global head), the same whichever rank holds it, and unsharded draws are
    unchanged.
    """
    if key.ndim == 2:  # stacked rows (parts.base.BATCH_ROWS): row b draws with its own key, as alone
        return mx.concatenate([bernoulli(p[b : b + 1], key[b], head_offset, heads_total) for b in range(p.shape[0])])
    if heads_total is None or (head_offset == 0 and heads_total == p.shape[1]):
        return mx.random.uniform(shape=p.shape, key=key) < p
    B, H, E = p.shape
    u = mx.random.uniform(shape=(B, heads_total, E), key=key)[:, head_offset : head_offset + H]
    return u < p


# decode steps one compiled graph instead of ~40 small ops; key norms kept from the first token (merge_targets
# needs no pass over every key)
@traits(compile_decode=True, key_norms=True)
class GatedMergeDisposition(Disposition):
    """Merge each loser l into its target t (the most similar surviving non-sink key).

    Gate (``gate=True``): ``M ~ Bernoulli(clamp(s_l / s_t, 0, 1))``; else ``M = 1``.
    Weight: ``w = clip(cos(k_l, k_t), 0, 1)`` ("sim_weighted") or ``1/2`` ("mean").
    Blend, for values (and keys when ``merge_keys``)::

        x_t' = x_t + sum_{l -> t} M_l w_l (x_l - x_t) / max(1, sum_{l -> t} M_l w_l)

    With one loser per step (decode) this is ``x_t' = (1 - w) x_t + w x_l``. With several
    losers of one chunk sharing a target it is the convex combination of all of them
    (normalised when the weights sum past 1), independent of the losers' order.
    Mass transfer: ``s_t' = s_t + sum_{l -> t} M_l s_l``. The losers are then removed.
    Losers outside a sliding window (``view.dead``) and losers with a non-finite key or value
    are dropped, not merged: a finite survivor never absorbs NaN or Inf.
    """

    needs = Needs(batch_rows=True)  # per-row keys, counters per row (parts.base.BATCH_ROWS)

    def __init__(self, n_sink: int = 4, mode: str = "sim_weighted", gate: bool = True, merge_keys: bool = False):
        if mode not in ("sim_weighted", "mean"):
            raise ValueError(f"mode must be 'sim_weighted' or 'mean' (got {mode!r})")
        self.n_sink, self.mode, self.gate, self.merge_keys = n_sink, mode, gate, merge_keys

    @classmethod
    def from_config(cls, config) -> "GatedMergeDisposition":
        return cls(n_sink=config.n_sink, mode=config.merge, gate=config.merge_gate, merge_keys=config.merge_keys)

    def stats(self):
        return STATS

    def dispose(self, view: CacheView, losers: mx.array, key: mx.array) -> MergeUpdate:
        target, cos, has_target = merge_targets(view, losers, self.n_sink)
        has_target = has_target & finite_rows(view.keys, losers) & finite_rows(view.values, losers)
        s_l, s_t = take(view.scores, losers), take(view.scores, target)
        if view.dead is not None:
            has_target = has_target & ~take(view.dead, losers)
        if self.gate:
            merge = has_target & bernoulli(gate_probability(s_l, s_t), key, view.head_offset, view.heads_total)
            draws = per_row(has_target)
        else:
            merge, draws = has_target, mx.zeros((has_target.shape[0],), mx.int32)
        w = mx.clip(cos, 0.0, 1.0) if self.mode == "sim_weighted" else mx.full(cos.shape, 0.5)
        w = mx.where(merge, w, 0.0)
        B, H, L = view.scores.shape
        bi, hi = mx.arange(B)[:, None, None], mx.arange(H)[None, :, None]
        w_sum = mx.zeros((B, H, L), mx.float32).at[bi, hi, target].add(w)
        coef = w / mx.maximum(take(w_sum, target), 1.0)
        return blend_update(view, losers, target, merge, coef, s_l, draws, self.merge_keys)
