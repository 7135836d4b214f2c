"""A disposition's decode-step update as one compiled MLX graph (``Disposition.compile_decode``).

On CPU each MLX op has a fixed cost of ~5-10 µs, and a merge step is ~40 small ops over [B, H, L]
arrays; :func:`mx.compile` fuses them (CaM's mass merge at L = 1024: ~600 µs eager, ~200 µs compiled,
docs/benchmarks.md). Only decode steps (one loser per row) are compiled: their shapes stay fixed once
the budget is reached, so the graph is traced once per (shape, layout) and reused by every layer.
The offset enters the graph as an int32 scalar array (a Python int would be a constant and retrace
every step), so a compiled disposition must use ``view.offset`` only in MLX arithmetic.

The result is the disposition's own :class:`~kvpolicy_core.parts.base.MergeUpdate`, field for field.
"""

from __future__ import annotations

import weakref
from typing import Callable, Dict, List, Optional, Tuple

import mlx.core as mx

from .parts.base import CacheView, MergeUpdate

_FIELDS = ("targets", "d_keys", "d_values", "d_scores", "draws", "merges", "d_log_weights")
_OPTIONAL_VIEW = ("dead", "log_weights", "key_norms")
_cache: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def wants_compile(disposition, n_evict: int) -> bool:
    """Decode steps of a disposition that declares ``compile_decode = True``."""
    return n_evict == 1 and bool(getattr(disposition, "compile_decode", False))


class _Compiled:
    """One disposition's compiled ``dispose``, one trace per view layout (which optional fields are set)."""

    def __init__(self, disposition) -> None:
        self.disposition = disposition
        self._fns: Dict[Tuple, Tuple[Callable, List]] = {}

    def _build(self, layout: Tuple) -> Tuple[Callable, List]:
        head_offset, heads_total, n_new, present = layout
        spec: List = []  # filled while tracing: which fields are set and the stats' names

        def fn(keys, values, positions, scores, offset, losers, key, *optional):
            extra = dict(zip([f for f, p in zip(_OPTIONAL_VIEW, present) if p], optional))
            view = CacheView(keys, values, positions, scores, offset, n_new, extra.get("dead"), head_offset,
                             heads_total, extra.get("log_weights"), extra.get("key_norms"))
            u = self.disposition.dispose(view, losers, key)
            if not isinstance(u, MergeUpdate) or (u.stats is not None and not isinstance(u.stats, dict)):
                spec[:] = [("raw", u)]
                return [mx.array(0)]
            fields = [f for f in _FIELDS if getattr(u, f) is not None]
            stats = [(k, v) for k, v in (u.stats or {}).items() if isinstance(v, mx.array)]
            spec[:] = [("update", fields, [k for k, _ in stats],
                        {k: v for k, v in (u.stats or {}).items() if not isinstance(v, mx.array)}, u.stats is None)]
            return [getattr(u, f) for f in fields] + [v for _, v in stats]

        return mx.compile(fn), spec

    def __call__(self, view: CacheView, losers: mx.array, key: mx.array):
        present = tuple(getattr(view, f) is not None for f in _OPTIONAL_VIEW)
        layout = (view.head_offset, view.heads_total, view.n_new, present)
        if layout not in self._fns:
            self._fns[layout] = self._build(layout)
        fn, spec = self._fns[layout]
        optional = [getattr(view, f) for f, p in zip(_OPTIONAL_VIEW, present) if p]
        out = fn(view.keys, view.values, view.positions, view.scores, mx.array(view.offset, dtype=mx.int32),
                 losers, key, *optional)
        if spec[0][0] == "raw":  # not a MergeUpdate: the eager call gives the part's own result to check
            return self.disposition.dispose(view, losers, key)
        _, fields, stat_names, constants, no_stats = spec[0]
        update = dict(zip(fields, out[: len(fields)]))
        stats: Optional[dict] = None if no_stats else {**constants, **dict(zip(stat_names, out[len(fields):]))}
        return MergeUpdate(**update, stats=stats)


def compiled(disposition) -> Callable:
    """The compiled ``dispose`` of ``disposition`` (shared by every layer's cache)."""
    try:
        fn = _cache.get(disposition)
        if fn is None:
            fn = _cache[disposition] = _Compiled(disposition)
        return fn
    except TypeError:  # not weak-referenceable: compile for this call's owner only
        return _Compiled(disposition)
