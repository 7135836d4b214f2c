"""Counting host syncs: every way Python code can make MLX wait for the device and read an array back.

:class:`HostSyncs` patches, while it is active, ``mx.eval`` and ``mx.synchronize``, the methods of
``mx.array`` that evaluate and read back (``item``, ``tolist``, ``__bool__``, ``__int__``, ``__float__``,
``__index__``, ``__complex__``, ``__array__``, ``__bytes__``, ``__repr__`` (``str()`` too), ``__format__``,
``__dlpack__``, ``__getstate__``, ``__copy__``, ``__deepcopy__``) and numpy's array constructors (numpy reads
an ``mx.array`` through the buffer protocol, which no Python method sees). Each call is recorded with the
name of what was called, but only while some frame on the Python stack runs code of the ``packages``
watched (by file), so mlx-lm's own read of the sampled token is not counted. Patching the type catches what
``sys.setprofile`` cannot: ``bool(array)``, ``if array:`` and ``int(array)`` go through type slots, not calls.
"""

from __future__ import annotations

import builtins
import os
import sys
from typing import Dict, List, Sequence

import mlx.core as mx
import numpy as np

ARRAY_READS = (
    "item",
    "tolist",
    "__bool__",
    "__int__",
    "__float__",
    "__index__",
    "__complex__",
    "__array__",
    "__bytes__",
    "__repr__",
    "__format__",
    "__dlpack__",
    "__getstate__",
    "__copy__",
    "__deepcopy__",
)
MX_SYNCS = ("eval", "synchronize")
NP_READS = ("array", "asarray", "asanyarray", "ascontiguousarray", "frombuffer")
_ABSENT = object()


def package_dirs(names: Sequence[str]) -> List[str]:
    """The source directories of the importable packages ``names`` (with a trailing separator)."""
    dirs = []
    for name in names:
        module = __import__(name)
        dirs += [os.path.join(os.path.realpath(p), "") for p in module.__path__]
    return dirs


class HostSyncs:
    """``with HostSyncs(["kvpolicy_core", ...]) as syncs:`` ... ``syncs.calls``: one name per host sync made
    while code of those packages was on the stack (``syncs.reset()`` starts a new count)."""

    def __init__(self, packages: Sequence[str]) -> None:
        self.dirs = tuple(package_dirs(packages))
        self.calls: List[str] = []
        self._saved: List = []

    def reset(self) -> None:
        self.calls = []

    def by_name(self) -> Dict[str, int]:
        out: Dict[str, int] = {}
        for c in self.calls:
            out[c] = out.get(c, 0) + 1
        return out

    def _watched(self) -> bool:
        f = sys._getframe(2)
        while f is not None:
            if f.f_code.co_filename.startswith(self.dirs):
                return True
            f = f.f_back
        return False

    def _wrap(self, name: str, fn, only_arrays: bool = False):
        def counted(*args, **kwargs):
            if (not only_arrays or any(isinstance(a, mx.array) for a in args[:1])) and self._watched():
                self.calls.append(name)
            return fn(*args, **kwargs)

        return counted

    def _patch(self, owner, attr: str, new) -> None:
        self._saved.append((owner, attr, vars(owner).get(attr, _ABSENT)))
        setattr(owner, attr, new)

    def __enter__(self) -> "HostSyncs":
        for name in ARRAY_READS:
            self._patch(mx.array, name, self._wrap(f"array.{name}", getattr(mx.array, name)))
        for name in MX_SYNCS:
            if hasattr(mx, name):
                self._patch(mx, name, self._wrap(f"mx.{name}", getattr(mx, name)))
        for name in NP_READS:
            self._patch(np, name, self._wrap(f"np.{name}", getattr(np, name), only_arrays=True))
        self._patch(builtins, "memoryview", self._wrap("memoryview", builtins.memoryview, only_arrays=True))
        return self

    def __exit__(self, *exc) -> None:
        for owner, attr, old in reversed(self._saved):
            if old is _ABSENT:
                delattr(owner, attr)
            else:
                setattr(owner, attr, old)
        self._saved = []
