"""Engine traits: how the engine may run a part faster. Optional, and never a matter of trust.

Every part's outputs go through the same checks (:mod:`kvpolicy_core.cache.step`); a trait only changes how
fast the part's own code runs:

- ``compile_decode``: its decode steps (one loser per row) are pure MLX functions of their inputs, so the
  engine runs them as one ``mx.compile`` graph (:mod:`kvpolicy_core.cache.step`: one call instead of a
  dispatch per op). A part that keeps Python state or reads values on the host must not declare it; if tracing fails
  the engine falls back to the eager call.
- ``key_norms``: it reads ``view.key_norms`` at every eviction, so the cache keeps them from the first token
  (other parts get them kept from their first read on).

Declared with ``@traits(compile_decode=True)`` on the class. A subclass inherits ``key_norms``, but
``compile_decode`` only while it keeps the declaring class's decode methods (:data:`COMPILED_METHODS`): a subclass
that overrides ``rank`` or ``dispose`` (say, to keep Python state) runs eager unless it declares the trait itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Type

from ..errors import PluginError


@dataclass(frozen=True)
class Traits:
    """How the engine runs a part (see the module docstring)."""

    compile_decode: bool = False
    key_norms: bool = False


_traits: Dict[type, Traits] = {}
#: the methods ``compile_decode`` runs compiled: a subclass that overrides one does not inherit the trait
COMPILED_METHODS = ("rank", "dispose")
#: removed class flags -> the trait that replaces each: a part that still sets one is refused, naming its replacement
REMOVED_FLAGS = {"compile_decode": "compile_decode", "uses_key_norms": "key_norms"}


def traits(cls: Type = None, **given):
    """Class decorator: ``@traits(compile_decode=True, key_norms=True)`` (or bare ``@traits``)."""
    t = Traits(**given)

    def mark(cls: Type) -> Type:
        _traits[cls] = t
        return cls

    return mark if cls is None else mark(cls)


def traits_of(part) -> Traits:
    """The traits of the nearest class in ``part``'s MRO that declared some (none: :class:`Traits()`), without
    ``compile_decode`` when a class below it overrides one of :data:`COMPILED_METHODS`.

    Raises :class:`~kvpolicy_core.errors.PluginError` for a part that sets a removed class flag
    (:data:`REMOVED_FLAGS`: ``compile_decode = True``, ``uses_key_norms = True``), naming the replacement."""
    for flag, field in REMOVED_FLAGS.items():
        value = getattr(type(part), flag, None)
        if value is not None and not callable(value):
            cls = type(part)
            raise PluginError(
                f"{cls.__module__}.{cls.__qualname__} sets {flag!r}, a 0.2 class flag removed in 0.3: declare "
                f"@kvpolicy_core.parts.traits.traits({field}=True) on the class instead (docs/plugins/hooks.md)"
            )
    mro = type(part).__mro__
    at = next((i for i, c in enumerate(mro) if c in _traits), None)
    if at is None:
        return Traits()
    found = _traits[mro[at]]
    if found.compile_decode and any(m in c.__dict__ for c in mro[:at] for m in COMPILED_METHODS):
        return Traits(compile_decode=False, key_norms=found.key_norms)  # a method the declaring class vouched for
    return found
