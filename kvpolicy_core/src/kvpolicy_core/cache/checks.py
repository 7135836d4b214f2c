"""The value checks of part outputs as compiled MLX graphs: one small fused graph per check.

Each function returns flags for :class:`~kvpolicy_core.cache.step.PolicyStep`, which evaluates every flag of one
eviction in a single host sync: a disposition's update at a prompt chunk's eviction and at a cache's first decode
evictions (later ones are guarded on the device, :meth:`kvpolicy_core.cache.slots.SlotStore.add`, and cost no
sync). A selector's choice needs no check: the engine picks it from the ranks. On CPU each MLX op that is not fused
(a reduction, a gather) has a fixed dispatch cost that dwarfs its work at these sizes, so a merge update's checks
are one summary code with one reduction per array and no gather (:func:`update_checks`); the exact per-row rule is
decided on the host only when that code reports a non-finite delta (:func:`nonfinite_flags`). Sizes enter as input
arrays, not Python constants: MLX compiles fused CPU kernels with the system C++ compiler once per distinct kernel
(cached under its temporary directory), so a constant per budget would compile new kernels for every budget. Indices
are clamped into ``[0, L)`` before any gather here, so a check never reads out of bounds whatever it is given.
"""

from __future__ import annotations

from typing import Callable, List, NamedTuple, Optional, Sequence, Tuple

import mlx.core as mx

from .slots import LOG_WEIGHT_BOUND


class UpdateChecks(NamedTuple):
    """A MergeUpdate's value checks (:func:`update_checks`)."""

    code: mx.array  #: [1] int32: the check summary
    d_log_weights: Optional[mx.array]  #: the log-weight deltas made finite, or None


def _rows(x: mx.array, safe: mx.array) -> mx.array:
    return mx.take_along_axis(x, safe[..., None] if x.ndim == 4 else safe, axis=2)


def scalar(x: int) -> mx.array:
    return mx.array(x, dtype=mx.int32)


TARGET_OUT_OF_RANGE = 4  # some target outside [0, L)
NONFINITE = 2  # some delta element is NaN or inf: broken only where its target row is finite (re-checked on the host)


def update_checks(
    targets: mx.array, last: mx.array, pairs: Sequence[Tuple[mx.array, mx.array]], d_log_weights: Optional[mx.array]
):
    """A MergeUpdate's value checks as one summary, traceable (the compiled decode path runs them in the
    disposition's graph): one reduction per array, no gather.

    ``pairs``: (delta, base) for d_keys, d_values, d_scores as present (each delta is checked in float32, as it
    will be added; the bases' rows are read only by :func:`nonfinite_flags`, on the rare path).
    Returns (code [1] int32, the log-weight deltas made finite:
    NaN as 0, clipped to +-``LOG_WEIGHT_BOUND``, or None), where::

        code = 4 [some target outside [0, last]] + max over deltas d (and the finite log-weight deltas) of
               (2 if d has a NaN or inf element, else 1 if d has a nonzero element, else 0)

    ``code == 0``: the update changes nothing; ``code & 2``: some delta is non-finite, a broken rule only
    where its target row is finite, which :func:`nonfinite_flags` decides exactly.
    """
    code = mx.any((targets < 0) | (targets > last)).astype(mx.int32) * TARGET_OUT_OF_RANGE
    lw = None
    if d_log_weights is not None:
        lw = mx.clip(mx.nan_to_num(d_log_weights.astype(mx.float32), nan=0.0), -LOG_WEIGHT_BOUND, LOG_WEIGHT_BOUND)
    level = mx.array(0, dtype=mx.int32)
    for d in [_as_written(d, base) for d, base in pairs] + ([lw] if lw is not None else []):
        if d.size == 0:
            continue
        level = mx.maximum(level, mx.max(mx.where(mx.isfinite(d), (d != 0).astype(mx.int32), NONFINITE)))
    return (code + level).reshape(1), lw


def _as_written(delta: mx.array, base: mx.array) -> mx.array:
    """The delta as :meth:`~kvpolicy_core.cache.slots.SlotStore.add` adds it: in float32 (the sum is then stored in
    the buffer's dtype, saturating at its finite range, so a delta finite in float32 is never a non-finite one)."""
    return delta if delta.dtype == mx.float32 else delta.astype(mx.float32)


def nonfinite_flags(targets: mx.array, last: int, pairs: Sequence[Tuple[mx.array, mx.array]]) -> List[bool]:
    """Per (delta, base) of ``pairs``: whether the delta, in float32, has a NaN or inf where its target
    row of ``base`` is finite (the broken rule; a non-finite delta on a non-finite element is allowed). Host-side,
    on the rare path where :func:`update_checks` reported a non-finite delta; targets are clamped before the gather."""
    safe = mx.clip(targets, 0, last)
    flags = [mx.any(~mx.isfinite(_as_written(d, b)) & mx.isfinite(_rows(b, safe))) for d, b in pairs]
    mx.eval(flags)
    return [bool(f.item()) for f in flags]


_compiled_updates = {}


def _flat_checks(n_pairs: int, has_log_weights: bool) -> Callable:
    """:func:`update_checks` over flat inputs, for ``mx.compile``. It closes over the two counts only: a closure
    over the first call's arrays would keep them (a layer's whole key and value buffers) alive for the process."""
    n = 2 * n_pairs

    def flat(targets, last, *xs):
        lw = xs[n] if has_log_weights else None
        return update_checks(targets, last, list(zip(xs[0:n:2], xs[1:n:2])), lw)

    return flat


def checked_update(
    targets: mx.array, L: int, pairs: List[Tuple[mx.array, mx.array]], d_log_weights: Optional[mx.array]
):
    """:func:`update_checks` compiled (once per set of present deltas): (code [1] int32, finite log-weight
    deltas or None); sizes enter as arrays."""
    key = (len(pairs), d_log_weights is not None)
    fn = _compiled_updates.get(key)
    if fn is None:
        fn = _compiled_updates[key] = mx.compile(_flat_checks(*key))
    extra = [d_log_weights] if d_log_weights is not None else []
    return UpdateChecks(*fn(targets, scalar(L - 1), *[x for pair in pairs for x in pair], *extra))
