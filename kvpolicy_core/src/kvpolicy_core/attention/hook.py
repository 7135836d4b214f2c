"""Opt-in observation of the model's real attention, at mlx-lm's one meeting point.

mlx-lm model modules import ``scaled_dot_product_attention`` by name from
``mlx_lm.models.base``; that call is the only place where queries, keys, the cache and
the mask meet. :func:`install` replaces the name in the modules a given model uses
with a wrapper that, for kvpolicy caches only (their class's ``kvpolicy_attention``: ``"single"`` for
:class:`~kvpolicy_core.cache.policy_cache.PolicyCache`, ``"batch"`` for its batch), lets the cache see the queries (for
``signal="observed"``) and substitute a per-layer sliding-window mask; for any other
cache it calls the original unchanged. A single-sequence cache whose scorer takes the model's
weights computes the attention once and hands the weights to the scorer
(:meth:`PolicyCache.attend <kvpolicy_core.cache.policy_cache.PolicyCache.attend>`); attention sinks (gpt-oss)
always take mlx-lm's kernel. Installs are reference counted per module and
undone by :meth:`AttentionHook.remove`, or when the handle is garbage: the caches that need
the hook hold its handle, so the hook lives exactly as long as they do (one user's
``detach`` cannot break another user's caches).

A handle is named by its modules (:attr:`AttentionHook.modules`), so a cache restored in another
process installs the same hook again: a pickled handle re-installs on unpickling, and a cache's
saved meta records the module names (:func:`install_modules`).
"""

from __future__ import annotations

import importlib
import sys
import threading
import weakref
from typing import Dict, List, Sequence

from ..errors import ModelError
from .weights import quantized_attention_with_weights

_lock = threading.RLock()  # re-entrant: a handle may be collected while the lock is held
_patched: Dict[str, tuple] = {}  # module name -> (original fn, refcount)
ATTR = "scaled_dot_product_attention"
#: modules a restored cache may import by name (a saved file names them; any other module must already be imported)
IMPORTABLE_PREFIX = "mlx_lm.models."


def _wrap(original):
    def scaled_dot_product_attention(queries, keys, values, cache, scale, mask, *args, **kwargs):
        kind = getattr(type(cache), "kvpolicy_attention", None)  # "single" (PolicyCache), "batch", None: another
        if kind is not None:
            sinks = args[0] if args else kwargs.get("sinks")
            if kind == "single" and sinks is None and len(args) <= 1:
                return cache.attend(queries, keys, values, scale, mask, original)
            mask = cache.before_attention(queries, scale, mask)
            if getattr(cache, "bits", None) is not None and sinks is None:  # quantized rows, masks per KV head
                out = quantized_attention_with_weights(
                    queries, keys, values, scale, mask, cache.group_size, cache.bits
                )[0]
            else:
                out = original(queries, keys, values, cache, scale, mask, *args, **kwargs)
            return cache.after_attention(out, values)  # a data-driven allocation measures the output
        return original(queries, keys, values, cache, scale, mask, *args, **kwargs)

    scaled_dot_product_attention.__wrapped__ = original
    scaled_dot_product_attention._kvpolicy = True
    return scaled_dot_product_attention


def model_modules(model) -> List[str]:
    """The names of the modules of ``model`` that call mlx-lm's attention by name (what :func:`install` patches)."""
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
        self._holders = weakref.WeakSet()  # the caches holding this install: told when it is removed

    def hold(self, cache) -> None:
        """``cache`` holds this install: :meth:`remove` tells it (its next update checks the hook again)."""
        self._holders.add(cache)

    @property
    def active(self) -> bool:
        return self._finalizer.alive

    def remove(self) -> None:
        """Undo this install now (idempotent); the caches holding it check the hook again at their next update."""
        self._finalizer()
        for cache in list(getattr(self, "_holders", ())):
            cache.hook_removed()

    def __copy__(self) -> "AttentionHook":
        return self  # a copied cache holds the same install (a copied finalizer would be dead)

    def __deepcopy__(self, memo) -> "AttentionHook":
        return self

    def __reduce__(self):
        """Pickled, a live handle is its module names: unpickling installs the hook on them again (in any
        process); a removed one unpickles removed."""
        return (install_modules if self.active else _removed, (list(self.modules),))


def _removed(modules: List[str]) -> AttentionHook:
    hook = AttentionHook.__new__(AttentionHook)
    hook.modules = modules
    hook._finalizer = weakref.finalize(hook, lambda: None)
    hook._finalizer.detach()
    hook._holders = weakref.WeakSet()
    return hook


def _module(name: str):
    """The module ``name`` that calls mlx-lm's attention by name, imported if it is one of mlx-lm's models."""
    if not isinstance(name, str) or not name:
        raise ModelError(f"attention hook: module names must be non-empty strings (got {name!r})")
    module = sys.modules.get(name)
    if module is None and name.startswith(IMPORTABLE_PREFIX):
        try:
            module = importlib.import_module(name)
        except ImportError as exc:
            raise ModelError(f"attention hook: cannot import {name} ({type(exc).__name__}: {exc})") from None
    if module is None:
        raise ModelError(
            f"attention hook: module {name} is not imported (only mlx-lm's own model modules are "
            "imported by name); load the model first, or restore with model="
        )
    if not callable(getattr(module, ATTR, None)):
        raise ModelError(f"attention hook: module {name} has no {ATTR}, so kvpolicy cannot observe its attention")
    return module


def install_modules(modules: Sequence[str]) -> AttentionHook:
    """Route the attention of the modules named ``modules`` through kvpolicy caches; returns the handle.

    What :func:`install` does for a model, by module name (a restored cache's meta records them). A name
    that is not imported is imported only if it is one of mlx-lm's model modules (``mlx_lm.models.*``).
    Raises :class:`~kvpolicy_core.errors.ModelError` (nothing installed) for a module that cannot be
    imported or does not call mlx-lm's attention by name.
    """
    names = sorted(set(modules))
    if not names:
        raise ModelError("attention hook: no module to install it on")
    with _lock:
        found = [_module(name) for name in names]  # all checked before anything is patched
        for name, module in zip(names, found):
            if name in _patched:
                original, count = _patched[name]
                _patched[name] = (original, count + 1)
            else:
                original = getattr(module, ATTR)
                _patched[name] = (original, 1)
                setattr(module, ATTR, _wrap(original))
    return AttentionHook(names)


def install(model) -> AttentionHook:
    """Route the attention of ``model``'s modules through kvpolicy caches; returns the handle.

    Raises :class:`~kvpolicy_core.errors.ModelError` if the model computes attention
    without mlx-lm's ``scaled_dot_product_attention``.
    """
    modules = model_modules(model)
    if not modules:
        raise ModelError(
            f"{type(model).__name__}: no module of this model calls mlx-lm's scaled_dot_product_attention, "
            "so kvpolicy cannot observe its attention (needed for signal='observed' and sliding windows)"
        )
    return install_modules(modules)
