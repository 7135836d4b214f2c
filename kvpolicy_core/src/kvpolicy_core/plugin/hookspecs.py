"""Hook specifications of the ``kvpolicy`` project (pluggy).

Plugins implement these hooks with :data:`hookimpl` and are found through the
``kvpolicy`` entry-point group. Every hook is a *registration* hook: it is called
once, when the registry is first used, with a ``register`` callback. Nothing here
is called per token; the cache calls the registered plain objects directly. The
release that introduced each hook: the versions table of docs/plugins/hooks.md.
"""

from __future__ import annotations

import pluggy

hookspec = pluggy.HookspecMarker("kvpolicy")
hookimpl = pluggy.HookimplMarker("kvpolicy")


@hookspec
def register_scorers(register):
    """Register scorer classes: how important is each retained token.

    Call ``register(name, scorer_cls)`` once per scorer. ``scorer_cls`` is called
    with keyword arguments taken from the method's config and must return an
    object implementing :class:`kvpolicy_core.parts.base.Scorer`.
    """


@hookspec
def register_selectors(register):
    """Register selector classes: which retained tokens lose when over budget.

    Call ``register(name, selector_cls)``; instances implement
    :class:`kvpolicy_core.parts.base.Selector`.
    """


@hookspec
def register_dispositions(register):
    """Register disposition classes: what happens to a loser (drop, merge, ...).

    Call ``register(name, disposition_cls)``; instances implement
    :class:`kvpolicy_core.parts.base.Disposition`.
    """


@hookspec
def register_allocations(register):
    """Register allocations: how a method's budget is shared between layers (a schedule part).

    Call ``register(name, allocation_cls)``; instances implement
    :class:`kvpolicy_core.parts.allocation.Allocation`. A method's config picks one with
    ``allocation="<name>"``; core registers ``reach`` (the default), ``uniform`` and ``pyramid``.
    """


@hookspec
def register_methods(register):
    """Register eviction methods: a name, a config class and a composition.

    Call ``register(MethodSpec(...))`` (see :class:`kvpolicy_core.plugin.registry.MethodSpec`).
    The method name becomes selectable as ``method="<name>"`` and as the config
    string ``"<name>:field=value,..."``. Method names are global: registering a
    name that another plugin already registered is reported naming both plugins and
    their distributions, and skipped (the shipped distributions keep their names).
    """
