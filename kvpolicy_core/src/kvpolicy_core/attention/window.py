"""Sliding-window layers: the per-layer mask and the slots no future query can see.

A query at position p may attend to a key at position q iff ``p - W < q <= p``. Slots are not
in temporal order, so the mask is built from each layer's own ``positions``.
"""

from __future__ import annotations

import mlx.core as mx


def window_mask(positions: mx.array, offset, n_queries: int, window: int, n_q_heads: int) -> mx.array:
    """positions [B, H, L] -> bool [B, Hq, S, L] for the S queries at ``offset - S .. offset - 1``; ``offset`` an int,
    or for one query per row (stacked rows) the int32 array [B, 1, 1] of each row's."""
    if isinstance(offset, int):
        qpos = mx.arange(offset - n_queries, offset, dtype=mx.int32)[None, None, :, None]
    else:
        qpos = offset[..., None] - 1  # [B, 1, 1, 1]
    kpos = positions[:, :, None, :]
    allowed = (kpos <= qpos) & (kpos > qpos - window)
    H = positions.shape[1]
    return mx.repeat(allowed, n_q_heads // H, axis=1) if n_q_heads != H else allowed


def outside_window(positions: mx.array, offset: int, window: int) -> mx.array:
    """bool [B, H, L]: slots outside the window of every future query (position <= offset - W)."""
    return positions <= offset - window
