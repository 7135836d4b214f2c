"""The three part interfaces a method composes, and the view of a cache they receive.

Shapes: ``B`` batch, ``H`` KV heads, ``L`` physical slots this step (retained + new),
``D``/``Dv`` key/value head dims, ``E`` losers this step. Slots are not in temporal
order; ``positions`` gives each slot's absolute position.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import mlx.core as mx


class CacheView(NamedTuple):
    """What a part sees of one layer's cache. Read-only by convention."""

    keys: mx.array  #: [B, H, L, D], RoPE-rotated as the model stored them
    values: mx.array  #: [B, H, L, Dv]
    positions: mx.array  #: [B, H, L] int32 absolute positions
    scores: mx.array  #: [B, H, L] float32, the scorer's running scores
    offset: int  #: tokens seen so far (the next token's absolute position)
    n_new: int  #: tokens added by the current call (0 when settling between calls)
    dead: Optional[mx.array]  #: [B, H, L] bool: outside a sliding window for every future query, or None
    #: global index of head 0 of this view (> 0 on tensor-parallel ranks after the first)
    head_offset: int = 0
    #: the layer's KV heads over all tensor-parallel ranks (None: this view's H, unsharded)
    heads_total: Optional[int] = None


class MergeUpdate(NamedTuple):
    """Additive changes a disposition makes to surviving slots (scatter-added, duplicates sum).

    ``targets`` [B, H, T] slot indices; ``d_keys`` [B, H, T, D] or None; ``d_values``
    [B, H, T, Dv]; ``d_scores`` [B, H, T] or None; ``draws``/``merges``: scalar int
    counts of gate draws and merges performed, for the cache's diagnostics.
    """

    targets: mx.array
    d_keys: Optional[mx.array]
    d_values: mx.array
    d_scores: Optional[mx.array]
    draws: mx.array
    merges: mx.array


class Scorer:
    """How important each retained token is.

    ``on_append`` is called after the new keys are written, ``on_attention`` (only
    when ``needs_attention``) with the model's real queries just before attention.
    Both return the new scores ``[B, H, L]`` float32; new slots enter with score 0.
    """

    needs_attention: bool = False

    @classmethod
    def from_config(cls, config) -> "Scorer":
        return cls()

    def on_append(self, view: CacheView, new_keys: mx.array, new_positions: mx.array) -> mx.array:
        """``new_keys`` [B, H, S, D]; ``new_positions`` [S] int32. Returns scores [B, H, L]."""
        return view.scores

    def on_attention(self, view: CacheView, queries: mx.array, scale: float, mask) -> mx.array:
        """``queries`` [B, Hq, S, D] (Hq a multiple of H); ``mask`` as mlx-lm passes it."""
        return view.scores


class Selector:
    """Which ``n_evict`` slots lose when the cache is over budget."""

    @classmethod
    def from_config(cls, config) -> "Selector":
        return cls()

    def select(self, view: CacheView, n_evict: int) -> mx.array:
        """Return loser slot indices [B, H, n_evict] int32, distinct per (batch, head)."""
        raise NotImplementedError


class Disposition:
    """What happens to the losers before their slots are removed (drop: nothing)."""

    @classmethod
    def from_config(cls, config) -> "Disposition":
        return cls()

    def dispose(self, view: CacheView, losers: mx.array, key: mx.array) -> Optional[MergeUpdate]:
        """``losers`` [B, H, E] int32; ``key`` a PRNG key for this (seed, layer, step).

        Random draws must be a function of (key, global head) so that they do not depend on
        how heads are split across tensor-parallel ranks: draw over ``view.heads_total`` heads
        and keep heads ``view.head_offset ..`` (see ``kvpolicy_cam.gated_merge.bernoulli``).

        Return a :class:`MergeUpdate` for the survivors, or None to leave them untouched.
        """
        return None
