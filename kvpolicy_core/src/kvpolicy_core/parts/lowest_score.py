"""Lowest-score selector with protected sinks and a protected recent window."""

from __future__ import annotations

import math

import mlx.core as mx

from .base import CacheView, Selector


def protected_mask(positions: mx.array, offset: int, n_sink: int, recent: int) -> mx.array:
    """bool [B, H, L]: the first ``n_sink`` absolute positions and the ``recent`` newest tokens."""
    return (positions < n_sink) | (positions >= offset - recent)


def pick_lowest(ranked: mx.array, n_evict: int) -> mx.array:
    """Indices [B, H, n_evict] int32 of the ``n_evict`` smallest entries of ``ranked`` [B, H, L].

    Ties go to the lower slot index for ``n_evict == 1`` (argmin); for more, the set is
    deterministic (argpartition) but its order is unspecified.
    """
    if n_evict == 1:
        return mx.argmin(ranked, axis=-1, keepdims=True).astype(mx.int32)
    return mx.argpartition(ranked, n_evict - 1, axis=-1)[..., :n_evict].astype(mx.int32)


class LowestScoreSelector(Selector):
    """The unprotected tokens with the lowest scores lose.

    Protected (never chosen): positions < ``n_sink`` and positions >= offset - ``recent``.
    Tokens outside a sliding window (``view.dead``) go first, sinks included::

        rank_j = -inf if dead_j else (+inf if protected_j else s_j);  losers = argmin_E(rank)

    With ``recent = 0`` this is exactly the specification's H2O, whose new token
    (score 0) is evicted at once and whose kept set freezes on the prompt.
    """

    def __init__(self, n_sink: int = 4, recent: int = 0) -> None:
        self.n_sink, self.recent = n_sink, recent

    @classmethod
    def from_config(cls, config) -> "LowestScoreSelector":
        return cls(n_sink=config.n_sink, recent=config.recent_tokens)

    def select(self, view: CacheView, n_evict: int) -> mx.array:
        protected = protected_mask(view.positions, view.offset, self.n_sink, self.recent)
        ranked = mx.where(protected, mx.array(math.inf, dtype=mx.float32), view.scores)
        if view.dead is not None:
            ranked = mx.where(view.dead, mx.array(-math.inf, dtype=mx.float32), ranked)
        return pick_lowest(ranked, n_evict)
