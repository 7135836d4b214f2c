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

The registry also holds the engine's optimisation traits of shipped parts (:class:`Traits`, given as
``@shipped(compile_decode=True)``): how the engine runs a part, not part of the plugin contract
(docs/plugins/minimal.md). Unlike trust, a trait follows inheritance (it changes only how fast the part's own
code runs), and the 0.2 class flags of the same names are still read from plugin parts, with a
DeprecationWarning.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import warnings
from dataclasses import dataclass
from typing import Dict, List, Type

#: the distributions whose parts are trusted, by their import names
SHIPPED_PACKAGES = ("kvpolicy_core", "kvpolicy_h2o", "kvpolicy_cam")


@dataclass(frozen=True)
class Traits:
    """How the engine runs a shipped part (engine-internal; plugins declare only ``Needs``).

    ``compile_decode``: its decode steps (one loser per row) run as one compiled MLX graph
    (:mod:`kvpolicy_core.cache.compiled`): the part makes no host sync, and if tracing fails the engine falls
    back to the eager call. ``key_norms``: it reads ``view.key_norms`` at every eviction, so the cache keeps
    them from the first token (others get them kept from their first read on).
    """

    compile_decode: bool = False
    key_norms: bool = False


#: shipped part class -> its traits (the classes themselves are the trusted ones)
_shipped: Dict[type, Traits] = {}
#: the 0.2 class flags that became traits, still read from plugin parts (deprecated)
OLD_TRAIT_FLAGS = {"compile_decode": "compile_decode", "uses_key_norms": "key_norms"}
_warned: set = set()


def _package_dirs() -> List[str]:
    dirs = []
    for name in SHIPPED_PACKAGES:
        spec = sys.modules[name].__spec__ if name in sys.modules else importlib.util.find_spec(name)
        for path in (spec.submodule_search_locations or []) if spec is not None else []:
            dirs.append(os.path.join(os.path.realpath(path), ""))
    return dirs


def shipped(cls: Type = None, **traits):
    """Class decorator of the shipped packages: ``cls`` itself (not its subclasses) is a trusted part, run
    with ``traits`` (:class:`Traits` fields): ``@shipped`` or ``@shipped(compile_decode=True)``.

    Raises TypeError when the decorating module is not a source file of a shipped package."""
    caller = os.path.realpath(sys._getframe(1).f_code.co_filename)
    given = Traits(**traits)

    def mark(cls: Type) -> Type:
        if not caller.startswith(tuple(_package_dirs())):
            raise TypeError(
                f"{cls.__qualname__}: only kvpolicy's shipped packages {SHIPPED_PACKAGES} mark their parts "
                f"as shipped (defined in {caller}); a plugin's parts are always checked"
            )
        _shipped[cls] = given
        return cls

    return mark if cls is None else mark(cls)


def is_shipped(part) -> bool:
    """Whether ``part`` is an instance of a class marked :func:`shipped` (exactly that class)."""
    return type(part) in _shipped


def traits_of(part) -> Traits:
    """The engine traits of ``part``: those of the nearest shipped class in its class's MRO (a plugin's
    subclass of a shipped part runs the same way, checked), overridden by a 0.2 flag the part still sets
    (``compile_decode = True``, ``uses_key_norms = True``; a DeprecationWarning for a plugin's part)."""
    traits = next((_shipped[c] for c in type(part).__mro__ if c in _shipped), Traits())
    old = {}
    for flag, field in OLD_TRAIT_FLAGS.items():
        value = getattr(part, flag, None)
        if value is None or callable(value):
            continue
        old[field] = bool(value)
        cls = type(part)
        if cls not in _shipped and (cls, flag) not in _warned:
            _warned.add((cls, flag))
            instead = (
                "key norms need no declaration (view.key_norms is always there)"
                if field == "key_norms"
                else "compiled decode steps are an engine optimisation of shipped parts"
            )
            warnings.warn(
                f"{cls.__module__}.{cls.__qualname__} sets {flag!r}, deprecated: {instead} "
                "(docs/plugins/minimal.md; the old flag is still read)",
                DeprecationWarning,
                stacklevel=4,
            )
    return Traits(**{**traits.__dict__, **old}) if old else traits
