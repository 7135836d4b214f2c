"""The one choice rule: which slots an eviction removes, from a selector's ranks (used eager and compiled)."""

from __future__ import annotations

import math
from typing import Optional

import mlx.core as mx
import numpy as np

from ..parts.base import pick_lowest

_RANK_CAP = 3.0e38  # ranks are clipped to +-this: protected (+inf, NaN) ranks take float32's max, dead slots -inf
_FLOAT32_MAX = float(np.finfo(np.float32).max)


def choose(ranked: mx.array, positions: mx.array, n_sink, dead: Optional[mx.array], n_evict: int) -> mx.array:
    """Losers [B, H, E] int32 from a selector's ranks [B, H, L]: the E lowest of ::

        r_j = -inf if dead_j  else  +inf if pos_j < n_sink  else  max32 if rank_j in {+inf, NaN}
              else clip(rank_j, -3e38, 3e38)

    four strict tiers: window-dead slots go first, then the selector's finite ranks (lowest first), then the
    slots it protects, and a sink never unless window-dead. Distinct indices in ``[0, L)`` by construction
    (:func:`pick_lowest`), whatever the ranks are."""
    protected = mx.isnan(ranked) | mx.isposinf(ranked)
    r = mx.where(protected, mx.array(_FLOAT32_MAX, dtype=mx.float32), mx.clip(ranked, -_RANK_CAP, _RANK_CAP))
    r = mx.where(positions < n_sink, mx.array(math.inf, dtype=mx.float32), r)
    if dead is not None:
        r = mx.where(dead, mx.array(-math.inf, dtype=mx.float32), r)
    return pick_lowest(r, n_evict)
