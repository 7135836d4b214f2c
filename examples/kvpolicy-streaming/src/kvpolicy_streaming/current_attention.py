"""TOVA's scorer: the attention of the current (last) query only, no accumulation."""

import math

import mlx.core as mx

from kvpolicy_core import CacheView, Scorer, masked_softmax, observed_weights


def last_row(mask):
    """The mask of the last query row (None or "causal" -> None: the last row sees everything)."""
    if mask is None or isinstance(mask, str):
        return None
    return mask[..., -1:, :]


class CurrentAttentionScorer(Scorer):
    """Scores replaced every step by the newest query's attention.

    ``observed``: ``s_{h,j} = mean_{g in group(h)} softmax_j(q_{g,last} . k_j * scale + mask_j)``.
    ``proxy``: ``s_j = softmax_j(k_last . k_j / sqrt(D))`` over tokens before the newest; it gets 0.
    """

    def __init__(self, signal: str = "observed") -> None:
        self.signal = signal
        self.needs_attention = signal == "observed"

    @classmethod
    def from_config(cls, config) -> "CurrentAttentionScorer":
        return cls(signal=config.signal)

    def on_append(self, view: CacheView, new_keys: mx.array, new_positions: mx.array) -> mx.array:
        if self.signal != "proxy":
            return view.scores
        q = new_keys[:, :, -1:, :].astype(mx.float32)
        logits = (q @ view.keys.astype(mx.float32).swapaxes(-1, -2)) / math.sqrt(q.shape[-1])
        allowed = (view.positions < new_positions[-1])[:, :, None, :]
        return masked_softmax(logits, allowed)[:, :, 0, :]

    def on_attention(self, view: CacheView, queries: mx.array, scale: float, mask) -> mx.array:
        if self.signal != "observed":
            return view.scores
        weights = observed_weights(queries[:, :, -1:, :], view.keys, scale, last_row(mask))
        return weights.mean(axis=2)[:, :, 0, :]
