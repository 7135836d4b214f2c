"""Import plumbing of the package root: names loaded on first access (so that importing a package imports
nothing heavy)."""

from __future__ import annotations

import importlib
from typing import Callable, Dict, Tuple


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
