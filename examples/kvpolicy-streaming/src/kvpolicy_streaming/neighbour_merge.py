"""A merge disposition: each loser is averaged into the next surviving token."""

import mlx.core as mx

from kvpolicy_core import CacheView, Disposition, MergeUpdate
from kvpolicy_core.parts.merge import average_into

_INT_MAX = 2**31 - 1


def next_survivor(view: CacheView, losers: mx.array, n_sink: int):
    """The surviving non-sink slot with the smallest position after each loser's.

    losers [B, H, E] -> (targets [B, H, E] int32, found [B, H, E] bool). Excluded: sinks, this
    step's losers, window-dead slots.
    """
    pos_l = mx.take_along_axis(view.positions, losers, axis=2)  # [B, H, E]
    out = mx.put_along_axis(mx.zeros(view.positions.shape, mx.bool_), losers, mx.array(True), axis=2)
    out = out | (view.positions < n_sink)
    if view.dead is not None:
        out = out | view.dead
    later = (view.positions[:, :, None, :] > pos_l[..., None]) & ~out[:, :, None, :]  # [B, H, E, L]
    rank = mx.where(later, view.positions[:, :, None, :], _INT_MAX)
    targets = mx.argmin(rank, axis=-1).astype(mx.int32)
    found = mx.take_along_axis(rank, targets[..., None], axis=-1)[..., 0] < _INT_MAX
    return mx.where(found, targets, 0), found


class NeighbourMergeDisposition(Disposition):
    """Plain average of a target and every loser merged into it (keys and values)::

    t(l) = argmin_{j survives, pos_j > pos_l, pos_j >= n_sink} pos_j        (none: l is dropped)
    x_t' = (x_t + sum_{l -> t} x_l) / (1 + |{l : t(l) = t}|)
    """

    def __init__(self, n_sink: int = 4) -> None:
        self.n_sink = n_sink

    @classmethod
    def from_config(cls, config) -> "NeighbourMergeDisposition":
        return cls(n_sink=config.n_sink)

    def stats(self):
        return {"merges": "losers averaged into the next survivor"}

    def dispose(self, view: CacheView, losers: mx.array, key: mx.array) -> MergeUpdate:
        targets, found = next_survivor(view, losers, self.n_sink)
        return average_into(view, losers, targets, merge=found, keys=True)
