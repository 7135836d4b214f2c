"""Lowest-score selector with protected sinks and a protected recent window."""

from __future__ import annotations

import math

import mlx.core as mx

from .base import CacheView, Needs, Selector, pick_lowest
from .traits import traits

__all__ = ["LowestScoreSelector", "protected_mask", "pick_lowest"]


def protected_mask(positions: mx.array, offset, n_sink: int, recent: int) -> mx.array:
    """bool [B, H, L]: the first ``n_sink`` absolute positions and the ``recent`` newest tokens (``offset``: an
    int or an int32 array broadcasting against ``positions`` [B, H, L], such as ``CacheView.offset``)."""
    return (positions < n_sink) | (positions >= offset - recent)


@traits(compile_decode=True)  # decode steps: rank, protection and the choice as one compiled graph
class LowestScoreSelector(Selector):
    """The unprotected tokens with the lowest scores lose.

    Protected (never chosen): positions < ``n_sink`` and positions >= offset - ``recent``.
    The cache evicts tokens outside a sliding window first, sinks included::

        rank_j = +inf if protected_j else s_j;   losers = argmin_E(-inf if dead_j else rank_j)

    With ``recent = 0`` this is exactly the specification's H2O, whose new token
    (score 0) is evicted at once and whose kept set freezes on the prompt.
    """

    needs = Needs(batch_rows=True)  # view.offset is [B, 1, 1]: protected_mask broadcasts per row

    def __init__(self, n_sink: int = 4, recent: int = 0) -> None:
        self.n_sink, self.recent = n_sink, recent

    @classmethod
    def from_config(cls, config) -> "LowestScoreSelector":
        return cls(n_sink=config.n_sink, recent=config.recent_tokens)

    def leaves_a_loser(self, L: int) -> bool:
        """Whether ``L`` slots (distinct positions) always hold an unprotected one: at most ``n_sink``
        sinks and ``recent`` recent tokens are protected. The config guarantees it (budget > n_sink +
        recent); a selector built by hand may not, and is then checked like any part."""
        return self.n_sink + self.recent < L

    def rank(self, view: CacheView) -> mx.array:
        protected = protected_mask(view.positions, view.offset, self.n_sink, self.recent)
        return mx.where(protected, mx.array(math.inf, dtype=mx.float32), view.scores)
