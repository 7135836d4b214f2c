"""The compiled decode traces of parts (:mod:`.compiled`, :meth:`.slots.SlotStore.write`), shared by every layer's
cache using a part and held in a map keyed weakly by the part: once no cache uses a policy, its parts and their
traces are freed (a server building caches per request)."""

from __future__ import annotations

import weakref
from typing import Any, Callable

_cache: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def weak(part) -> Callable[[], Any]:
    """A reference to ``part`` for a cached wrapper: weak where it can be (a wrapper that held its key strongly
    would keep every policy's part and traces alive forever); a part that is not weak-referenceable is not cached
    (:func:`per_part`), so its wrapper may hold it."""
    try:
        return weakref.ref(part)
    except TypeError:
        return lambda: part


def per_part(part, key, make: Callable):
    """The wrapper ``key`` of ``part``, made by ``make()`` on first use; a new one per call for a part that is not
    weak-referenceable."""
    try:
        per = _cache.get(part)
        if per is None:
            per = _cache[part] = {}
    except TypeError:
        return make()
    if key not in per:
        per[key] = make()
    return per[key]
