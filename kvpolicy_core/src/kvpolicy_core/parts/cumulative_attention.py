"""Cumulative attention mass scorer (H2O's heavy-hitter score), shared by H2O and CaM."""

from __future__ import annotations

import mlx.core as mx

from .attention_scorer import AttentionScorer, causal_allowed, masked_softmax, observed_weights

__all__ = ["CumulativeAttentionScorer", "causal_allowed", "masked_softmax", "observed_weights"]


class CumulativeAttentionScorer(AttentionScorer):
    """Cumulative attention mass per retained token, per layer, batch row and KV head.

    ``signal="proxy"`` (the specification's H2O-adapted): every incoming key k_t is
    used as a query over the keys retained before it (positions < pos_t, including
    earlier tokens of the same chunk)::

        s_j += softmax_j( k_j . k_t / sqrt(D) )      for every j with pos_j < pos_t

    and the new token enters with s_t = 0 (it receives mass only from later tokens).

    ``signal="observed"`` (the H2O paper): the real attention weights of the step,
    summed over the step's query rows i and the G query heads sharing KV head h::

        s_{h,j} += sum_{g in group(h)} sum_i softmax_j( q_{g,i} . k_j * scale + mask_ij )

    The new tokens enter with 0 and receive their own step's mass (self included).
    """

    def combine(self, scores: mx.array, weights: mx.array) -> mx.array:
        return scores + weights.sum(axis=(2, 3))
