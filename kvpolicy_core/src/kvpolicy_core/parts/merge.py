"""Helpers for merge dispositions: the plain (weighted) average of losers into their targets.

A disposition reports *additive deltas* (:class:`~kvpolicy_core.parts.base.MergeUpdate`):
scatter-adds are order-independent when several losers share a target, touch only the
``E`` target rows (not the whole cache), and compose with other updates. Averaging needs
the number of losers per target; :func:`average_into` counts it and returns the deltas.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx

from .base import CacheView, MergeUpdate


def gather(x: mx.array, idx: mx.array) -> mx.array:
    """Rows ``idx`` [B, H, E] of x [B, H, L] or [B, H, L, D] -> [B, H, E] or [B, H, E, D]."""
    return mx.take_along_axis(x, idx if x.ndim == 3 else idx[..., None], axis=2)


def per_target_sum(values: mx.array, targets: mx.array, L: int) -> mx.array:
    """sum over the losers l with target t of values_l: [B, H, E] -> [B, H, L] float32."""
    B, H = targets.shape[:2]
    bi, hi = mx.arange(B)[:, None, None], mx.arange(H)[None, :, None]
    return mx.zeros((B, H, L), mx.float32).at[bi, hi, targets].add(values.astype(mx.float32))


def average_into(
    view: CacheView,
    losers: mx.array,
    targets: mx.array,
    merge: Optional[mx.array] = None,
    weights: Optional[mx.array] = None,
    keys: bool = False,
    move_scores: bool = True,
) -> MergeUpdate:
    """Average each loser into its target; losers [B, H, E], targets [B, H, E] int32.

    With weights w_l (default 1) and ``merge`` [B, H, E] bool (default all), every target t becomes::

        x_t' = (x_t + sum_{l -> t} w_l x_l) / (1 + sum_{l -> t} w_l)       (values; keys if ``keys``)
        s_t' = s_t + sum_{l -> t} s_l                                      (if ``move_scores``)

    returned as the per-loser deltas ``w_l (x_l - x_t) / (1 + W_t)``, which sum to exactly that.
    ``stats`` counts ``merges`` (losers merged).
    """
    merge = mx.ones(losers.shape, mx.bool_) if merge is None else merge
    w = mx.ones(losers.shape, mx.float32) if weights is None else weights.astype(mx.float32)
    w = mx.where(merge, w, 0.0)
    total = gather(per_target_sum(w, targets, view.keys.shape[2]), targets)  # W_t per loser
    coef = (w / (1.0 + total))[..., None]

    def delta(x):  # where(), not a product: 0 * NaN would still be NaN
        d = coef * (gather(x, losers).astype(mx.float32) - gather(x, targets).astype(mx.float32))
        return mx.where(merge[..., None], d, 0.0)  # float32: the cache adds it in float32 (no overflow in float16)

    return MergeUpdate(
        targets=targets,
        d_keys=delta(view.keys) if keys else None,
        d_values=delta(view.values),
        d_scores=mx.where(merge, gather(view.scores, losers), 0.0) if move_scores else None,
        stats={"merges": merge.sum()},
    )
