"""Max-pooling of per-token scores over neighbouring positions, so that a span (a number, a name) is kept or lost
as a whole. Shared by every scorer that scores a prompt chunk (observation window, KeyDiff, Expected Attention)
and by compress-once's cut."""

from __future__ import annotations

import math

import mlx.core as mx


def pool_by_position(x: mx.array, positions: mx.array, P: int, taper: float = 0.0) -> mx.array:
    """Max over each slot's ``P`` nearest retained neighbours in position order.

    x [B, H, L] float32, positions [B, H, L] int32 (distinct per row, any slot order),
    ``P`` odd. With r = (P - 1) / 2 and slots sorted by position (rank ``i``)::

        y_(i) = max_{|k - i| <= r} ( x_(k) - taper * |k - i| * |x_(k)| )

    ``taper = 0``: the plain max-pool, under which a span around one attended token is a plateau of
    equal scores. A small ``taper`` (the cut's ``TIE_TAPER``, :mod:`kvpolicy_core.config.attention_config`)
    only orders such a plateau: nearer the token it pools from ranks higher, so a budget boundary that
    falls inside the span keeps its middle, not an arbitrary part of it. Neighbours are the nearest
    *retained* tokens: after evictions they may be further apart than r positions. ``P == 1`` returns ``x``.
    """
    if P <= 1:
        return x
    r = (P - 1) // 2
    L = x.shape[-1]
    order = mx.argsort(positions, axis=-1)
    xs = mx.take_along_axis(x, order, axis=-1)
    pad = mx.full((*x.shape[:-1], r), -math.inf, dtype=x.dtype)
    padded = mx.concatenate([pad, xs, pad], axis=-1)
    pooled = xs
    for k in range(P):  # P shifted views (P is a small constant), not a loop over tokens
        if k != r:
            view = padded[..., k : k + L]
            if taper:
                view = view - (taper * abs(k - r)) * mx.abs(view)
            pooled = mx.maximum(pooled, view)
    return mx.put_along_axis(mx.zeros_like(x), order, pooled, axis=-1)
