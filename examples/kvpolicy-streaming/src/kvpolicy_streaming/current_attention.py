"""TOVA's scorer: the attention of the current (last) query only, no accumulation."""

import mlx.core as mx

from kvpolicy_core.parts.attention_scorer import AttentionScorer


class CurrentAttentionScorer(AttentionScorer):
    """Scores replaced every step by the newest query's attention.

    ``observed``: ``s_{h,j} = mean_{g in group(h)} softmax_j(q_{g,last} . k_j * scale + mask_j)``.
    ``proxy``: ``s_j = softmax_j(k_last . k_j / sqrt(D))`` over tokens before the newest; it gets 0.
    """

    last_query_only = True
    default_signal = "observed"

    def combine(self, scores: mx.array, weights: mx.array) -> mx.array:
        return weights.mean(axis=2)[:, :, 0, :]
