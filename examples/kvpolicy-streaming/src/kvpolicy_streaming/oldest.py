"""The oldest-first selector (StreamingLLM's eviction)."""

import math

import mlx.core as mx

from kvpolicy_core import CacheView, Needs, Scorer, Selector


class OldestSelector(Selector):
    """The non-sink tokens with the smallest positions lose (window-dead tokens go first: the cache)::

    rank_j = +inf if pos_j < n_sink else pos_j
    """

    def __init__(self, n_sink: int = 4) -> None:
        self.n_sink = n_sink

    @classmethod
    def from_config(cls, config) -> "OldestSelector":
        return cls(n_sink=config.n_sink)

    def rank(self, view: CacheView) -> mx.array:
        pos = view.positions.astype(mx.float32)
        return mx.where(view.positions < self.n_sink, mx.array(math.inf, mx.float32), pos)


class ConstantScorer(Scorer):
    """No scores: every token keeps 0 (the selector decides by position)."""

    needs = Needs(trim_exact=True)  # nothing depends on later tokens: the cache can drop its newest tokens exactly
