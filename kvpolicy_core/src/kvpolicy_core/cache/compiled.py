"""Decode steps of parts as compiled MLX graphs (the ``compile_decode`` trait of shipped parts,
:mod:`kvpolicy_core.parts.shipped`): a selector's choice with its value checks and a disposition's update
(a trusted selector's choice with the new token's write, H2O's whole decode eviction, is
:meth:`kvpolicy_core.cache.slots.SlotStore.write`'s, cached per selector in :mod:`.traces`).

On CPU each MLX op has a fixed cost of ~5-10 µs, and a merge step is ~40 small ops over [B, H, L]
arrays; :func:`mx.compile` fuses them (CaM's mass merge at L = 1024: ~600 µs eager, ~200 µs compiled,
docs/benchmarks.md). Only decode steps (one loser per row) are compiled: their shapes stay fixed once
the budget is reached, so the graph is traced once per (shape, layout) and reused by every layer.
The offset enters the graph as the int32 array [B, 1, 1] every view gives (``CacheView.offset``; a Python int
would be a constant and retrace every step), and a part must not sync with the host inside.

The results are the part's own, field for field: the selector's losers (with the value flags of
:func:`kvpolicy_core.cache.checks.loser_flags` computed in the same graph), the disposition's
:class:`~kvpolicy_core.parts.base.MergeUpdate`.
"""

from __future__ import annotations

from typing import Callable, Dict, List, NamedTuple, Optional, Tuple

import mlx.core as mx

from ..parts.base import CacheView, MergeUpdate, kept_key_norms, on_key_norms
from .checks import UpdateChecks, _loser_flags, scalar, update_checks
from .traces import per_part, weak

_FIELDS = ("targets", "d_keys", "d_values", "d_scores", "draws", "merges", "d_log_weights")
_OPTIONAL_VIEW = ("dead", "log_weights", "key_norms")


class _PartRef:
    """Holds its part weakly (:func:`.traces.weak`): the wrappers live in the per-part map of :mod:`.traces`."""

    def _hold(self, part) -> None:
        self._ref = weak(part)

    @property
    def part(self):
        return self._ref()


def wants_compile(compile_decode: bool, n_evict: int) -> bool:
    """Decode steps (one loser per row) of a part with the ``compile_decode`` trait."""
    return n_evict == 1 and compile_decode


def _view(arrays, layout, read: Optional[list] = None) -> CacheView:
    """The traced view; ``read`` (a list) gets True appended when the part reads key norms the view lacks."""
    keys, values, positions, scores, offset, *optional = arrays
    head_offset, heads_total, n_new, present = layout
    extra = dict(zip([f for f, p in zip(_OPTIONAL_VIEW, present) if p], optional))
    view = CacheView(
        keys,
        values,
        positions,
        scores,
        offset,
        n_new,
        extra.get("dead"),
        head_offset,
        heads_total,
        extra.get("log_weights"),
        key_norms=extra.get("key_norms"),
    )
    if read is not None and "key_norms" not in extra:  # computed in the graph; the cache keeps them from then on
        on_key_norms(view, lambda keys: read.append(True))
    return view


def _optional(view: CacheView, field: str):
    return kept_key_norms(view) if field == "key_norms" else getattr(view, field)


def _layout(view: CacheView):
    present = tuple(_optional(view, f) is not None for f in _OPTIONAL_VIEW)
    arrays = [view.keys, view.values, view.positions, view.scores, view.offset]
    arrays += [_optional(view, f) for f, p in zip(_OPTIONAL_VIEW, present) if p]
    return (view.head_offset, view.heads_total, view.n_new, present), arrays


def _norms_were_read(view: CacheView, read: list) -> None:
    """The traced part read key norms that ``view`` lacks: the eager view's first read (the cache keeps them)."""
    if read and kept_key_norms(view) is None:
        view.key_norms  # noqa: B018


class _CompiledSelect(_PartRef):
    """A ranked selector's decode choice and its value flags, one trace per view layout."""

    def __init__(self, selector, n_sink: int, with_flags: bool = True) -> None:
        self._hold(selector)
        self.n_sink, self.with_flags = n_sink, with_flags
        self._fns: Dict[Tuple, Callable] = {}

    def __call__(self, view: CacheView, n_evict: int):
        layout, arrays = _layout(view)
        fn, read = self._fns.get(layout, (None, []))
        if fn is None:

            def fn(n_sink, last, *arrays):
                v = _view(arrays, layout, read)
                losers = self.part.select(v, n_evict)
                if not isinstance(losers, mx.array) or losers.ndim != 3 or not mx.issubdtype(losers.dtype, mx.integer):
                    raise TypeError("not an integer [B, H, E] array")  # the eager call reports what it is
                losers = losers.astype(mx.int32)
                if not self.with_flags:
                    return losers, None
                return losers, _loser_flags(losers, v.positions, n_sink, last, v.dead)

            fn = mx.compile(fn)
            self._fns[layout] = (fn, read)
        out = fn(scalar(self.n_sink), scalar(view.scores.shape[-1] - 1), *arrays)
        _norms_were_read(view, read)
        return out


def compiled_select(selector, n_sink: int, with_flags: bool = True) -> Callable:
    """``f(view, n_evict) -> (losers int32, flags)``: the compiled choice of a ranked ``selector``
    (``with_flags=False``: no checks computed, flags None)."""
    return per_part(selector, ("select", n_sink, with_flags), lambda: _CompiledSelect(selector, n_sink, with_flags))


class _Traced(NamedTuple):
    """What a traced ``dispose`` returned, to read the compiled call's flat outputs back into a MergeUpdate."""

    fields: List[str]  #: the MergeUpdate fields set, in output order
    stat_names: List[str]  #: counters returned as arrays, in output order (after the fields)
    constants: dict  #: counters returned as Python values
    no_stats: bool  #: ``stats`` was None
    has_log_weights: bool  #: the checks include finite log-weight deltas (after the check code)


class _Compiled(_PartRef):
    """One disposition's compiled ``dispose``, one trace per view layout (which optional fields are set).

    With ``checks``, the update's value checks (:func:`kvpolicy_core.cache.checks.update_checks`) are traced
    into the same graph, so a decode step's merge is one compiled call; the call returns them next to the
    update. Without (a shipped disposition, :mod:`kvpolicy_core.parts.shipped`), the graph is the update alone.
    """

    def __init__(self, disposition, checks: bool = True) -> None:
        self._hold(disposition)
        self.checks = checks
        self._fns: Dict[Tuple, Tuple[Callable, List, List]] = {}

    def _build(self, layout: Tuple) -> Tuple[Callable, List, List]:
        spec: List[Optional[_Traced]] = [None]  # filled while tracing (None: the part returned no MergeUpdate)
        read: List = []  # filled while tracing: the part read key norms the view lacks

        def fn(losers, key, last, *arrays):
            view = _view(arrays, layout, read)
            u = self.part.dispose(view, losers, key)
            if not isinstance(u, MergeUpdate) or (u.stats is not None and not isinstance(u.stats, dict)):
                spec[0] = None
                return [mx.array(0)]
            fields = [f for f in _FIELDS if getattr(u, f) is not None]
            stats = [
                (k, v.astype(mx.int32).reshape(()) if v.size == 1 and v.dtype != mx.complex64 else v)
                for k, v in (u.stats or {}).items()
                if isinstance(v, mx.array)
            ]  # counters as int32 scalars
            targets = u.targets.astype(mx.int32) if mx.issubdtype(u.targets.dtype, mx.integer) else u.targets
            pairs = [
                (getattr(u, f), base)
                for f, base in (("d_keys", view.keys), ("d_values", view.values), ("d_scores", view.scores))
                if getattr(u, f) is not None
            ]
            checks = list(update_checks(targets, last, pairs, u.d_log_weights)) if self.checks else []
            spec[0] = _Traced(
                fields,
                [k for k, _ in stats],
                {k: v for k, v in (u.stats or {}).items() if not isinstance(v, mx.array)},
                u.stats is None,
                len(checks) > 1 and checks[1] is not None,
            )
            return [getattr(u, f) for f in fields] + [v for _, v in stats] + [c for c in checks if c is not None]

        return mx.compile(fn), spec, read

    def __call__(self, view: CacheView, losers: mx.array, key: mx.array):
        """(the MergeUpdate or None, its in-graph checks (check code, finite d_log_weights) or None)."""
        layout, arrays = _layout(view)
        if layout not in self._fns:
            self._fns[layout] = self._build(layout)
        fn, spec, read = self._fns[layout]
        out = fn(losers, key, scalar(view.scores.shape[-1] - 1), *arrays)
        _norms_were_read(view, read)
        traced = spec[0]
        if traced is None:  # not a MergeUpdate: the eager call gives the part's own result to check
            return self.part.dispose(view, losers, key), None
        fields, names = traced.fields, traced.stat_names
        update = dict(zip(fields, out[: len(fields)]))
        n = len(fields) + len(names)
        stats = None if traced.no_stats else {**traced.constants, **dict(zip(names, out[len(fields) : n]))}
        checks = UpdateChecks(out[n], out[n + 1] if traced.has_log_weights else None) if self.checks else None
        return MergeUpdate(**update, stats=stats), checks


def compiled(disposition, checks: bool = True) -> Callable:
    """The compiled ``dispose`` of ``disposition``, with its update's checks unless ``checks=False`` (shared by
    every layer's cache)."""
    return per_part(disposition, ("dispose", checks), lambda: _Compiled(disposition, checks))
