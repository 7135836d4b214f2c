"""The registry of named parts and methods, filled once from the plugins' registration hooks (:func:`fill`)."""

from __future__ import annotations

import dataclasses
import re
import warnings
from typing import Any, Callable, Dict, List, Optional, Union

from ..config.policy_config import PolicyConfig
from ..errors import PluginError, UnknownMethodError, blamed

PartName = Union[str, Callable[[Any], str]]
KINDS = ("scorers", "selectors", "dispositions", "allocations", "methods")
#: The distributions shipped together: their plugins register before any other and so keep their names.
SHIPPED = ("kvpolicy-core", "kvpolicy-h2o", "kvpolicy-cam")


@dataclasses.dataclass(frozen=True)
class MethodSpec:
    """An eviction method: a name, its config class (a :class:`PolicyConfig` whose defaults are valid) and the
    parts it composes: registered names, or callables ``config -> name`` (CaM picks ``drop`` when ``merge="drop"``).
    ``ignores``: shared fields its parts never read (``kvpolicy methods`` says so)."""

    name: str
    config_class: type
    scorer: PartName
    selector: PartName
    disposition: PartName
    description: str = ""
    ignores: tuple = ()

    def part_names(self, config) -> Dict[str, str]:
        """The part names this method composes for ``config``."""
        parts = {"scorer": self.scorer, "selector": self.selector, "disposition": self.disposition}
        return {kind: name(config) if callable(name) else name for kind, name in parts.items()}

    def __post_init__(self) -> None:
        if not (isinstance(self.config_class, type) and issubclass(self.config_class, PolicyConfig)):
            raise TypeError(f"{self.config_class!r} is not a subclass of kvpolicy_core.PolicyConfig")
        with blamed(f"method {self.name!r}: the defaults of {self.config_class.__name__} are invalid:"):
            self.config_class()


@dataclasses.dataclass(frozen=True)
class Registered:
    """A registered object and its plugin: entry-point name (or :func:`register_plugin`'s), distribution, version."""

    obj: Any
    plugin: str
    dist: Optional[str] = None
    version: Optional[str] = None


@dataclasses.dataclass(frozen=True)
class Conflict:
    """A name two plugins registered (each ``"<dist>:<name>"``): ``kept`` keeps it, ``skipped``'s is not used."""

    kind: str
    name: str
    kept: str
    skipped: str
    message: str


class Registry:
    """The registered parts by kind, and what went wrong filling them: ``failures`` (a message per failed plugin
    and per clash: ``kvpolicy methods`` shows them), ``conflicts``, ``blocked`` (the plugins ``KVPOLICY_BLOCK_PLUGINS``
    kept out) and ``refused`` ((kind, name) -> the clash: the names ``KVPOLICY_STRICT_PLUGINS=1`` refuses)."""

    def __init__(self) -> None:
        self.parts: Dict[str, Dict[str, Registered]] = {k: {} for k in KINDS}
        self.failures: List[str] = []
        self.conflicts: List[Conflict] = []
        self.blocked: List[str] = []
        self.refused: Dict[tuple, str] = {}

    def check_refused(self, kind: str, name: str) -> None:
        if (kind, name) in self.refused:
            raise PluginError(f"kvpolicy: {self.refused[kind, name]}; KVPOLICY_STRICT_PLUGINS=1 refuses the name")

    def method(self, name: str) -> MethodSpec:
        """The method called ``name`` (:func:`~kvpolicy_core.config.resolve.method_spec` says why one is missing)."""
        self.check_refused("methods", name)
        if name not in self.parts["methods"]:
            raise UnknownMethodError(f"unknown method {name!r}; installed: {', '.join(sorted(self.parts['methods']))}")
        return self.parts["methods"][name].obj

    def methods(self) -> Dict[str, Registered]:
        return dict(self.parts["methods"])


def normalize_dist(name: str) -> str:
    """A distribution name as packaging compares it (PEP 503): ``Other_Pkg`` -> ``other-pkg``."""
    return re.sub(r"[-_.]+", "-", name).lower()


def shipped_rank(dist: Optional[str]) -> int:
    """The position of ``dist`` in :data:`SHIPPED`; ``len(SHIPPED)`` for any other distribution or none."""
    return next((i for i, name in enumerate(SHIPPED) if dist and name == normalize_dist(dist)), len(SHIPPED))


def plugin_id(dist: Optional[str], name: str) -> str:
    """A plugin's identity: ``"<dist>:<entry-point name>"``, or the bare name of one without a distribution."""
    return f"{dist}:{name}" if dist else name


def report(registry: Registry, message: str, strict: bool = False) -> None:
    """A plugin problem: recorded in ``registry.failures`` and warned, or raised when ``strict``."""
    registry.failures.append(message)
    if strict:
        raise PluginError(message)
    warnings.warn(message, RuntimeWarning, stacklevel=3)


def fill(registry: Registry, pm, strict: bool) -> None:
    """Call each plugin's registration hooks, kind by kind, the shipped plugins first, then in ``pm``'s order. A hook
    that raises (``sys.exit()`` too) or registers something invalid is reported (:func:`report`) and its plugin's
    registrations of that kind rolled back. A name another plugin holds is reported and only that registration
    skipped; under ``strict`` the name is refused (:attr:`Registry.refused`), no other name."""
    for kind in KINDS:
        impls = getattr(pm.hook, f"register_{kind}").get_hookimpls()  # registration order (pluggy calls it reversed)
        for impl in sorted(impls, key=lambda impl: shipped_rank(pm.origins[impl.plugin_name][1])):
            plugin, dist, version = pm.origins[impl.plugin_name]
            table, added, me = registry.parts[kind], [], plugin_id(dist, plugin)

            def register(*args, kind=kind, table=table, added=added, plugin=plugin, dist=dist, me=me, v=version):
                name, obj = (getattr(args[0], "name", None), *args) if kind == "methods" else args
                if kind == "methods" and not isinstance(obj, MethodSpec):
                    raise PluginError(f"plugin {plugin!r} registered {obj!r}, which is not a MethodSpec")
                if not isinstance(name, str) or not name.isidentifier():
                    raise PluginError(f"plugin {plugin!r} registered a {kind[:-1]} with an invalid name {name!r}")
                if name not in table:
                    table[name] = Registered(obj, plugin, dist, v)
                    return added.append(name)
                other, by = table[name], (lambda p, d: f"plugin {p!r}" + (f" (from {d})" if d else ""))
                kept, why = plugin_id(other.dist, other.plugin), "plugins register by distribution name"
                if shipped_rank(other.dist) < len(SHIPPED):
                    why = f"the name belongs to the shipped distribution {other.dist}"
                clash = (
                    f"{kind[:-1]} {name!r} is registered twice: {by(plugin, dist)} tried to take the name, which "
                    f"{by(other.plugin, other.dist)} already registered; {why}, so {kept!r} keeps it (rename {name!r} "
                    f"in {dist or plugin!r}, or block the plugin with KVPOLICY_BLOCK_PLUGINS={me})"
                )
                registry.conflicts.append(Conflict(kind, name, kept, me, clash))
                if strict:  # the name itself is refused (the kept registration too); the plugins' others stand
                    registry.refused[kind, name] = clash
                report(registry, f"kvpolicy: {clash}; the {kind[:-1]} {name!r} of {me!r} is skipped")

            try:
                with blamed(f"kvpolicy: plugin {plugin!r} failed in register_{kind}:"):
                    impl.function(register=register)
            except PluginError as exc:
                for name in added:
                    del table[name]
                report(registry, str(exc), strict)
