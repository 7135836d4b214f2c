"""The registry of shipped part classes: the parts whose decode outputs the cache trusts without a check.

The shipped packages (kvpolicy-core, kvpolicy-h2o, kvpolicy-cam) mark their own part classes with
:func:`shipped` where they define them; :func:`is_shipped` is exact class identity against that registry.
So trust never follows a name or a module string (a plugin's ``__module__`` proves nothing), nor
inheritance: a plugin's subclass of a shipped part is another class, checked like any plugin part.
:func:`shipped` accepts only classes defined in the source files of a shipped package (the calling
module's file must lie in one of their directories), so a plugin cannot mark its own class by mistake.

What "trusted" means for each kind (kvpolicy_core.cache.step): a selector's decode losers and a
scorer's decode scores are not value-checked; a disposition's decode update (one loser per row) is not
value-checked and its guards run on the device (:meth:`kvpolicy_core.cache.slots.SlotStore.add`). A trusted
part's decode step therefore makes no host sync.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from typing import List, Set, Type

#: the distributions whose parts are trusted, by their import names
SHIPPED_PACKAGES = ("kvpolicy_core", "kvpolicy_h2o", "kvpolicy_cam")
_shipped: Set[type] = set()


def _package_dirs() -> List[str]:
    dirs = []
    for name in SHIPPED_PACKAGES:
        spec = sys.modules[name].__spec__ if name in sys.modules else importlib.util.find_spec(name)
        for path in (spec.submodule_search_locations or []) if spec is not None else []:
            dirs.append(os.path.join(os.path.realpath(path), ""))
    return dirs


def shipped(cls: Type) -> Type:
    """Class decorator of the shipped packages: ``cls`` itself (not its subclasses) is a trusted part.

    Raises TypeError when the decorating module is not a source file of a shipped package."""
    caller = os.path.realpath(sys._getframe(1).f_code.co_filename)
    if not caller.startswith(tuple(_package_dirs())):
        raise TypeError(
            f"{cls.__qualname__}: only kvpolicy's shipped packages {SHIPPED_PACKAGES} mark their parts "
            f"as shipped (defined in {caller}); a plugin's parts are always checked"
        )
    _shipped.add(cls)
    return cls


def is_shipped(part) -> bool:
    """Whether ``part`` is an instance of a class marked :func:`shipped` (exactly that class)."""
    return type(part) in _shipped
