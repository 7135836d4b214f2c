"""The part contract: what a scorer, a selector and a disposition implement, what they declare, what they see.

Shapes: ``B`` batch rows, ``H`` KV heads, ``L`` physical slots this step (retained + new),
``D``/``Dv`` key/value head dims, ``E`` losers this step, ``T`` merge targets. Slots are not in temporal
order; ``positions`` gives each slot's absolute position.

The whole contract, on one page: docs/plugins/minimal.md. A part implements one method of its kind
(:meth:`Scorer.on_append` and/or :meth:`Scorer.on_attention`, :meth:`Selector.rank`,
:meth:`Disposition.dispose`) and declares what it needs from the cache in ONE place, its :class:`Needs`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, NamedTuple, Optional

import mlx.core as mx

from ..errors import PluginError
from .traits import traits_of

#: The ``batch_rows`` contract (``Needs(batch_rows=True)``). Such a part is correct on a view that stacks B
#: independent sequences (a batch's decode step, :mod:`kvpolicy_core.cache.batch_rows`), where
#: ``view.offset`` holds each row's own tokens seen, ``new_positions`` is [B, 1, S], a disposition's ``key``
#: is [B, 2] (row b's own key) and its ``stats`` values are [B] arrays (row b's counts): row b's result must
#: be exactly what the part returns for row b alone. Parts without it are run one row at a time (still exact,
#: slower).
BATCH_ROWS = "batch_rows"


@dataclass(frozen=True)
class Needs:
    """What a part needs from the cache: its one declaration, ``needs = Needs(...)`` on the class (or
    ``self.needs = Needs(...)`` in ``__init__`` when it depends on the config). Every field defaults to
    False, so a part that needs nothing declares nothing.

    ============ ========= =========================================================================
    field        parts     True means
    ============ ========= =========================================================================
    attention    scorer    ``on_attention(view, queries, scale, mask)`` gets the model's real queries
                           before every attention call (kvpolicy's attention hook is installed)
    log_weights  any       the cache keeps a per-slot attention log-weight ``lw_j`` (``view.log_weights``,
                           0 for a new token, changed by ``MergeUpdate.d_log_weights``) and the model's
                           attention uses the logit ``q . k_j * scale + lw_j``
    batch_rows   any       correct on a view of B stacked independent rows (:data:`BATCH_ROWS`): a
                           batch's decode steps run as one vectorised step instead of B
    trim_exact   scorer    a token's score depends on that token alone, never on later tokens or
                           queries: only then can the cache drop its newest tokens exactly
                           (``PolicyCache.trim``, mlx-lm's prompt cache and speculative decoding)
    rope         scorer    the layer's RoPE (``rope_freqs``, ``rope_traditional`` in its config), read from
                           the model's attention module by ``KVCacheBuilder.for_model``
    layer_stats  allocation each layer's statistics of the prompt (:class:`~kvpolicy_core.parts.allocation.
                           LayerStats`): ``budgets(..., stats)`` is called at the end-of-prompt cut
    ============ ========= =========================================================================

    Key norms need no declaration: ``view.key_norms`` is always there (the cache computes them on first
    read and keeps them up to date from then on).
    """

    attention: bool = False
    log_weights: bool = False
    batch_rows: bool = False
    trim_exact: bool = False
    rope: bool = False
    layer_stats: bool = False


#: removed per-class flags -> the :class:`Needs` field that replaces each (a part that still sets one is refused)
OLD_FLAGS = {
    "needs_attention": "attention",
    "uses_log_weights": "log_weights",
    "batch_rows": "batch_rows",
    "trim_exact": "trim_exact",
}
_SCORER_ONLY = ("attention", "trim_exact", "rope")
_ALLOCATION_ONLY = ("layer_stats",)


def needs_of(part) -> Needs:
    """The :class:`Needs` of ``part`` (its ``needs`` declaration; none: ``Needs()``).

    Raises :class:`~kvpolicy_core.errors.PluginError` when ``needs`` is not a :class:`Needs`, or when the part still
    sets a removed class flag (:data:`OLD_FLAGS`, e.g. ``needs_attention = True``), naming its replacement."""
    cls = type(part)
    needs = getattr(part, "needs", Needs())
    if not isinstance(needs, Needs):
        raise PluginError(
            f"{cls.__module__}.{cls.__qualname__}.needs must be a kvpolicy_core.Needs (got "
            f"{type(needs).__name__}); e.g. needs = Needs(attention=True)"
        )
    for flag, field in OLD_FLAGS.items():
        value = getattr(part, flag, None)
        if value is not None and not callable(value) and not isinstance(part, Needs):
            raise PluginError(
                f"{cls.__module__}.{cls.__qualname__} sets {flag!r}, a 0.2 class flag removed in 0.3: declare "
                f"needs = Needs({field}={bool(value)}) instead (docs/plugins/hooks.md)"
            )
    return needs


class PolicyNeeds(NamedTuple):
    """What one policy (scorer, selector, disposition) needs of the cache, resolved once per cache.

    The public declarations (:func:`needs_of`) and the parts' engine traits
    (:func:`kvpolicy_core.parts.traits.traits_of`): nothing else in the engine reads a part's flags."""

    attention: bool  #: the scorer's on_attention gets the model's queries (the attention hook is needed)
    attention_weights: bool  #: ... and it takes the model's attention weights instead (one pass gives both)
    log_weights: bool  #: per-slot attention log-weights are kept
    batch_rows: bool  #: every part is correct on stacked rows
    trim_exact: bool  #: the scorer's scores are per token (the cache can be trimmed)
    key_norms: bool  #: key norms kept from the first token (else from the first read of ``view.key_norms``)
    compile_selector: bool  #: the selector's decode steps run as one compiled graph
    compile_disposition: bool  #: the disposition's decode steps run as one compiled graph


def policy_needs(policy, owners: Optional[Dict[str, str]] = None) -> PolicyNeeds:
    """Resolve the needs of ``policy`` (anything with ``scorer``, ``selector``, ``disposition``).

    Raises :class:`~kvpolicy_core.errors.PluginError` naming the part when a selector or disposition
    declares a scorer's need (``attention``, ``trim_exact``)."""
    parts = {kind: getattr(policy, kind) for kind in ("scorer", "selector", "disposition")}
    needs = {kind: needs_of(part) for kind, part in parts.items()}
    for kind in ("selector", "disposition"):
        for field in _SCORER_ONLY:
            if getattr(needs[kind], field):
                who = (owners or {}).get(kind, type(parts[kind]).__qualname__)
                raise PluginError(f"{who} declares Needs({field}=True), which only a scorer may declare")
    for kind in parts:
        for field in _ALLOCATION_ONLY:
            if getattr(needs[kind], field):
                who = (owners or {}).get(kind, type(parts[kind]).__qualname__)
                raise PluginError(f"{who} declares Needs({field}=True), which only an allocation may declare")
    traits = {kind: traits_of(part) for kind, part in parts.items()}
    scorer = parts["scorer"]
    attention = needs["scorer"].attention
    return PolicyNeeds(
        attention=attention,
        attention_weights=attention and callable(getattr(scorer, "on_attention_weights", None)),
        log_weights=any(n.log_weights for n in needs.values()),
        batch_rows=all(n.batch_rows for n in needs.values()),
        trim_exact=needs["scorer"].trim_exact,
        key_norms=any(t.key_norms for t in traits.values()),
        compile_selector=traits["selector"].compile_decode,
        compile_disposition=traits["disposition"].compile_decode,
    )


def key_norm(keys: mx.array) -> mx.array:
    """keys [B, H, S, D] -> float32 [B, H, S]: ``||k||_2`` of each key."""
    k = keys.astype(mx.float32)
    return mx.sqrt((k * k).sum(axis=-1))


class _ViewFields(NamedTuple):
    keys: mx.array
    values: mx.array
    positions: mx.array
    scores: mx.array
    offset: object
    n_new: int
    dead: Optional[mx.array]
    head_offset: int = 0
    heads_total: Optional[int] = None
    log_weights: Optional[mx.array] = None
    run: Optional[dict] = None
    key_norms: Optional[mx.array] = None


#: (engine use) the view's fields by index, as built (``view[OFFSET]``: an int or an array, not the property's array),
#: and the key under which :func:`on_key_norms` keeps the demand: the cache's decode route reads and sets them itself,
#: so that no code of this module runs on it
OFFSET, KEY_NORMS = _ViewFields._fields.index("offset"), _ViewFields._fields.index("key_norms")
DEMAND_NORMS = "_demand_norms"


def offset_array(offset, rows: int) -> mx.array:
    """``offset`` (an int, or an integer array of one value or one per row) as int32 [rows, 1, 1]."""
    if not isinstance(offset, mx.array):
        return mx.full((rows, 1, 1), offset, dtype=mx.int32)
    x = offset if offset.dtype == mx.int32 else offset.astype(mx.int32)
    if x.shape == (rows, 1, 1):
        return x
    if x.ndim == 1 and x.shape[0] == rows:
        return x.reshape(rows, 1, 1)
    return mx.broadcast_to(x.reshape(()) if x.size == 1 else x, (rows, 1, 1))


class CacheView(_ViewFields):
    """What a part sees of one layer's cache (a named tuple; read-only by convention).

    ============= ================ ========= =====================================================
    field         shape            dtype     meaning
    ============= ================ ========= =====================================================
    keys          [B, H, L, D]     model's   the slots' keys, RoPE-rotated as the model stored them
    values        [B, H, L, Dv]    model's   the slots' values
    positions     [B, H, L]        int32     each slot's absolute position (slots are not in order)
    scores        [B, H, L]        float32   the scorer's running scores
    offset        [B, 1, 1]        int32     tokens seen by row b (the next token's absolute position);
                                             broadcasts against ``positions``
    n_new         int                        tokens added by this call (0 when settling an eviction)
    dead          [B, H, L] / None bool      outside the sliding window of every future query
    head_offset   int                        global index of head 0 (> 0 on later tensor-parallel ranks)
    heads_total   int / None                 the layer's KV heads over all ranks (None: H, unsharded)
    log_weights   [B, H, L] / None float32   per-slot attention log-weights (``Needs(log_weights=True)``)
    run           dict / None                the scorer's state across one run of prompt chunks
    key_norms     [B, H, L]        float32   ``||k_j||_2`` of each slot's key, always available
    ============= ================ ========= =====================================================

    ``offset`` is the same int32 array on every path (a single cache, a compiled decode step, a batch's
    stacked rows): use it in MLX arithmetic (``view.positions >= view.offset - r``). A view may be built
    with a Python int (or a scalar array) there; reading the field gives the [B, 1, 1] array. ``run``: a
    dict the cache keeps across consecutive prompt chunks (updates of S > 1 tokens) while nothing is evicted
    between them, and replaces with an empty one when a run starts (the first chunk, a chunk after an
    eviction, every single-token update). ``key_norms``: kept by the cache (O(D) per written slot) once any
    part has read them; a view built by hand computes them from ``keys`` on first read.
    """

    @property
    def offset(self) -> mx.array:
        got = self.__dict__.get("_offset")
        if got is None:
            got = self.__dict__["_offset"] = offset_array(tuple.__getitem__(self, OFFSET), self.keys.shape[0])
        return got

    @property
    def key_norms(self) -> mx.array:
        got = tuple.__getitem__(self, KEY_NORMS)
        if got is None:
            got = self.__dict__.get("_norms")
        if got is None:
            demand = self.__dict__.get(DEMAND_NORMS)
            got = None if demand is None else demand(self.keys)
            got = self.__dict__["_norms"] = key_norm(self.keys) if got is None else got
        return got


def kept_key_norms(view: CacheView) -> Optional[mx.array]:
    """The key norms ``view`` was built with (None: not kept yet), without computing any (engine use)."""
    return tuple.__getitem__(view, KEY_NORMS)


def on_key_norms(view: CacheView, demand) -> CacheView:
    """Make the first read of ``view.key_norms`` (when built without them) call ``demand(keys)``, which
    returns the norms [B, H, L] or None (then they are computed from the keys) (engine use)."""
    view.__dict__[DEMAND_NORMS] = demand
    return view


def on_key_rows(view: CacheView, key_rows) -> CacheView:
    """Give ``view`` a decoder of its keys by slots, ``key_rows(lo, hi)`` -> [B, H, hi - lo, D] (engine use: rows
    stored quantized, whose keys a part's long pass may decode a block at a time instead of whole)."""
    view.__dict__["_key_rows"] = key_rows
    return view


def key_rows_of(view: CacheView):
    """The decoder :func:`on_key_rows` gave ``view``, or None (then ``view.keys`` are the keys to read)."""
    return view.__dict__.get("_key_rows")


def offset_read(view: CacheView) -> bool:
    """Whether a part has read ``view.offset`` (as the array) (engine use: it names the offset in a part's error)."""
    return "_offset" in view.__dict__


class _MergeUpdateFields(NamedTuple):
    """The fields of :class:`MergeUpdate`, in their order."""

    targets: mx.array
    d_keys: Optional[mx.array] = None
    d_values: Optional[mx.array] = None
    d_scores: Optional[mx.array] = None
    stats: Optional[Dict[str, mx.array]] = None
    d_log_weights: Optional[mx.array] = None


#: the removed form of a MergeUpdate (counters as ``draws``/``merges``), refused naming its replacement
_REMOVED_FORM = (
    "MergeUpdate(targets, d_keys, d_values, d_scores, draws, merges) is the 0.1 form: draws/merges were removed in "
    "0.3; the fields are now MergeUpdate(targets, d_keys, d_values, d_scores, stats, d_log_weights): return the "
    "counters as stats={'gate_draws': ..., 'merges': ...}"
)


class RemovedForm(TypeError):
    """A part built a value in a form removed from the contract (the message names the replacement)."""


class MergeUpdate(_MergeUpdateFields):
    """Additive changes a disposition makes to surviving slots (scatter-added, duplicates sum).

    ============= ================== ======== =========================================
    field         shape              dtype    meaning
    ============= ================== ======== =========================================
    targets       [B, H, T]          int      surviving slot indices (may repeat)
    d_keys        [B, H, T, D]       real     added to ``keys[targets]``, or None
    d_values      [B, H, T, Dv]      real     added to ``values[targets]``, or None
    d_scores      [B, H, T]          real     added to ``scores[targets]``, or None
    stats         {name: count}      int      counters added to the cache's ``stats()``
    d_log_weights [B, H, T]          real     added to ``log_weights[targets]``, or None
    ============= ================== ======== =========================================

    ``d_log_weights`` needs ``Needs(log_weights=True)``: the cache then keeps a log-weight ``lw_j`` per
    slot (0 for every new token) and the model's attention uses the logit ``q . k_j * scale + lw_j``, so a
    slot with ``lw_j = log c`` draws the attention of ``c`` copies of itself. Deltas of one target sum (as
    for every field).

    Deltas are added in float32 (return them in float32: a blend's delta ``x_l - x_t`` of two float16 values can
    exceed float16's range while the blend does not), and each sum is stored in the buffer's dtype, saturating at
    its largest finite value (``+-65504`` in float16): a merge never writes a non-finite value into a finite
    element (a NaN or inf delta for a finite element is refused, or not added past the checked evictions). A plain
    average of several losers into one target needs the number of losers per target:
    :func:`kvpolicy_core.parts.merge.average_into` builds that update for you.

    Counters go in ``stats`` (``{"gate_draws": ..., "merges": ...}``; ``draws=``/``merges=`` are refused with
    :class:`RemovedForm`, naming ``stats``).
    """

    __slots__ = ()

    def __new__(
        cls, targets, d_keys=None, d_values=None, d_scores=None, stats=None, d_log_weights=None, **removed
    ) -> "MergeUpdate":
        if "draws" in removed or "merges" in removed or isinstance(stats, (mx.array, int, float)):
            raise RemovedForm(_REMOVED_FORM)  # draws=/merges=, or positional counters read as stats
        if removed:
            raise TypeError(f"MergeUpdate got unexpected keyword arguments {sorted(removed)}")
        return super().__new__(cls, targets, d_keys, d_values, d_scores, stats, d_log_weights)


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

    ``on_append`` is called after the new keys are written, ``on_attention`` (only with
    ``Needs(attention=True)``) with the model's real queries just before attention.
    Both return the new scores ``[B, H, L]`` float32; new slots enter with score 0.
    """

    needs: Needs = Needs()

    @classmethod
    def from_config(cls, config) -> "Scorer":
        return cls()

    def on_append(self, view: CacheView, new_keys: mx.array, new_positions: mx.array) -> mx.array:
        """``new_keys`` [B, H, S, D]; ``new_positions`` [S] int32 ([B, 1, S] on stacked rows). Returns [B, H, L]."""
        return view.scores

    def on_attention(self, view: CacheView, queries: mx.array, scale: float, mask) -> mx.array:
        """``queries`` [B, Hq, S, D] (Hq a multiple of H); ``mask`` as mlx-lm passes it."""
        return view.scores


class Selector:
    """Which slots lose when the cache is over budget: implement :meth:`rank`.

    The engine then evicts window-dead slots first and the lowest-ranked of the rest; sinks (positions
    ``< n_sink``) are never chosen unless window-dead. Ranks are checked (an mx.array of the scores' shape,
    NaN ranked as protected), so a selector cannot pick a slot outside the cache.
    """

    needs: Needs = Needs()

    @classmethod
    def from_config(cls, config) -> "Selector":
        return cls()

    def rank(self, view: CacheView) -> mx.array:
        """float32 [B, H, L]: lower is evicted first; ``+inf`` is never evicted (protected)."""
        raise NotImplementedError

    def evict_count(self, over: int, n: int) -> int:
        """How many of the ``n`` slots leave when ``over = n - budget > 0`` of them must: ``over`` (the default),
        or more, e.g. whole chunks (ChunkKV); the budget is an upper bound. An int in ``[over, n - 1]``,
        computed on the host from these two ints alone (no array is read); the cache evicts at most
        ``n - n_sink`` of them (a larger count is clamped there: sinks never leave)."""
        return over


class Disposition:
    """What happens to the losers before their slots are removed (drop: nothing)."""

    needs: Needs = Needs()

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
