"""The CaM paper's own merge rule (zyxxmu/cam), offered for comparison with the adaptation."""

from __future__ import annotations

import mlx.core as mx

from kvpolicy_core.parts.base import CacheView, Disposition, MergeUpdate, Needs

from .gated_merge import STATS, bernoulli, finite_rows, gate_probability, loser_mask, per_row, take

_INT_MAX = 2**31 - 1


class PaperMergeDisposition(Disposition):
    """Spread the loser's value over the m retained tokens that follow it.

    For loser l, N(l) = the (up to) m surviving tokens with the smallest positions
    greater than pos_l (other losers of the step and window-dead tokens excluded)::

        p   = clamp(s_l / mean_{j in N(l)} s_j, 0, 1)     (gate; p = 1 if off)
        M   ~ Bernoulli(p)
        v_j' = v_j + M * v_l / m                          for j in N(l)

    Keys and scores are untouched (as in the paper's code). A loser with no following
    survivor, or with a non-finite value, is dropped. Not normalised: ``m`` stays the divisor when |N(l)| < m.
    """

    needs = Needs(batch_rows=True)  # per-row keys, counters per row (parts.base.BATCH_ROWS)

    def __init__(self, m: int = 16, gate: bool = True) -> None:
        self.m, self.gate = m, gate

    @classmethod
    def from_config(cls, config) -> "PaperMergeDisposition":
        return cls(m=config.merge_window, gate=config.merge_gate)

    def stats(self):
        return STATS

    def dispose(self, view: CacheView, losers: mx.array, key: mx.array) -> MergeUpdate:
        B, H, L = view.scores.shape
        E = losers.shape[-1]
        k = min(self.m, L)
        pos_l = take(view.positions, losers)  # [B, H, E]
        cand = view.positions[:, :, None, :] > pos_l[..., None]
        excluded = loser_mask(losers, L)
        if view.dead is not None:
            excluded = excluded | view.dead
        cand = cand & ~excluded[:, :, None, :]
        rank = mx.where(cand, view.positions[:, :, None, :], _INT_MAX)  # [B, H, E, L]
        nxt = mx.argpartition(rank, k - 1, axis=-1)[..., :k].astype(mx.int32)  # [B, H, E, k]
        valid = mx.take_along_axis(rank, nxt, axis=-1) < _INT_MAX
        nxt_flat = nxt.reshape(B, H, E * k)
        s_next = take(view.scores, nxt_flat).reshape(B, H, E, k)
        count = valid.sum(axis=-1)
        mean_next = mx.where(valid, s_next, 0.0).sum(axis=-1) / mx.maximum(count, 1)
        s_l = take(view.scores, losers)
        has = (count > 0) & finite_rows(view.values, losers)
        if self.gate:
            merge = has & bernoulli(gate_probability(s_l, mean_next), key, view.head_offset, view.heads_total)
            draws = per_row(has)
        else:
            merge, draws = has, mx.zeros((has.shape[0],), mx.int32)
        v_l = take(view.values, losers).astype(mx.float32)  # [B, H, E, Dv]
        mask = (merge[..., None] & valid)[..., None]  # [B, H, E, k, 1]
        add = mx.where(mask, v_l[:, :, :, None, :] / self.m, 0.0)  # [B, H, E, k, Dv]
        return MergeUpdate(
            targets=nxt_flat,
            d_keys=None,
            d_values=add.reshape(B, H, E * k, -1),  # float32: added in float32, the sum saturating in float16
            d_scores=None,
            stats={"gate_draws": draws, "merges": per_row(merge)},
        )
