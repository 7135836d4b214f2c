"""The three part interfaces a method composes, and the view of a cache they receive.

Shapes: ``B`` batch, ``H`` KV heads, ``L`` physical slots this step (retained + new),
``D``/``Dv`` key/value head dims, ``E`` losers this step. Slots are not in temporal
order; ``positions`` gives each slot's absolute position.
"""

from __future__ import annotations

import math
from typing import Dict, NamedTuple, Optional

import mlx.core as mx

#: The ``batch_rows`` contract. A part that sets ``batch_rows = True`` is correct on a
#: view that stacks B independent sequences (a batch's decode step, :mod:`kvpolicy_core.cache.batch_rows`),
#: where ``view.offset`` is an int32 array [B, 1, 1] (each row's tokens seen; it broadcasts against
#: ``positions``), ``new_positions`` is [B, 1, S], a disposition's ``key`` is [B, 2] (row b's own key)
#: and its ``stats`` values are [B] arrays (row b's counts): row b's result must be exactly what the
#: part returns for row b alone. Parts without it are run one row at a time (still exact, slower).
BATCH_ROWS = "batch_rows"


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
    #: [B, H, L] float32 per-slot attention log-weights (added to the slot's attention logit), or
    #: None when the disposition does not use them (``Disposition.uses_log_weights``).
    log_weights: Optional[mx.array] = None
    #: the scorer's own state for the current *run*: a dict the cache keeps across
    #: consecutive prompt chunks (updates of S > 1 tokens) while nothing is evicted between them,
    #: and replaces with an empty one when a run starts (the first chunk, a chunk after an
    #: eviction, every single-token update). None when the cache does not provide one.
    run: Optional[dict] = None
    #: [B, H, L] float32 L2 norm of each slot's key, kept by the cache when the disposition declares
    #: ``uses_key_norms`` (else None: compute them from ``keys`` if needed).
    key_norms: Optional[mx.array] = None


class MergeUpdate(NamedTuple):
    """Additive changes a disposition makes to surviving slots (scatter-added, duplicates sum).

    =========== ================== ======== =========================================
    field       shape              dtype    meaning
    =========== ================== ======== =========================================
    targets     [B, H, T]          int      surviving slot indices (may repeat)
    d_keys      [B, H, T, D]       any      added to ``keys[targets]``, or None
    d_values    [B, H, T, Dv]      any      added to ``values[targets]``, or None
    d_scores    [B, H, T]          any      added to ``scores[targets]``, or None
    stats       {name: scalar}     int      counters to add to the cache's ``stats()``
    d_log_weights [B, H, T]        any      added to ``log_weights[targets]``, or None
    =========== ================== ======== =========================================

    ``d_log_weights`` needs a disposition with ``uses_log_weights = True``: the
    cache then keeps a log-weight ``lw_j`` per slot (0 for every new token) and the model's
    attention uses the logit ``q . k_j * scale + lw_j``, so a slot with ``lw_j = log c`` draws
    the attention of ``c`` copies of itself. Deltas of one target sum (as for every field).

    Deltas are cast to the buffer's dtype (float32 for scores) before the add. A plain
    average of several losers into one target needs the number of losers per target:
    :func:`kvpolicy_core.parts.merge.average_into` builds that update for you.

    ``draws``/``merges`` (0.1.0) are deprecated: return
    ``stats={"gate_draws": ..., "merges": ...}`` instead (the cache maps the old fields
    to those counters, with a :class:`DeprecationWarning`).
    """

    targets: mx.array
    d_keys: Optional[mx.array] = None
    d_values: Optional[mx.array] = None
    d_scores: Optional[mx.array] = None
    draws: Optional[mx.array] = None
    merges: Optional[mx.array] = None
    stats: Optional[Dict[str, mx.array]] = None
    d_log_weights: Optional[mx.array] = None


def pick_lowest(ranked: mx.array, n_evict: int) -> mx.array:
    """Indices [B, H, n_evict] int32 of the ``n_evict`` smallest entries of ``ranked`` [B, H, L].

    Ties go to the lower slot index for ``n_evict == 1`` (argmin); for more, the set is
    deterministic (argpartition) but its order is unspecified.
    """
    if n_evict == 1:
        return mx.argmin(ranked, axis=-1, keepdims=True).astype(mx.int32)
    return mx.argpartition(ranked, n_evict - 1, axis=-1)[..., :n_evict].astype(mx.int32)


class Scorer:
    """How important each retained token is.

    ``on_append`` is called after the new keys are written, ``on_attention`` (only
    when ``needs_attention``) with the model's real queries just before attention.
    Both return the new scores ``[B, H, L]`` float32; new slots enter with score 0.
    """

    needs_attention: bool = False
    #: True when a token's score depends on that token alone, never on later tokens or queries.
    #: Only then can the cache drop its newest tokens exactly (``PolicyCache.trim``):
    #: with scores accumulated from attention, the survivors' scores would keep the trimmed
    #: tokens' attention. Default False (safe for any scorer).
    trim_exact: bool = False
    #: True when correct on a view of B stacked independent rows (see :data:`BATCH_ROWS`)
    batch_rows: bool = False

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
    """Which ``n_evict`` slots lose when the cache is over budget.

    Implement :meth:`rank`: the cache then evicts window-dead slots first and
    the lowest-ranked of the rest. Selectors written for 0.1.0 implement :meth:`select`
    instead; the cache still moves window-dead slots to the front of their choice.
    """

    batch_rows: bool = False  #: see :data:`BATCH_ROWS`

    @classmethod
    def from_config(cls, config) -> "Selector":
        return cls()

    def rank(self, view: CacheView) -> mx.array:
        """float32 [B, H, L]: lower is evicted first; ``+inf`` is never evicted (protected)."""
        raise NotImplementedError

    def select(self, view: CacheView, n_evict: int) -> mx.array:
        """Return loser slot indices [B, H, n_evict] int32, distinct per (batch, head)."""
        ranked = self.rank(view)
        if view.dead is not None:
            ranked = mx.where(view.dead, mx.array(-math.inf, dtype=mx.float32), ranked)
        return pick_lowest(ranked, n_evict)


class Disposition:
    """What happens to the losers before their slots are removed (drop: nothing).

    ``uses_log_weights``: True makes the cache keep per-slot attention
    log-weights (``view.log_weights``, updated through ``MergeUpdate.d_log_weights``) and add
    them to the attention logits through the attention hook. False (default): no buffer,
    no hook, no cost.
    """

    uses_log_weights: bool = False
    #: True makes the cache keep each slot's key norm up to date (``view.key_norms``): for dispositions
    #: that compare keys by cosine every step (CaM), an O(D) update per written slot instead of an
    #: O(L·D) pass per step.
    uses_key_norms: bool = False
    #: True: decode steps (one loser per row) run ``dispose`` as one compiled MLX graph
    #: (:mod:`kvpolicy_core.cache.compiled`); ``view.offset`` is then an int32 scalar array, so use it only
    #: in MLX arithmetic, and no host syncs (``.item()``) inside ``dispose``.
    compile_decode: bool = False
    batch_rows: bool = False  #: see :data:`BATCH_ROWS`

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

    def stats(self) -> Dict[str, str]:
        """Counters this part reports through ``MergeUpdate.stats``: name -> meaning."""
        return {}
