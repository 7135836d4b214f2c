"""KeyDiff scorer (arXiv 2504.15364; kvpress ``KeyDiffPress``): keep the keys least like the average key.

Query-agnostic: it reads only the cached keys, so it needs no attention hook and no question. Per
batch row b and KV head h, over the L slots the cache holds after an update (retained + new)::

    khat_j = k_j / max(||k_j||, 1e-12)                        k [B, H, L, D] as stored (RoPE-rotated)
    a      = (1/L) sum_j khat_j                                the anchor, [B, H, D]
    s_j    = -cos(k_j, a) = -(k_j . a) / (max(||k_j||, 1e-8) * max(||a||, 1e-8))     s [B, H, L]

so the slot whose key points most along the average direction scores lowest and is evicted first
(kvpress's ``F.normalize``/``F.cosine_similarity`` epsilons). The anchor and every score are recomputed over the
current slots at each prompt chunk and at every ``rescore_every``-th decode step (:mod:`.rescore`; three passes
over the keys, O(L·D) per head), so they follow the cache as it changes (the KeyDiff paper's block-wise
iterative compression, one update at a time). With ``pool = P > 1`` each rescoring is max-pooled over the ``P``
nearest retained positions (:func:`~.pooling.pool_by_position`), so a span is kept or lost as a whole.

*Non-finite keys.* A key holding a NaN or an Inf (a broken model or file) is left out of the anchor and scores
:data:`NONFINITE_SCORE` (-2, below every cosine), pooled or not: it is evicted first (sinks and the recent window
stay protected), deterministically, and the other slots keep their scores. Without this, the one key's NaN would
spread through the anchor to every score of its head, which the cache reads as 0: the head would evict blindly. Between
rescorings (``rescore_every``) a new decode token enters with its row's highest score, NaN key or not, until the
next rescoring.
"""

from __future__ import annotations

import mlx.core as mx

from .base import CacheView, Needs, Scorer
from .pooling import pool_by_position
from .rescore import at_decode

#: kvpress's epsilons: ``F.normalize`` (each key) and ``F.cosine_similarity`` (each norm)
NORMALIZE_EPS, COSINE_EPS = 1e-12, 1e-8
#: The score of a key holding a NaN or an Inf: below every cosine, so it is evicted first (see the module)
NONFINITE_SCORE = -2.0


def _keydiff(keys: mx.array, key_norms: mx.array = None):
    """(s [B, H, L] float32 as in the module's equation over the finite keys, finite [B, H, L] bool)."""
    k = keys.astype(mx.float32)
    norms = mx.sqrt((k * k).sum(axis=-1)) if key_norms is None else key_norms  # [B, H, L]
    finite = mx.isfinite(norms)  # a NaN or Inf anywhere in a key makes its norm non-finite
    k = mx.where(finite[..., None], k, 0.0)  # out of the anchor: one NaN key would make every score NaN
    norms = mx.where(finite, norms, 0.0)
    L = k.shape[2]
    inv = 1.0 / mx.maximum(norms, NORMALIZE_EPS)
    anchor = (inv[:, :, None, :] @ k) * (1.0 / L)  # [B, H, 1, D] = mean_j k_j / ||k_j|| (one pass, no unit keys)
    dots = (k @ anchor.swapaxes(-1, -2))[..., 0]  # [B, H, L]
    a_norm = mx.sqrt((anchor * anchor).sum(axis=-1))  # [B, H, 1]
    return -dots / (mx.maximum(norms, COSINE_EPS) * mx.maximum(a_norm, COSINE_EPS)), finite


def keydiff_scores(keys: mx.array, key_norms: mx.array = None) -> mx.array:
    """keys [B, H, L, D] -> s [B, H, L] float32 = -cos(k_j, mean_j khat_j) (the module's equation); a non-finite
    key scores :data:`NONFINITE_SCORE` and is left out of the anchor.

    ``key_norms`` [B, H, L] float32 (the cache's ``||k_j||`` when it keeps them) saves one pass over the keys."""
    s, finite = _keydiff(keys, key_norms)
    return mx.where(finite, s, NONFINITE_SCORE)


def _pooled_keydiff(keys: mx.array, key_norms: mx.array, positions: mx.array, pool: int) -> mx.array:
    """:func:`keydiff_scores` max-pooled over ``pool`` positions; a non-finite key stays at
    :data:`NONFINITE_SCORE` (its neighbours' scores do not lift it) and lifts no neighbour."""
    s, finite = _keydiff(keys, key_norms)
    low = mx.array(NONFINITE_SCORE, dtype=mx.float32)
    return mx.where(finite, pool_by_position(mx.where(finite, s, low), positions, pool), low)


#: a decode step's scores as one compiled graph (prompt chunks, whose L changes each time, run eagerly)
_keydiff_compiled = mx.compile(_pooled_keydiff)


class KeyDiffScorer(Scorer):
    """``s_j = -cos(k_j, anchor)`` over the current slots, recomputed at every update (see the module).

    Shapes: cached keys [B, H, L, D] -> scores [B, H, L] float32. A token's score depends on every other
    retained key (the anchor), so trimming the newest tokens is not exact (``trim_exact`` False).
    """

    needs = Needs(batch_rows=True)  # reads keys only: row b's scores are row b's alone

    def __init__(self, rescore_every: int = 8, pool: int = 1) -> None:
        if pool < 1 or pool % 2 == 0:
            raise ValueError(f"pool must be an odd integer >= 1 (got {pool})")
        self.rescore_every, self.pool = int(rescore_every), int(pool)

    @classmethod
    def from_config(cls, config) -> "KeyDiffScorer":
        return cls(rescore_every=getattr(config, "rescore_interval", 8), pool=getattr(config, "pool_width", 1))

    def on_append(self, view: CacheView, new_keys: mx.array, new_positions: mx.array) -> mx.array:
        if new_keys.shape[2] > 1:
            return _pooled_keydiff(view.keys, view.key_norms, view.positions, self.pool)
        fresh = lambda: _keydiff_compiled(view.keys, view.key_norms, view.positions, self.pool)  # noqa: E731
        return at_decode(fresh, view.scores, view.positions, view.offset, self.rescore_every)
