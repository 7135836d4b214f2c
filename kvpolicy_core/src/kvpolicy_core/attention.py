"""Opt-in observation of the model's real attention, at mlx-lm's one meeting point.

mlx-lm model modules import ``scaled_dot_product_attention`` by name from
``mlx_lm.models.base``; that call is the only place where queries, keys, the cache and
the mask meet. :func:`install` replaces the name in the modules a given model uses
with a wrapper that, for kvpolicy caches only, lets the cache see the queries (for
``signal="observed"``) and substitute a per-layer sliding-window mask; for any other
cache it calls the original unchanged. A single-sequence cache whose scorer takes the model's
weights computes the attention once and hands the weights to the scorer
(:meth:`PolicyCache.attend <kvpolicy_core.cache.PolicyCache.attend>`); attention sinks (gpt-oss)
always take mlx-lm's kernel. Installs are reference counted per module and
undone by :meth:`AttentionHook.remove`, or when the handle is garbage: the caches that need
the hook hold its handle, so the hook lives exactly as long as they do (one user's
``detach`` cannot break another user's caches).
"""

from __future__ import annotations

import sys
import threading
import weakref
from typing import Dict, List

from .batch_cache import BatchPolicyCache
from .cache import PolicyCache
from .errors import ModelError

_lock = threading.RLock()  # re-entrant: a handle may be collected while the lock is held
_patched: Dict[str, tuple] = {}  # module name -> (original fn, refcount)
ATTR = "scaled_dot_product_attention"


def _wrap(original):
    def scaled_dot_product_attention(queries, keys, values, cache, scale, mask, *args, **kwargs):
        sinks = args[0] if args else kwargs.get("sinks")
        if isinstance(cache, PolicyCache) and sinks is None and len(args) <= 1:
            return cache.attend(queries, keys, values, scale, mask, original)
        if isinstance(cache, (PolicyCache, BatchPolicyCache)):
            mask = cache.before_attention(queries, scale, mask)
        return original(queries, keys, values, cache, scale, mask, *args, **kwargs)

    scaled_dot_product_attention.__wrapped__ = original
    scaled_dot_product_attention._kvpolicy = True
    return scaled_dot_product_attention


def _model_modules(model) -> List[str]:
    names = {type(m).__module__ for _, m in model.named_modules()}
    return sorted(n for n in names if hasattr(sys.modules.get(n), ATTR))


def _release(modules: List[str]) -> None:
    with _lock:
        for name in modules:
            original, count = _patched[name]
            if count == 1:
                setattr(sys.modules[name], ATTR, original)
                del _patched[name]
            else:
                _patched[name] = (original, count - 1)


class AttentionHook:
    """A handle on one install; :meth:`remove` (or the handle being garbage-collected) undoes it."""

    def __init__(self, modules: List[str]) -> None:
        self.modules = modules
        self._finalizer = weakref.finalize(self, _release, modules)

    @property
    def active(self) -> bool:
        return self._finalizer.alive

    def remove(self) -> None:
        """Undo this install now (idempotent)."""
        self._finalizer()

    def __copy__(self) -> "AttentionHook":
        return self  # a copied cache holds the same install (a copied finalizer would be dead)

    def __deepcopy__(self, memo) -> "AttentionHook":
        return self


def install(model) -> AttentionHook:
    """Route the attention of ``model``'s modules through kvpolicy caches; returns the handle.

    Raises :class:`~kvpolicy_core.errors.ModelError` if the model computes attention
    without mlx-lm's ``scaled_dot_product_attention``.
    """
    modules = _model_modules(model)
    if not modules:
        raise ModelError(
            f"{type(model).__name__}: no module of this model calls mlx-lm's scaled_dot_product_attention, "
            "so kvpolicy cannot observe its attention (needed for signal='observed' and sliding windows)"
        )
    with _lock:
        for name in modules:
            module = sys.modules[name]
            if name in _patched:
                original, count = _patched[name]
                _patched[name] = (original, count + 1)
            else:
                original = getattr(module, ATTR)
                _patched[name] = (original, 1)
                setattr(module, ATTR, _wrap(original))
    return AttentionHook(modules)

