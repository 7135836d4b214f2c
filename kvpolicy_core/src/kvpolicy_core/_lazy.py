"""Import plumbing of the package root: names loaded on first access (so that importing a package imports
nothing heavy) and work done right after another package's module is imported (:func:`after_import`)."""

from __future__ import annotations

import importlib
import importlib.abc
import sys
from typing import Callable, Dict, List, Tuple


def lazy_exports(package: str, exports: Dict[str, str]) -> Tuple[Callable, Callable]:
    """``(__getattr__, __dir__)`` for ``package``: ``exports`` maps a name to the module (relative to the
    package) that defines it; the module is imported the first time the name is asked for."""
    module = importlib.import_module(package)

    def __getattr__(name: str):
        if name in exports:
            value = getattr(importlib.import_module(exports[name], package), name)
            setattr(module, name, value)
            return value
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__():
        return sorted(set(vars(module)) | set(exports))

    return __getattr__, __dir__


class _Then(importlib.abc.Loader):
    """Runs the module's own loader, then the callbacks (each once); anything else is the own loader's."""

    def __init__(self, loader, callbacks: List[Callable]) -> None:
        self.loader = loader
        self.callbacks = callbacks

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        self.loader.exec_module(module)
        while self.callbacks:
            self.callbacks.pop(0)(module)

    def __getattr__(self, name: str):  # get_source, is_package, get_resource_reader, ...
        if name == "loader":
            raise AttributeError(name)
        return getattr(self.loader, name)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for a watched module it returns the spec the other finders give, with a loader
    that runs the callbacks once the module has run (so a callback sees the whole module)."""

    def __init__(self) -> None:
        self.watched: Dict[str, List[Callable]] = {}

    def find_spec(self, fullname, path, target=None):
        callbacks = self.watched.get(fullname)
        if not callbacks:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        if self.watched.pop(fullname, None) is None:  # taken meanwhile: a finder asked above asked this one again
            return spec
        spec.loader = _Then(spec.loader, callbacks)
        return spec


_FINDER = _AfterImport()


def after_import(name: str, callback: Callable) -> None:
    """Call ``callback(module)`` once module ``name`` is imported: now if it already is, else right after its
    import (in whatever order the two packages are imported; the first import of ``name`` runs it)."""
    if name in sys.modules:
        callback(sys.modules[name])
        return
    _FINDER.watched.setdefault(name, []).append(callback)
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
