"""Decode steps of parts as compiled MLX graphs (parts with the ``compile_decode`` trait, :mod:`kvpolicy_core.parts.
traits`): a selector's ranks with the choice made from them, and a disposition's update.

On CPU each MLX op has a fixed dispatch cost, and a merge step is ~40 small ops over [B, H, L] arrays;
:func:`mx.compile` fuses them into one call (docs/results/benchmarks-speed.md). Only decode steps (one loser
per row) are compiled: their shapes stay fixed once the budget is reached, so the graph is traced once per
(shape, layout) and reused by every layer. The offset enters the graph as the int32 array [B, 1, 1] every view gives
(``CacheView.offset``; a Python int would be a constant and retrace every step), and a part must not sync with the
host inside.

The results are the part's own, field for field: the losers :func:`kvpolicy_core.cache.step.choose` picks from
the selector's ranks, the disposition's :class:`~kvpolicy_core.parts.base.MergeUpdate`. A traced output of the
wrong type or shape raises, and the eager call then reports it.
"""

from __future__ import annotations

from typing import Callable, Dict, List, NamedTuple, Optional, Tuple

import mlx.core as mx

from ..parts.base import CacheView, MergeUpdate, kept_key_norms, on_key_norms
from .checks import scalar
from .choose import choose
from .traces import per_part, weak

_FIELDS = ("targets", "d_keys", "d_values", "d_scores", "d_log_weights")
_OPTIONAL_VIEW = ("dead", "log_weights", "key_norms")


class _PartRef:
    """Holds its part weakly (:func:`.traces.weak`): the wrappers live in the per-part map of :mod:`.traces`."""

    def _hold(self, part) -> None:
        self._ref = weak(part)

    @property
    def part(self):
        return self._ref()


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


class _CompiledChoose(_PartRef):
    """A selector's decode ranks and the one loser chosen from them, one trace per view layout."""

    def __init__(self, selector) -> None:
        self._hold(selector)
        self._fns: Dict[Tuple, Callable] = {}

    def __call__(self, view: CacheView, n_sink: int):
        layout, arrays = _layout(view)
        fn, read = self._fns.get(layout, (None, []))
        if fn is None:

            def fn(n_sink, *arrays):
                v = _view(arrays, layout, read)
                ranked = self.part.rank(v)
                if not isinstance(ranked, mx.array) or ranked.shape != v.scores.shape:
                    raise TypeError("ranks of the wrong type or shape")  # the eager call reports what they are
                if not (mx.issubdtype(ranked.dtype, mx.floating) or mx.issubdtype(ranked.dtype, mx.integer)):
                    raise TypeError("ranks of a non-real dtype")
                return choose(ranked.astype(mx.float32), v.positions, n_sink, v.dead, 1)

            fn = mx.compile(fn)
            self._fns[layout] = (fn, read)
        out = fn(scalar(n_sink), *arrays)
        _norms_were_read(view, read)
        return out


def compiled_choose(selector) -> Callable:
    """``f(view, n_sink) -> losers [B, H, 1] int32``: the compiled decode choice of ``selector``."""
    return per_part(selector, ("choose",), lambda: _CompiledChoose(selector))


class _Traced(NamedTuple):
    """What a traced ``dispose`` returned, to read the compiled call's flat outputs back into a MergeUpdate."""

    fields: List[str]  #: the MergeUpdate fields set, in output order
    stat_names: List[str]  #: counters returned as arrays, in output order (after the fields)
    constants: dict  #: counters returned as Python values
    no_stats: bool  #: ``stats`` was None


class _Compiled(_PartRef):
    """One disposition's compiled ``dispose``, one trace per view layout (which optional fields are set)."""

    def __init__(self, disposition) -> None:
        self._hold(disposition)
        self._fns: Dict[Tuple, Tuple[Callable, List, List]] = {}

    def _build(self, layout: Tuple) -> Tuple[Callable, List, List]:
        spec: List[Optional[_Traced]] = [None]  # filled while tracing (None: the part returned no MergeUpdate)
        read: List = []  # filled while tracing: the part read key norms the view lacks

        def fn(losers, key, *arrays):
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
            spec[0] = _Traced(
                fields,
                [k for k, _ in stats],
                {k: v for k, v in (u.stats or {}).items() if not isinstance(v, mx.array)},
                u.stats is None,
            )
            return [getattr(u, f) for f in fields] + [v for _, v in stats]

        return mx.compile(fn), spec, read

    def __call__(self, view: CacheView, losers: mx.array, key: mx.array) -> MergeUpdate:
        """The MergeUpdate (None: the part returned something else; the eager call then reports it)."""
        layout, arrays = _layout(view)
        if layout not in self._fns:
            self._fns[layout] = self._build(layout)
        fn, spec, read = self._fns[layout]
        out = fn(losers, key, *arrays)
        _norms_were_read(view, read)
        traced = spec[0]
        if traced is None:
            return None
        fields, names = traced.fields, traced.stat_names
        update = dict(zip(fields, out[: len(fields)]))
        n = len(fields) + len(names)
        stats = None if traced.no_stats else {**traced.constants, **dict(zip(names, out[len(fields) : n]))}
        return MergeUpdate(**update, stats=stats)


def compiled(disposition) -> Callable:
    """The compiled ``dispose`` of ``disposition`` (shared by every layer's cache)."""
    return per_part(disposition, ("dispose",), lambda: _Compiled(disposition))
