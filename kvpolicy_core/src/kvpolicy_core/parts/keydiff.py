"""KeyDiff scorer (arXiv 2504.15364; kvpress ``KeyDiffPress``): keep the keys least like the average key.

Query-agnostic: it reads only the cached keys, so it needs no attention hook and no question. Per
batch row b and KV head h, over the L slots the cache holds after an update (retained + new)::

    khat_j = k_j / max(||k_j||, 1e-12)                        k [B, H, L, D] as stored (RoPE-rotated)
    a      = (1/L) sum_j khat_j                                the anchor, [B, H, D]
    s_j    = -cos(k_j, a) = -(k_j . a) / (max(||k_j||, 1e-8) * max(||a||, 1e-8))     s [B, H, L]

so the slot whose key points most along the average direction scores lowest and is evicted first
(kvpress's ``F.normalize``/``F.cosine_similarity`` epsilons). The anchor is recomputed over the current slots at
every update (prompt chunk or decode step: O(L·D) per head, fewer operations than one step of attention), so it
follows the cache as it changes (the KeyDiff paper's block-wise iterative compression, one update at a time).
"""

from __future__ import annotations

import mlx.core as mx

from .base import CacheView, Scorer
from .shipped import shipped

#: kvpress's epsilons: ``F.normalize`` (each key) and ``F.cosine_similarity`` (each norm)
NORMALIZE_EPS, COSINE_EPS = 1e-12, 1e-8


def keydiff_scores(keys: mx.array, key_norms: mx.array = None) -> mx.array:
    """keys [B, H, L, D] -> s [B, H, L] float32 = -cos(k_j, mean_j khat_j) (the module's equation).

    ``key_norms`` [B, H, L] float32 (the cache's ``||k_j||`` when it keeps them) saves one pass over the keys."""
    k = keys.astype(mx.float32)
    norms = mx.sqrt((k * k).sum(axis=-1)) if key_norms is None else key_norms
    unit = k / mx.maximum(norms, NORMALIZE_EPS)[..., None]
    anchor = unit.mean(axis=2)  # [B, H, D]
    dots = (k @ anchor[..., None])[..., 0]  # [B, H, L]
    a_norm = mx.sqrt((anchor * anchor).sum(axis=-1, keepdims=True))  # [B, H, 1]
    return -dots / (mx.maximum(norms, COSINE_EPS) * mx.maximum(a_norm, COSINE_EPS))


@shipped
class KeyDiffScorer(Scorer):
    """``s_j = -cos(k_j, anchor)`` over the current slots, recomputed at every update (see the module).

    Shapes: cached keys [B, H, L, D] -> scores [B, H, L] float32. A token's score depends on every other
    retained key (the anchor), so trimming the newest tokens is not exact (``trim_exact`` False).
    """

    # shipped (kvpolicy_core.parts.shipped): every decode score is a cosine in [-1, 1] of finite keys (the cache
    # turns a NaN from a non-finite key into 0), float32 and shaped as the view's: no value check needed
    batch_rows = True  # reads keys only: row b's scores are row b's alone

    def on_append(self, view: CacheView, new_keys: mx.array, new_positions: mx.array) -> mx.array:
        return keydiff_scores(view.keys, view.key_norms)
