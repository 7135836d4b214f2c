"""The oldest-first selector (StreamingLLM's eviction)."""

import math

import mlx.core as mx

from kvpolicy_core import CacheView, Selector, pick_lowest


class OldestSelector(Selector):
    """The non-sink tokens with the smallest positions lose::

        rank_j = -inf if dead_j else (+inf if pos_j < n_sink else pos_j);  losers = argmin_E(rank)
    """

    def __init__(self, n_sink: int = 4) -> None:
        self.n_sink = n_sink

    @classmethod
    def from_config(cls, config) -> "OldestSelector":
        return cls(n_sink=config.n_sink)

    def select(self, view: CacheView, n_evict: int) -> mx.array:
        pos = view.positions.astype(mx.float32)
        ranked = mx.where(view.positions < self.n_sink, mx.array(math.inf, mx.float32), pos)
        if view.dead is not None:
            ranked = mx.where(view.dead, mx.array(-math.inf, mx.float32), ranked)
        return pick_lowest(ranked, n_evict)


class ConstantScorer:
    """No scores: every token keeps 0 (the selector decides by position)."""

    needs_attention = False

    @classmethod
    def from_config(cls, config) -> "ConstantScorer":
        return cls()

    def on_append(self, view, new_keys, new_positions):
        return view.scores

    def on_attention(self, view, queries, scale, mask):
        return view.scores
