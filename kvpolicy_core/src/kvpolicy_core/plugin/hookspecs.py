"""The registration hooks of the ``kvpolicy`` entry-point group (pluggy), called once; docs/plugins/hooks.md."""

import pluggy

hookspec = pluggy.HookspecMarker("kvpolicy")
hookimpl = pluggy.HookimplMarker("kvpolicy")


@hookspec
def register_scorers(register):
    """``register(name, scorer_cls)``: how important each token is (:class:`kvpolicy_core.parts.base.Scorer`)."""


@hookspec
def register_selectors(register):
    """``register(name, selector_cls)``: which tokens lose when over budget (:class:`~kvpolicy_core.Selector`)."""


@hookspec
def register_dispositions(register):
    """``register(name, disposition_cls)``: a loser dropped, merged... (:class:`~kvpolicy_core.Disposition`)."""


@hookspec
def register_allocations(register):
    """``register(name, allocation_cls)``: a budget shared between layers (:class:`~kvpolicy_core.Allocation`), picked
    with ``allocation="<name>"``; core registers ``reach`` (the default), ``uniform``, ``pyramid`` and ``hybrid``."""


@hookspec
def register_methods(register):
    """``register(MethodSpec(...))``: ``method="<name>"``, ``"<name>:field=value,..."``. A name another plugin took is
    reported naming both plugins and skipped (the shipped distributions keep theirs)."""
