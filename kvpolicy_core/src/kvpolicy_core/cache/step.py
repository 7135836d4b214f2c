"""The policy step of one layer: the one route of every eviction (score, choose, dispose), checked at the part
boundary.

Every path that evicts (a decode step, a prompt chunk over budget, the end-of-prompt cut, a batch's stacked rows,
compress-once's cut) calls :meth:`PolicyStep.evict`, or for a decode step's one loser per row its
:attr:`~PolicyStep.decode` (the same eviction, by the route the step picked when its state last changed): the selector
*ranks* and the engine chooses (window-dead slots first, sinks never, the lowest ranks of the rest: valid slot indices
by construction), then the disposition's update is checked. The parts are plain objects shared by every layer
(:class:`~kvpolicy_core.config.policy.Policy`); everything per layer (the layer index in error messages, the PRNG key
of each eviction) is added here. A part that raises, or returns the wrong shape or type, becomes a
:class:`~kvpolicy_core.errors.PluginError` naming the part and its plugin.

Checks, the same for every part (no part is trusted): output metadata (types, shapes, dtypes) at every call, on
the host without a sync; output values (the scores and the losers chosen from the selector's ranks, each evaluated
on its own so that a graph that fails only when MLX evaluates it names its part, then a merge's targets in range
and finite deltas for finite rows) evaluated for a prompt chunk's eviction and for the first
:data:`CHECKED_DECODE_EVICTIONS` decode evictions of each cache, so a broken part is reported early and by name;
after those, decode steps make no host sync and the slot store's device-side guards
(:meth:`~.slots.SlotStore.add`) keep any update from writing outside the cache or a non-finite value into a
finite slot.

*Compiled decode calls.* A decode eviction (one loser per row) of a part with the ``compile_decode`` trait runs as
one ``mx.compile`` call: the selector's ranks with the choice made from them, and the disposition's update. Their
shapes stay fixed once the budget is reached, so a graph is traced once per (shape, layout) and shared by every
layer's cache (:data:`_traces`, keyed weakly by the part: the traces go with the policy). The offset enters as the
int32 array [B, 1, 1] every view gives; a part must not sync with the host inside. A traced output of the wrong
type or shape makes the eager call run, which reports it.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field
from typing import Callable, Dict, List, NamedTuple, Optional, Tuple, Union

import mlx.core as mx
import numpy as np

from ..config.policy import Policy, step_key, step_keys
from ..errors import MLX_ERRORS, KVPolicyError, ModelError, PluginError, blamed
from ..parts.base import (
    KEY_NORMS,
    OFFSET,
    CacheView,
    Disposition,
    MergeUpdate,
    PolicyNeeds,
    RemovedForm,
    Scorer,
    Selector,
    offset_read,
    on_key_norms,
    pick_lowest,
    policy_needs,
)
from .checks import NONFINITE, TARGET_OUT_OF_RANGE, checked_update, nonfinite_flags

_RANK_CAP = 3.0e38  # ranks are clipped to +-this: protected (+inf, NaN) ranks take float32's max, dead slots -inf
_FLOAT32_MAX = float(np.finfo(np.float32).max)


def choose(ranked: mx.array, positions: mx.array, n_sink, dead: Optional[mx.array], n_evict: int) -> mx.array:
    """Losers [B, H, E] int32 from a selector's ranks [B, H, L]: the E lowest of ::

        r_j = -inf if dead_j  else  +inf if pos_j < n_sink  else  max32 if rank_j in {+inf, NaN}
              else clip(rank_j, -3e38, 3e38)

    four strict tiers: window-dead slots go first, then the selector's finite ranks (lowest first), then the
    slots it protects, and a sink never unless window-dead. Distinct indices in ``[0, L)`` by construction
    (:func:`pick_lowest`), whatever the ranks are."""
    protected = mx.isnan(ranked) | mx.isposinf(ranked)
    r = mx.where(protected, mx.array(_FLOAT32_MAX, dtype=mx.float32), mx.clip(ranked, -_RANK_CAP, _RANK_CAP))
    r = mx.where(positions < n_sink, mx.array(math.inf, dtype=mx.float32), r)
    if dead is not None:
        r = mx.where(dead, mx.array(-math.inf, dtype=mx.float32), r)
    return pick_lowest(r, n_evict)


#: the compiled decode calls of each part, shared by every layer's cache, in a map keyed weakly by the part: once no
#: cache uses a policy, its parts and their traces are freed (a server building caches per request)
_traces: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_FIELDS = ("targets", "d_keys", "d_values", "d_scores", "d_log_weights")
_OPTIONAL_VIEW = ("dead", "log_weights", "key_norms")


def _traced(part, kind: str, make: Callable):
    """The compiled call ``kind`` of ``part``, ``make(ref)`` on first use (``ref()`` gives the part: weakly, so that
    the call in the map does not keep its key alive); a new one per use for a part that cannot be a weak key."""
    try:
        per = _traces.get(part)
        if per is None:
            per = _traces[part] = {}
    except TypeError:
        return make(lambda: part)
    if kind not in per:
        per[kind] = make(weakref.ref(part))
    return per[kind]


def _view(arrays, layout, read: list) -> CacheView:
    """The traced view; ``read`` gets True appended when the part reads key norms the view lacks."""
    keys, values, positions, scores, offset, *optional = arrays
    head_offset, heads_total, n_new, present = layout
    extra = dict(zip([f for f, p in zip(_OPTIONAL_VIEW, present) if p], optional))
    view = CacheView(
        keys, values, positions, scores, offset, n_new, extra.get("dead"), head_offset, heads_total,
        extra.get("log_weights"), key_norms=extra.get("key_norms"),
    )  # fmt: skip
    if "key_norms" not in extra:  # computed in the graph; the cache keeps them from then on
        on_key_norms(view, lambda keys: read.append(True))
    return view


def _run_traced(fns: dict, build: Callable, view: CacheView, *inputs):
    """Run the trace of ``view``'s layout (``build(layout, read)`` on first use) on ``inputs`` and the view's arrays:
    (its outputs, the layout). A traced part that read key norms the view lacks makes the eager view's first read
    (the cache keeps them). The layout (the view's static fields, which optional arrays it has) keys the trace."""
    optional = [view[KEY_NORMS] if f == "key_norms" else getattr(view, f) for f in _OPTIONAL_VIEW]  # norms as kept
    offset = view[OFFSET]  # a cache's int: CacheView.offset's array, made here (no parts code on decode's route)
    offset = mx.full((view.keys.shape[0], 1, 1), offset, dtype=mx.int32) if isinstance(offset, int) else view.offset
    arrays = [view.keys, view.values, view.positions, view.scores, offset] + [x for x in optional if x is not None]
    layout = (view.head_offset, view.heads_total, view.n_new, tuple(x is not None for x in optional))
    if layout not in fns:
        read: list = []
        fns[layout] = (mx.compile(build(layout, read)), read)
    fn, read = fns[layout]
    out = fn(*inputs, *arrays)
    if read and view[KEY_NORMS] is None:
        view.key_norms  # noqa: B018
    return out, layout


def _blame(what: str, exc: BaseException, passes: tuple = ()) -> None:
    """Raise what ``with blamed(what, passes)`` around the code that raised ``exc`` raises: a call's failure is named
    only when it fails, so that a call that succeeds runs no code of ``errors.py`` (decode's route)."""
    with blamed(what, passes):
        raise exc


def compiled_choose(selector) -> Callable:
    """``f(view, n_sink) -> losers [B, H, 1] int32``: the compiled decode choice of ``selector``."""

    def make(ref):
        fns: dict = {}

        def build(layout, read):
            def fn(n_sink, *arrays):
                v = _view(arrays, layout, read)
                ranked = ref().rank(v)
                if not isinstance(ranked, mx.array) or ranked.shape != v.scores.shape:
                    raise TypeError("ranks of the wrong type or shape")  # the eager call reports what they are
                if not (mx.issubdtype(ranked.dtype, mx.floating) or mx.issubdtype(ranked.dtype, mx.integer)):
                    raise TypeError("ranks of a non-real dtype")
                return choose(ranked.astype(mx.float32), v.positions, n_sink, v.dead, 1)

            return fn

        return lambda view, n_sink: _run_traced(fns, build, view, mx.array(n_sink, dtype=mx.int32))[0]

    return _traced(selector, "choose", make)


class _Traced(NamedTuple):
    """What a traced ``dispose`` returned, to read the compiled call's flat outputs back into a MergeUpdate."""

    fields: List[str]  #: the MergeUpdate fields set, in output order
    stat_names: List[str]  #: counters returned as arrays, in output order (after the fields)
    constants: dict  #: counters returned as Python values
    no_stats: bool  #: ``stats`` was None


def compiled(disposition) -> Callable:
    """``f(view, losers, key) -> MergeUpdate`` (None: the part returned something else; the eager call then reports
    it): the compiled ``dispose`` of ``disposition``."""

    def make(ref):
        fns: dict = {}
        specs: dict = {}  # layout -> [_Traced or None], filled while tracing

        def build(layout, read):
            spec = specs[layout] = [None]

            def fn(losers, key, *arrays):
                u = ref().dispose(_view(arrays, layout, read), losers, key)
                if not isinstance(u, MergeUpdate) or (u.stats is not None and not isinstance(u.stats, dict)):
                    spec[0] = None
                    return [mx.array(0)]
                fields = [f for f in _FIELDS if getattr(u, f) is not None]
                stats = [
                    (k, v.astype(mx.int32).reshape(()) if v.size == 1 and v.dtype != mx.complex64 else v)
                    for k, v in (u.stats or {}).items()
                    if isinstance(v, mx.array)
                ]  # counters as int32 scalars
                constants = {k: v for k, v in (u.stats or {}).items() if not isinstance(v, mx.array)}
                spec[0] = _Traced(fields, [k for k, _ in stats], constants, u.stats is None)
                return [getattr(u, f) for f in fields] + [v for _, v in stats]

            return fn

        def call(view, losers, key):
            out, layout = _run_traced(fns, build, view, losers, key)
            traced = specs[layout][0]
            if traced is None:
                return None
            fields, names = traced.fields, traced.stat_names
            n = len(fields) + len(names)
            stats = None if traced.no_stats else {**traced.constants, **dict(zip(names, out[len(fields) : n]))}
            return MergeUpdate(**dict(zip(fields, out[: len(fields)])), stats=stats)

        return call

    return _traced(disposition, "dispose", make)


Counters = Dict[str, mx.array]
_INT32_MAX = 2**31 - 1


def wrong_output(owner: str, what: str, x, expected: Tuple[int, ...]) -> PluginError:
    """The error for a part output ``x`` that is not an mx.array of shape ``expected``: a numpy array or a
    list of the right shape is named as such (its shape alone would read like the expected one)."""
    if not isinstance(x, mx.array):
        kind = type(x).__name__ if type(x).__module__ == "builtins" else f"{type(x).__module__}.{type(x).__name__}"
        return PluginError(
            f"{owner} returned {what} as a {kind}, not an mx.array: it must return an mx.array of "
            f"shape {tuple(expected)} (convert with mx.array(...))"
        )
    return PluginError(f"{owner} returned {what} of shape {tuple(x.shape)}, expected {tuple(expected)}")


#: decode evictions of each cache that are value-checked (one host sync each); later ones are guarded on the device
#: (:meth:`~.slots.SlotStore.add`) and make no host sync
CHECKED_DECODE_EVICTIONS = 4


class Pending(NamedTuple):
    """A part's value checks, evaluated in one host sync (:meth:`PolicyStep._raise_broken`) before anything is
    written."""

    kind: str  #: the part: "disposition"
    flags: mx.array  #: the checks' outputs
    #: flag i true means ``messages[i]`` is broken; or a callable taking the flags' values and returning the
    #: broken rule's message or None (the disposition's check code, :meth:`PolicyStep._checked_update`)
    messages: Union[List[str], Callable[[list], Optional[str]]]


@dataclass
class Compiling:
    """Which decode calls may run compiled (parts with the ``compile_decode`` trait); each turns False for good
    once its compiled call failed."""

    choose: bool = True  #: the selector's rank and the choice
    dispose: bool = True  #: the disposition's update
    step: Optional["PolicyStep"] = field(default=None, compare=False, repr=False)  #: re-routed on a change

    def __setattr__(self, name: str, value) -> None:
        object.__setattr__(self, name, value)
        if name != "step" and self.__dict__.get("step") is not None:
            self.step._route()


#: the step's attributes that hold its routes (bound methods picked by :meth:`PolicyStep._route`): not pickled,
#: picked again when unpickled
_ROUTES = ("decode", "n_evict", "_losers", "_update")


class PolicyStep:
    """Score, select and dispose for one layer, with the checks at the part boundary."""

    def __init__(self, policy: Policy, layer: int) -> None:
        self.policy, self.layer = policy, layer
        #: what the parts need of the cache, resolved once (the only reader of the parts' declarations)
        self.needs: PolicyNeeds = policy_needs(policy, policy.owners)
        sel = type(policy.selector)
        if getattr(sel, "select", None) is not None:
            raise PluginError(
                f"{policy.owners['selector']} ({sel.__module__}.{sel.__qualname__}) implements select(view, "
                "n_evict), the 0.1 form removed in 0.3: implement rank(view) -> float32 [B, H, L] (lower is evicted "
                "first, +inf protected); the cache chooses from the ranks (docs/plugins/hooks.md)"
            )
        #: the first score updates are evaluated on the spot, so that a scorer whose output only fails when
        #: MLX evaluates it (e.g. a gather with float indices) is caught inside the transaction (prefill and
        #: the first decode steps, where a sync costs nothing noticeable); later steps add no host sync
        self.eager_checks = 4
        self._checked = CHECKED_DECODE_EVICTIONS
        #: the selector may evict more than the overflow (its own ``evict_count``)
        self.counts_more = getattr(sel, "evict_count", Selector.evict_count) is not Selector.evict_count
        #: the disposition is drop's (the base class's ``dispose``): no update, no key to draw
        self.drops = type(policy.disposition).dispose is Disposition.dispose
        #: whether the scorer's on_append can change the scores (not the base class's: it returns them as they are)
        self.appends = type(policy.scorer).on_append is not Scorer.on_append
        self.n_sink = getattr(policy.config.policy, "n_sink", 0)
        self.compiling = Compiling(step=self)
        self._route()

    def _route(self) -> None:
        """Pick the routes from the step's state, once when it changes (a new step, the last checked decode
        eviction, a compiled call that failed, unpickling) rather than at every step: :attr:`decode` (checked or
        steady), :meth:`n_evict` (the overflow, or the selector's count), the one-loser choice (compiled or eager)
        and the one-loser update past the checked evictions (none for drop, compiled or eager). The steady decode
        route reads none of the flags that picked it."""
        compiling = self.compiling
        self.n_evict = self._evict_count if self.counts_more else self._overflow
        self._losers = self._choose_compiled if self.needs.compile_selector and compiling.choose else self._choose_one
        compiled_update = self.needs.compile_disposition and compiling.dispose
        self._update = self._no_update if self.drops else self._dispose_compiled if compiled_update else self._disposed
        #: one decode eviction (one loser per row): ``decode(view, offset) -> (losers, update, counters)``
        self.decode = self._decode_checked if self._checked > 0 else self._decode_steady

    @property
    def checked_decode(self) -> int:
        """Decode evictions left that are value-checked (:data:`CHECKED_DECODE_EVICTIONS`; every other eviction
        is): each part's output evaluated on its own (a selector whose ranks only fail when MLX evaluates them is
        named, not the disposition that consumes its losers), then the update's values."""
        return self._checked

    @checked_decode.setter
    def checked_decode(self, n: int) -> None:
        self._checked = n
        self._route()

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k not in _ROUTES}

    def __setstate__(self, d: dict) -> None:
        d = dict(d)
        d.setdefault("_checked", d.pop("checked_decode", 0))  # (pickled before the routes)
        self.__dict__.update(d)
        self.drops = type(self.policy.disposition).dispose is Disposition.dispose
        object.__setattr__(self.compiling, "step", self)
        self._route()

    def _overflow(self, over: int, L: int) -> int:
        return over

    def _evict_count(self, over: int, L: int) -> int:
        """How many of ``L`` slots an eviction removes for an overflow of ``over > 0`` (:meth:`n_evict` where the
        selector counts more): the selector's ``evict_count(over, L)`` (:meth:`~kvpolicy_core.parts.base.Selector.
        evict_count`), checked to be an int in ``[over, L - 1]``, then clamped to ``min(E, L - n_sink)`` (at least
        ``over``): the sinks never leave, so a count that would reach them evicts every other slot it may and no
        more. Otherwise :meth:`n_evict` is the overflow."""
        owner = f"layer {self.layer}: {self.policy.owners['selector']}"
        E = self.call("selector", lambda _view: self.policy.selector.evict_count(over, L), None)
        if isinstance(E, bool) or not isinstance(E, int) or not over <= E <= L - 1:
            raise PluginError(
                f"{owner} returned evict_count {E!r} for an overflow of {over} of {L} slots; expected an int in "
                f"[{over}, {L - 1}] (at least the overflow, and one slot left)"
            )
        return max(over, min(E, L - min(self.n_sink, L)))

    def counter_names(self) -> Dict[str, str]:
        """Counters the parts declare through ``stats()`` (name -> meaning)."""
        names: Dict[str, str] = {}
        for part in (self.policy.scorer, self.policy.selector, self.policy.disposition):
            stats = getattr(part, "stats", None)
            if callable(stats):
                names.update(stats())
        return names

    def check_observed(self, windowed: bool, attended: bool) -> None:
        """The previous step must have passed through the attention hook if this layer needs it."""
        observed, log_weights = self.needs.attention, self.needs.log_weights
        if (observed or log_weights or windowed) and not attended:
            why = "observed signal" if observed else "attention log-weights" if log_weights else "sliding-window mask"
            raise ModelError(
                f"layer {self.layer}: this cache needs kvpolicy's attention hook ({why}), "
                "but the model's attention did not call it; build caches with "
                "KVCacheBuilder.for_model(model, config) or kvpolicy_core.attach(model, config)"
            )

    def check_hook(self, hooks, needed: bool) -> None:
        """The attention-hook installs a cache holds (``hooks``) must be live when this step ``needed`` the hook."""
        if needed and any(not h.active for h in hooks):
            raise ModelError(
                f"layer {self.layer}: this cache needs kvpolicy's attention hook, but the install it "
                "holds was removed (AttentionHook.remove); build caches with "
                "KVCacheBuilder.for_model(model, config) again"
            )

    def call(self, kind: str, fn, view: CacheView, *args):
        """``fn(view, *args)`` of the part ``kind``, called once; what it raises becomes a PluginError naming the
        part (and, when it read ``view.offset`` and then failed on a type, that the offset is an array)."""
        try:
            return fn(view, *args)
        except BaseException as exc:  # named on failure only (errors.blamed): a call that succeeds runs no errors.py
            self._raise_named(kind, view, exc)
            raise

    def _raise_named(self, kind: str, view: CacheView, exc: BaseException) -> None:
        """What :meth:`call` raises for ``exc``, raised by the part ``kind``."""
        owner = f"layer {self.layer}: {self.policy.owners[kind]}"
        try:
            _blame(f"{owner} raised", exc, passes=(KVPolicyError, RemovedForm))
        except RemovedForm as exc:  # a removed form: named as such, not as a type error of the part's own code
            raise PluginError(f"{owner} built a removed form: {exc}") from exc
        except PluginError as exc:
            cause = exc.__cause__
            if isinstance(cause, (TypeError, ValueError)) and view is not None and offset_read(view):
                hint = (
                    "; view.offset is an int32 mx.array [B, 1, 1] (since 0.2; the Python-int form was removed in "
                    "0.3): use it in MLX arithmetic, or int(view.offset) on a single cache"
                )
                raise PluginError(f"{exc}{hint}") from cause
            raise

    def scores(self, scores, shape: Tuple[int, int, int], current: Optional[mx.array] = None) -> mx.array:
        """A scorer's result checked to be [B, H, n]; float32, NaN counts as 0, +inf as float32's max and -inf as its
        lowest (``-max``), so that no score can tie with the +-inf a selector's rank uses for protection.
        ``current``: the view's scores (already checked); returned as they are when the scorer returned them."""
        if current is not None and scores is current:
            return scores
        if not isinstance(scores, mx.array) or tuple(scores.shape) != tuple(shape):
            raise wrong_output(f"layer {self.layer}: {self.policy.owners['scorer']}", "scores", scores, shape)
        scores = mx.nan_to_num(scores if scores.dtype == mx.float32 else scores.astype(mx.float32), nan=0.0)
        if self.eager_checks > 0:
            self.eager_checks -= 1
            self.evaluated("scorer", "scores", scores)
        return scores

    def evaluated(self, kind: str, what: str, *arrays) -> None:
        """Evaluate ``arrays`` now; an error MLX raises only at evaluation becomes a PluginError naming the part."""
        try:
            mx.eval(*arrays)
        except MLX_ERRORS as exc:
            raise PluginError(
                f"layer {self.layer}: {self.policy.owners[kind]} returned {what} that MLX cannot "
                f"evaluate: {type(exc).__name__}: {exc}"
            ) from exc

    def on_append(self, view: CacheView, keys: mx.array, new_positions: mx.array) -> mx.array:
        return self.scores(
            self.call("scorer", self.policy.scorer.on_append, view, keys, new_positions), view.scores.shape, view.scores
        )

    def on_attention(self, view: CacheView, queries: mx.array, scale: float, mask) -> mx.array:
        return self.scores(
            self.call("scorer", self.policy.scorer.on_attention, view, queries, scale, mask), view.scores.shape
        )

    def on_attention_weights(self, view: CacheView, weights: mx.array) -> mx.array:
        return self.scores(
            self.call("scorer", self.policy.scorer.on_attention_weights, view, weights), view.scores.shape
        )

    def _index_meta(self, kind: str, what: str, idx, shape: Tuple[int, ...]) -> mx.array:
        """Metadata checks of slot indices a part returned (an integer mx.array of ``shape``); int32 indices."""
        owner = f"layer {self.layer}: {self.policy.owners[kind]}"
        if not isinstance(idx, mx.array) or tuple(idx.shape) != tuple(shape):
            raise wrong_output(owner, what, idx, shape)
        if not mx.issubdtype(idx.dtype, mx.integer):
            dtype = str(idx.dtype).removeprefix("mlx.core.")
            raise PluginError(f"{owner} returned {what} of dtype {dtype}, expected an integer dtype")
        if idx.dtype in (mx.int64, mx.uint32, mx.uint64):  # saturate first: a plain cast would wrap 2**32 + 1 to 1
            idx = mx.minimum(idx, _INT32_MAX)
            if idx.dtype == mx.int64:
                idx = mx.maximum(idx, -1)
        return idx if idx.dtype == mx.int32 else idx.astype(mx.int32)

    def _raise_broken(self, pending) -> List[list]:
        """Evaluate every pending value check of this eviction in one host sync; raise the first broken rule.

        ``pending``: a :class:`Pending` per part, in the order the parts ran. Returns the flags' values.
        """
        flags = [p.flags for p in pending]
        if not flags:
            return []
        try:
            mx.eval(*flags)
        except MLX_ERRORS:  # an error MLX raises only at evaluation: name the part whose output it is
            for p in pending:
                self.evaluated(p.kind, "output", p.flags)
            raise
        values = [f.tolist() for f in flags]  # evaluated: read back without another graph op
        for p, got in zip(pending, values):
            m = p.messages
            broken = m(got) if callable(m) else next((msg for msg, bad in zip(m, got) if bad), None)
            if broken:
                raise PluginError(broken)
        return values

    def evict(
        self, view: CacheView, n_evict: int, offset, cut: bool = False, steps: bool = False
    ) -> Tuple[mx.array, Optional[MergeUpdate], Counters]:
        """The one eviction route: losers [B, H, n_evict] int32 (:meth:`choose`), the disposition's update for the
        survivors (or None) and the counters it reports (:meth:`dispose`). Nothing is written here: the caller
        writes the update and removes (or overwrites) the losers. ``cut``: the end-of-prompt cut of a held prompt
        (``when="prompt_end"``), chosen by the policy's ``cut_selector`` where it has one. ``steps``: the overflow of
        a verify step (:mod:`.undo`), a decode eviction as a one-token step's is.

        A decode eviction (one loser per row, or a verify step's) runs compiled where the part allows
        (``compile_decode``; one that fails to trace runs eager from then on); it and every other eviction are
        value-checked (each part's output evaluated on its own, then the update's values in one host sync) except
        the decode evictions past a cache's first :data:`CHECKED_DECODE_EVICTIONS`: those make no host sync.
        Which of these routes a one-loser eviction takes is picked by :meth:`_route` (:attr:`decode`)."""
        decode = n_evict == 1 or (steps and not cut)  # one loser per row (a cut of one too), a verify step's overflow
        check = not decode or self._checked > 0
        if n_evict == 1 and not cut and not check:
            return self._decode_steady(view, offset)
        if decode and check:
            self.checked_decode -= 1  # (the last one re-routes)
        losers = self._losers(view) if n_evict == 1 and not cut else self.choose(view, n_evict, cut)
        if check:
            self.evaluated("scorer", "scores", view.scores)
            self.evaluated("selector", "ranks", losers)
        update, counts = self.dispose(view, losers, offset, check)
        return losers, update, counts

    def _decode_checked(self, view: CacheView, offset) -> Tuple[mx.array, Optional[MergeUpdate], Counters]:
        """:attr:`decode` while checked decode evictions are left: :meth:`evict` of one loser."""
        return self.evict(view, 1, offset)

    def _decode_steady(self, view: CacheView, offset) -> Tuple[mx.array, Optional[MergeUpdate], Counters]:
        """:attr:`decode` past the checked decode evictions: the choice and the update :meth:`_route` picked, no
        host sync."""
        losers = self._losers(view)
        update, counts = self._update(view, losers, offset)
        return losers, update, counts

    def _choose_compiled(self, view: CacheView) -> mx.array:
        """One loser per row, compiled (``compile_decode``); a trace that fails makes the eager choice decide, now
        and from then on."""
        try:
            try:
                return compiled_choose(self.policy.selector)(view, self.n_sink)
            except BaseException as exc:  # the selector's code, traced: named on failure only (errors.blamed)
                _blame("compiled", exc)
                raise
        except PluginError:  # not compilable (or a part error): the eager call decides
            self.compiling.choose = False  # (re-routes)
        return self.choose(view, 1)

    def _choose_one(self, view: CacheView) -> mx.array:
        return self.choose(view, 1)

    def choose(self, view: CacheView, n_evict: int, cut: bool = False) -> mx.array:
        """The selector's ranks, checked, and the losers chosen from them (:func:`choose`), eager."""
        selector = self.policy.cut_selector if cut and self.policy.cut_selector is not None else self.policy.selector
        ranked = self.call("selector", selector.rank, view)
        owner = f"layer {self.layer}: {self.policy.owners['selector']}"
        shape = view.scores.shape
        if not isinstance(ranked, mx.array) or tuple(ranked.shape) != tuple(shape):
            raise wrong_output(owner, "ranks", ranked, shape)
        if not (mx.issubdtype(ranked.dtype, mx.floating) or mx.issubdtype(ranked.dtype, mx.integer)):
            raise PluginError(f"{owner} returned ranks of dtype {ranked.dtype}, expected a real dtype")
        ranked = ranked if ranked.dtype == mx.float32 else ranked.astype(mx.float32)
        return choose(ranked, view.positions, self.n_sink, view.dead, n_evict)

    def dispose(
        self, view: CacheView, losers: mx.array, offset, check: bool = True
    ) -> Tuple[Optional[MergeUpdate], Counters]:
        """The disposition's update for the survivors (or None) and the counters it reports.

        ``offset``: the cache's tokens seen (one key, counters summed), or a list of B per-row offsets for a view
        of B stacked rows (:mod:`.batch_rows`: keys [B, 2], counters [B]). ``check``: the update is value-checked
        in one host sync here, before the cache writes anything (else it is compiled where the part allows, and
        guarded on the device as the store adds it).
        """
        if self.drops:  # drop (H2O): no update, no key to draw
            return None, {}
        if losers.shape[-1] == 1 and not check:
            return self._update(view, losers, offset)
        return self._disposed(view, losers, offset, check)

    def _no_update(self, view: CacheView, losers: mx.array, offset) -> Tuple[None, Counters]:
        return None, {}

    def _dispose_compiled(self, view: CacheView, losers: mx.array, offset) -> Tuple[Optional[MergeUpdate], Counters]:
        """One loser per row past the checked evictions, compiled (``compile_decode``); a trace that fails makes the
        eager call decide, now and from then on (one that returned something else, now)."""
        seed, rows = self.policy.config.seed, isinstance(offset, (list, tuple))
        key = step_keys(seed, self.layer, offset) if rows else step_key(seed, self.layer, offset)
        try:
            try:
                update = compiled(self.policy.disposition)(view, losers, key)
            except BaseException as exc:  # the disposition's code, traced: named on failure only (errors.blamed)
                _blame("compiled", exc)
                raise
        except PluginError:  # not compilable (or a part error): the eager call decides
            self.compiling.dispose, update = False, None  # (re-routes)
        return self._disposed(view, losers, offset, False, key, update)

    def _disposed(
        self, view: CacheView, losers: mx.array, offset, check: bool = False, key=None, update=None
    ) -> Tuple[Optional[MergeUpdate], Counters]:
        """The disposition's update (``update``, or its eager call with ``key``, drawn when None), checked."""
        rows = len(offset) if isinstance(offset, (list, tuple)) else None
        if update is None:
            if key is None:
                seed = self.policy.config.seed
                key = step_key(seed, self.layer, offset) if rows is None else step_keys(seed, self.layer, offset)
            update = self.call("disposition", self.policy.disposition.dispose, view, losers, key)
        if update is None:
            return None, {}
        update, pending = self._checked_update(view, update, check_values=check)
        if pending is not None:
            code = self._raise_broken([pending])[-1][0]
            if code == 0:  # every delta is 0 (no loser merged): nothing to write, the counters still count
                return None, self._counts(update.stats, rows)
        return update, self._counts(update.stats, rows)

    def _counts(self, stats, rows: Optional[int] = None) -> Counters:
        """A disposition's counters as int32 scalars (summed over a batch), or per row ``[rows]``.

        Each an int or a numeric mx.array; per row (stacked rows), an array of ``rows`` elements.
        """
        owner = f"layer {self.layer}: {self.policy.owners['disposition']}"
        if stats is None:
            return {}
        if not isinstance(stats, dict):
            raise PluginError(f"{owner} returned stats of type {type(stats).__name__}, expected a dict name -> count")
        out: Counters = {}
        for name, value in stats.items():
            if value is None:
                continue
            ok = (isinstance(value, int) and not isinstance(value, bool)) or (
                isinstance(value, mx.array) and value.dtype != mx.complex64
            )
            if rows is not None and not (isinstance(value, mx.array) and value.size == rows):
                raise PluginError(
                    f"{owner} returned counter {name!r} of shape {getattr(value, 'shape', ())} for "
                    f"{rows} stacked rows; a batch_rows disposition counts per row ([B])"
                )
            if not ok:
                raise PluginError(
                    f"{owner} returned counter {name!r} = {value!r} of type {type(value).__name__}; "
                    "expected an int or a numeric mx.array"
                )
            if rows is None and isinstance(value, mx.array) and value.dtype == mx.int32 and value.ndim == 0:
                out[str(name)] = value  # already what the counters hold: no conversion ops
                continue
            value = mx.array(value).astype(mx.int32)
            out[str(name)] = value.reshape(rows) if rows is not None else value.sum()
        return out

    def _checked_update(self, view: CacheView, u, check_values: bool = True):
        """A disposition's MergeUpdate with its metadata checked (deltas shaped like their rows, real dtypes) and
        its pending value check (targets in range, finite deltas for finite rows), whose code also says whether the
        update changes anything (:func:`~kvpolicy_core.cache.checks.update_checks`).
        ``check_values=False`` (a decode update past the checked ones): the metadata checks only, and None for
        the pending check.
        """
        owner = f"layer {self.layer}: {self.policy.owners['disposition']}"
        if not isinstance(u, MergeUpdate):
            raise PluginError(f"{owner} returned {type(u).__name__}, expected a MergeUpdate or None")
        if u.stats is not None and not isinstance(u.stats, dict):
            raise PluginError(
                f"{owner} returned stats of type {type(u.stats).__name__}, expected a dict name -> count (MergeUpdate"
                "'s 0.1 fields draws/merges were removed in 0.3: return stats={'gate_draws': ..., 'merges': ...})"
            )
        B, H, L = view.scores.shape
        T = getattr(u.targets, "shape", (0, 0, 0))[-1] if getattr(u.targets, "ndim", 0) == 3 else -1
        for name, x, row in (
            ("d_keys", u.d_keys, (view.keys.shape[-1],)),
            ("d_values", u.d_values, (view.values.shape[-1],)),
            ("d_scores", u.d_scores, ()),
            ("d_log_weights", u.d_log_weights, ()),
        ):
            if x is not None and (not isinstance(x, mx.array) or tuple(x.shape) != (B, H, T, *row)):
                raise wrong_output(owner, name, x, (B, H, max(T, 0), *row))
        if u.d_log_weights is not None and view.log_weights is None:
            raise PluginError(
                f"{owner} returned d_log_weights, but no part declares Needs(log_weights=True) (the cache keeps "
                "no log-weights)"
            )
        deltas = [
            (name, x)
            for name, x in (("d_keys", u.d_keys), ("d_values", u.d_values), ("d_scores", u.d_scores))
            if x is not None
        ]
        for name, x in deltas:
            if not (mx.issubdtype(x.dtype, mx.floating) or mx.issubdtype(x.dtype, mx.integer)):
                raise PluginError(f"{owner} returned {name} of dtype {x.dtype}, expected a real dtype")
        bases = {"d_keys": view.keys, "d_values": view.values, "d_scores": view.scores}
        targets = self._index_meta("disposition", "merge targets", u.targets, (B, H, max(T, 0)))
        if not check_values:
            return u._replace(targets=targets), None
        pairs = [(x, bases[name]) for name, x in deltas]
        in_graph = checked_update(targets, L, pairs, u.d_log_weights)
        code, lw = in_graph.code, in_graph.d_log_weights
        names = [name for name, _ in deltas]

        def broken(got) -> Optional[str]:  # the code's value -> the first broken rule, or None
            if got[0] & TARGET_OUT_OF_RANGE:
                return f"{owner} returned merge targets outside the cache: each must be in [0, L), with L = {L}"
            if got[0] & NONFINITE:  # rare: decide exactly, per delta, whether a finite target row gets it
                for name, bad in zip(names, nonfinite_flags(targets, L - 1, pairs)):
                    if bad:
                        return (
                            f"{owner} returned {name} with non-finite values (NaN or inf) for finite survivors; "
                            "deltas must be finite"
                        )
            return None

        return u._replace(targets=targets, d_log_weights=lw), Pending("disposition", code, broken)
