"""CaM merges that keep the attention mass of what they absorb (``merge="mass"``, ``"mass_blend"``).

The specification's blend (``sim_weighted``) rewrites the nearest survivor with a weight up to ~1,
whatever the attention either token drew; the merged slot then stands for two tokens but draws the
attention of one. These merges weigh each side by the attention it drew and, for ``"mass"``, give
the merged slot the attention of both through its attention log-weight (ToMe's proportional
attention; KeepKV's "electoral votes", arXiv 2504.09936), scaled by attention *mass*, not by
token counts (a count over-weights a survivor whose key is not the absorbed tokens' key).

Notation for loser ``l`` merged into target ``t`` (the most similar surviving non-sink key, as
in the specification), ``s`` the cumulative attention score (the scorer's), ``pos`` positions,
``o`` the offset (tokens seen): the attention rate of a slot is ``r_j = s_j / max(o - pos_j, 1)``
(mean attention per query since it arrived; the observed signal already includes the slot's
log-weight). With several losers of one chunk sharing a target, sums run over ``l -> t``.
"""

from __future__ import annotations

import math
from typing import Optional

import mlx.core as mx

from kvpolicy_core.parts.base import CacheView, Disposition, MergeUpdate, Needs
from kvpolicy_core.parts.merge import per_target_sum
from kvpolicy_core.parts.traits import traits

from .gated_merge import STATS, bernoulli, blend_update, finite_rows, gate_probability, merge_targets, per_row, take

_INT32_MAX = 2**31 - 1
_MAX_RATIO = 1e4  # bounds one merge's log-weight step to log(1 + 1e4) ~ 9.2


def mass_at(view: CacheView, idx: mx.array, rate: bool) -> mx.array:
    """[B, H, E] float32: the mass of the slots ``idx`` [B, H, E], computed for those slots only::

    rate=True:   r_j = max(s_j, 0) / max(o - pos_j, 1)   (the mean attention per query since it arrived)
    rate=False:  m_j = max(s_j, 0)                        (the cumulative attention mass)
    """
    s = mx.maximum(take(view.scores, idx), 0.0)
    if not rate:
        return s
    return s / mx.maximum(view.offset - take(view.positions, idx), 1).astype(mx.float32)


def after_tokens(after: float, budget: int) -> int:
    """``ceil(after * budget)``: the offset from which merges begin (0: no threshold, for ``after = 1``), at most
    2**31 - 1, since the offset enters compiled steps as an int32 (a threshold beyond it is never reached)."""
    if after == 1:
        return 0
    return int(math.ceil(min(after * budget, _INT32_MAX)))


# decode steps one compiled graph instead of ~40 small ops; key norms kept from the first token (merge_targets
# needs no pass over every key)
@traits(compile_decode=True, key_norms=True)
class MassMergeDisposition(Disposition):
    """Merge each loser into its nearest survivor, weighted by attention drawn.

    ``log_weights=False`` (``merge="mass_blend"``), m = cumulative attention mass ``s``::

        v_t' = (m_t v_t + sum_{l->t} M_l m_l v_l) / (m_t + sum_{l->t} M_l m_l)
        s_t' = s_t + sum_{l->t} M_l s_l

    ``log_weights=True`` (``merge="mass"``), m = attention rate ``r`` and the slot's log-weight::

        v_t'  = (r_t v_t + sum_{l->t} M_l r_l v_l) / (r_t + sum_{l->t} M_l r_l)
        lw_t' = lw_t + log(1 + sum_{l->t} M_l r_l / r_t)          (ratio capped at 1e4)
        s_t'  = s_t + sum_{l->t} M_l s_l

    so that, for a query whose attention shares match the slots' past rates, the merged slot
    draws the attention of both sides (``exp(q.k_t + lw_t') = exp(q.k_t + lw_t) (r_t + r_l) / r_t``)
    and returns their attention-weighted mean value: the attention output is unchanged.
    ``M_l`` is the specification's Bernoulli gate (``gate=True``) or 1, times the similarity
    threshold ``[cos(k_l, k_t) >= min_sim]`` (``min_sim=-1``: always; a loser below it is dropped,
    as H2O drops it, so ``min_sim > 1`` is H2O exactly), times ``[E == 1]`` when
    ``merge_prompt=False``: only an eviction of one loser per row (a decode step's) merges; the
    E > 1 losers of a prompt chunk are dropped. Keys are blended with the
    same weights only with ``merge_keys``, times ``[lw_t < log c]`` for the cap ``c = merge_cap``
    (``merge="mass"`` only; ``None``: no cap): a slot stands for at most ``c`` copies of its own
    attention, so at small budgets a few slots cannot absorb most of the evicted text; a loser whose
    target is full is dropped. A side with zero mass leaves the target unchanged.
    Losers outside a sliding window or with non-finite keys/values are dropped.
    """

    needs = Needs(batch_rows=True)  # per-row keys and offsets, counters per row (parts.base.BATCH_ROWS)

    def __init__(
        self,
        n_sink: int = 4,
        log_weights: bool = True,
        gate: bool = False,
        merge_keys: bool = False,
        min_sim: float = -1.0,
        merge_prompt: bool = True,
        cap: Optional[float] = None,
        after_tokens: int = 0,
    ):
        self.n_sink, self.gate, self.merge_keys, self.min_sim = n_sink, gate, merge_keys, float(min_sim)
        self.log_cap = None if cap is None or not log_weights else math.log(cap)
        self.merge_prompt = merge_prompt
        self.after_tokens = int(after_tokens)  # merges only once offset >= after_tokens
        self.with_log_weights = log_weights
        self.needs = Needs(log_weights=log_weights, batch_rows=True)

    @classmethod
    def from_config(cls, config) -> "MassMergeDisposition":
        return cls(
            n_sink=config.n_sink,
            log_weights=config.merge == "mass",
            gate=config.merge_gate,
            merge_keys=config.merge_keys,
            min_sim=config.merge_min_sim,
            merge_prompt=config.merge_prompt,
            cap=config.merge_cap,
            after_tokens=after_tokens(config.merge_after, config.budget),
        )

    def stats(self):
        return STATS

    def dispose(self, view: CacheView, losers: mx.array, key: mx.array) -> Optional[MergeUpdate]:
        if not self.merge_prompt and losers.shape[-1] != 1:
            return None  # several losers: a prompt chunk's, dropped as H2O drops them (no target search)
        target, cos, has_target = merge_targets(view, losers, self.n_sink)
        if self.after_tokens > 0:  # view.offset: int32 [B, 1, 1]
            has_target = has_target & (view.offset >= self.after_tokens)
        if self.min_sim > -1.0:
            has_target = has_target & (cos >= self.min_sim)
        has_target = has_target & finite_rows(view.keys, losers) & finite_rows(view.values, losers)
        if view.dead is not None:
            has_target = has_target & ~take(view.dead, losers)
        lw_t = None
        if self.log_cap is not None and view.log_weights is not None:
            lw_t = take(view.log_weights, target)
            has_target = has_target & (lw_t < self.log_cap)
        s_l, s_t = take(view.scores, losers), take(view.scores, target)
        if self.gate:
            merge = has_target & bernoulli(gate_probability(s_l, s_t), key, view.head_offset, view.heads_total)
            draws = per_row(has_target)
        else:
            merge, draws = has_target, mx.zeros((has_target.shape[0],), mx.int32)
        m_l = mx.where(merge, mass_at(view, losers, self.with_log_weights), 0.0)  # [B, H, E]
        m_t = mass_at(view, target, self.with_log_weights)
        L = view.keys.shape[2]
        one = losers.shape[-1] == 1  # decode: one loser, no other loser shares its target
        absorbed = m_l if one else take(per_target_sum(m_l, target, L), target)  # sum_{l'->t} m_l' per loser
        denom = m_t + absorbed
        coef = mx.where(denom > 0, m_l / mx.where(denom > 0, denom, 1.0), 0.0)

        d_lw = None
        if self.with_log_weights:
            ratio = mx.where(m_t > 0, absorbed / mx.where(m_t > 0, m_t, 1.0), 0.0)
            step = mx.log1p(mx.minimum(ratio, _MAX_RATIO))  # the target's whole log-weight step
            if lw_t is not None:
                step = mx.minimum(step, self.log_cap - lw_t)
            n_merged = 1.0 if one else take(per_target_sum(merge.astype(mx.float32), target, L), target)
            d_lw = mx.where(merge, step / mx.maximum(n_merged, 1.0), 0.0)  # shared by its losers
        return blend_update(view, losers, target, merge, coef, s_l, draws, self.merge_keys, d_lw)
