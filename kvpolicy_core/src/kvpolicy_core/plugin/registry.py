"""The registry of named policy parts and methods, filled once from the plugins.

Plugins register through the hooks in :mod:`kvpolicy_core.plugin.hookspecs`; each hook
implementation is called separately with a ``register`` callback bound to its
plugin's name, so duplicate names and failures can be attributed to a plugin.
The shipped distributions (:data:`SHIPPED`) own the names they register: a clash
always skips the other plugin's registration, never theirs.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.metadata
import re
import warnings
from typing import Any, Callable, Dict, List, Optional, Union

from pydantic import BaseModel

from ..config.policy_config import PolicyConfig
from ..errors import ConfigError, PluginError, UnknownMethodError

PartName = Union[str, Callable[[Any], str]]


@dataclasses.dataclass(frozen=True)
class MethodSpec:
    """An eviction method: a name, its pydantic config class and the parts it composes.

    ``scorer``, ``selector`` and ``disposition`` are registered part names, or
    callables ``config -> name`` when the choice depends on the config (CaM picks
    ``drop`` when ``merge="drop"``). ``ignores`` names shared
    :class:`PolicyConfig` fields the method's parts do not read (``kvpolicy methods`` says so).
    """

    name: str
    config_class: type
    scorer: PartName
    selector: PartName
    disposition: PartName
    description: str = ""
    ignores: tuple = ()

    def part_names(self, config) -> Dict[str, str]:
        """The part names this method composes for ``config``."""
        pick = lambda p: p(config) if callable(p) else p  # noqa: E731
        return {
            "scorer": pick(self.scorer),
            "selector": pick(self.selector),
            "disposition": pick(self.disposition),
        }


@dataclasses.dataclass(frozen=True)
class Registered:
    """One registered object and the plugin (and distribution) that registered it."""

    obj: Any
    plugin: str  #: the plugin's entry-point name (or the name given to ``register_plugin``)
    dist: Optional[str] = None
    version: Optional[str] = None

    @property
    def source(self) -> str:
        """The plugin's identity, ``"<dist>:<plugin>"`` (``"kvpolicy-h2o:h2o"``), or ``plugin`` without a dist."""
        return f"{self.dist}:{self.plugin}" if self.dist else self.plugin


@dataclasses.dataclass(frozen=True)
class Conflict:
    """A name two plugins registered: ``kept`` (a plugin's :attr:`Registered.source`) keeps it, ``skipped``'s
    registration of it is not used."""

    kind: str
    name: str
    kept: str
    skipped: str
    message: str


class NameClash(PluginError):
    """A plugin registered a name another plugin already holds (recorded in :attr:`Registry.conflicts`)."""


KINDS = ("scorers", "selectors", "dispositions", "allocations", "methods")


class Registry:
    """Named scorers, selectors, dispositions and methods, and what went wrong while filling them.

    ``failures``: one message per plugin that failed to load or register, and per name clash (``kvpolicy
    methods`` shows them); ``conflicts``: the name clashes, who kept the name and who was skipped;
    ``blocked``: the plugins ``KVPOLICY_BLOCK_PLUGINS`` kept out (``"<dist>:<name>"``).
    """

    def __init__(self) -> None:
        self.parts: Dict[str, Dict[str, Registered]] = {k: {} for k in KINDS}
        self.failures: List[str] = []
        self.conflicts: List[Conflict] = []
        self.blocked: List[str] = []
        #: (kind, name) -> the clash message: under ``KVPOLICY_STRICT_PLUGINS=1`` a name two plugins registered is
        #: refused (its lookups raise), while every other name of both plugins stays usable
        self.refused: Dict[tuple, str] = {}

    # -- filling ---------------------------------------------------------------------------
    def add(self, kind: str, name: str, obj: Any, plugin: str, dist=None, version=None) -> None:
        """Register ``obj`` as ``name``; a name already held raises :class:`NameClash` (recorded in
        :attr:`conflicts`): the first registrant keeps it (shipped distributions register first)."""
        table = self.parts[kind]
        if not isinstance(name, str) or not name.isidentifier():
            raise PluginError(f"plugin {plugin!r} registered a {kind[:-1]} with an invalid name {name!r}")
        if name in table:
            other, new = table[name], Registered(obj, plugin, dist, version)
            if shipped_rank(other.dist) < len(SHIPPED):
                why = f"the name belongs to the shipped distribution {other.dist}"
            else:
                why = "plugins register in a fixed order, the shipped distributions first, then by distribution name"
            message = (
                f"{kind[:-1]} {name!r} is registered twice: plugin {plugin!r}{_from(dist)} tried to take the "
                f"name, which plugin {other.plugin!r}{_from(other.dist)} already registered; {why}, so "
                f"{other.source!r} keeps it (rename {name!r} in {dist or plugin!r}, or block the plugin with "
                f"KVPOLICY_BLOCK_PLUGINS={new.source})"
            )
            self.conflicts.append(Conflict(kind, name, other.source, new.source, message))
            raise NameClash(message)
        table[name] = Registered(obj, plugin, dist, version)

    # -- lookup ----------------------------------------------------------------------------
    def check_refused(self, kind: str, name: str) -> None:
        """Raise :class:`~kvpolicy_core.errors.PluginError` if strict mode refused ``name`` of ``kind`` (a clash)."""
        message = self.refused.get((kind, name))
        if message is not None:
            raise PluginError(
                f"kvpolicy: {message}; KVPOLICY_STRICT_PLUGINS=1 refuses the name until the clash is gone"
            )

    def method(self, name: str) -> MethodSpec:
        """The method called ``name``, or an error listing the installed ones."""
        self.check_refused("methods", name)
        table = self.parts["methods"]
        if name not in table:
            installed = ", ".join(sorted(table)) or "none"
            raise UnknownMethodError(
                f"unknown method {name!r}; installed methods: {installed}. {self._why_missing(name, sorted(table))}"
            )
        return table[name].obj

    def _why_missing(self, method: str, installed: List[str]) -> str:
        """Why a method is not registered: its plugin (``kvpolicy-<method>``) is blocked; or a name close to an
        installed one (another case, a typo: ``H2O``, ``h20``) gets "did you mean"; else whether its plugin is
        installed (and did not register it) or the ``pip install`` that adds it."""
        dist = f"kvpolicy-{method}"
        blocked = [b for b in self.blocked if normalize_dist(b.partition(":")[0]) == normalize_dist(dist)]
        if blocked:
            return f"{dist} is installed, but KVPOLICY_BLOCK_PLUGINS blocks its plugin ({', '.join(blocked)})"
        close = [m for m in installed if m.lower() == method.lower()]
        close = close or difflib.get_close_matches(method.lower(), installed, n=3, cutoff=0.6)
        if close:
            return f"did you mean {' or '.join(repr(m) for m in close)}? (method names are lower case)"
        failed = f" ({len(self.failures)} plugin problems: `kvpolicy methods` lists them)" if self.failures else ""
        if _installed(dist):
            return f"{dist} is installed but did not register {method!r}{failed}"
        return f"To add it, install its plugin: pip install {dist}{failed}"

    def part(self, kind: str, name: str, field: str) -> Registered:
        """The part ``name`` of ``kind`` (``"allocations"``, ...) that config field ``field`` names, or a
        :class:`ConfigError` naming the field and the registered names."""
        self.check_refused(kind, name)
        table = self.parts[kind]
        if name not in table:
            raise ConfigError(
                f"{field}: no {kind[:-1]} named {name!r} is registered; known: {', '.join(sorted(table))}"
            )
        return table[name]

    def methods(self) -> Dict[str, Registered]:
        return dict(self.parts["methods"])


def _from(dist: Optional[str]) -> str:
    return f" (from {dist})" if dist else ""


def _installed(dist: str) -> bool:
    try:
        importlib.metadata.distribution(dist)
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return False
    return True


#: The distributions shipped together: their plugins register before any third-party plugin and own their names.
SHIPPED = ("kvpolicy-core", "kvpolicy-h2o", "kvpolicy-cam")


def normalize_dist(name: str) -> str:
    """A distribution name as packaging compares it (PEP 503): ``Other_Pkg`` -> ``other-pkg``."""
    return re.sub(r"[-_.]+", "-", name).lower()


def shipped_rank(dist: Optional[str]) -> int:
    """The position of ``dist`` in :data:`SHIPPED` (``len(SHIPPED)`` for any other distribution or none)."""
    own = normalize_dist(dist) if dist else None
    return next((i for i, name in enumerate(SHIPPED) if name == own), len(SHIPPED))


def _check_method(spec: Any, plugin: str) -> None:
    if not isinstance(spec, MethodSpec):
        raise PluginError(f"plugin {plugin!r} registered {spec!r}, which is not a MethodSpec")
    cls = spec.config_class
    if not (isinstance(cls, type) and issubclass(cls, BaseModel) and issubclass(cls, PolicyConfig)):
        raise PluginError(
            f"plugin {plugin!r} registered method {spec.name!r} with config class {cls!r}, "
            "which is not a subclass of kvpolicy_core.PolicyConfig"
        )
    try:
        cls()
    except Exception as exc:  # the defaults must make a valid config
        raise PluginError(
            f"plugin {plugin!r} registered method {spec.name!r} whose config class "
            f"{cls.__name__} has invalid defaults: {exc}"
        ) from exc


def fill(registry: Registry, pm, strict: bool) -> None:
    """Call every plugin's registration hooks, one plugin at a time.

    A plugin whose hook raises (``SystemExit`` included), or that registers something invalid,
    is reported (warning, or :class:`PluginError` when ``strict``) and its own registrations
    of that kind are rolled back; the other plugins carry on. A name another plugin already
    registered is reported (a warning) and only that registration is skipped; under ``strict`` the name
    itself is refused (:attr:`Registry.refused`: looking it up raises), and every other name stays usable.
    Shipped plugins (:data:`SHIPPED`) register first, so a clash never takes a shipped name away; the other
    plugins register in ``pm``'s registration order (entry points by distribution name).
    """
    for kind in KINDS:
        caller = getattr(pm.hook, f"register_{kind}")
        impls = list(caller.get_hookimpls())  # registration order (pluggy calls them in reverse)
        impls.sort(key=lambda impl: shipped_rank(pm.dist_of(impl.plugin_name)[0]))  # stable: shipped first
        for impl in impls:
            dist, version = pm.dist_of(impl.plugin_name)
            plugin = pm.label_of(impl.plugin_name)
            added: List[str] = []

            def register(*args, _plugin=plugin, _kind=kind, _added=added, _d=dist, _v=version):
                if _kind == "methods":
                    (spec,) = args
                    _check_method(spec, _plugin)
                    name, obj = spec.name, spec
                else:
                    name, obj = args
                try:
                    registry.add(_kind, name, obj, _plugin, _d, _v)
                except NameClash as clash:  # only this registration is skipped; the plugin's others stand
                    if strict:  # the name itself is refused (the kept registration too); nothing else is
                        registry.refused[(_kind, name)] = str(clash)
                    skipped = registry.conflicts[-1].skipped
                    message = f"kvpolicy: {clash}; the {_kind[:-1]} {name!r} of {skipped!r} is skipped"
                    registry.failures.append(message)
                    warnings.warn(message, RuntimeWarning, stacklevel=2)
                    return
                _added.append(name)

            try:
                impl.function(register=register)
            except (Exception, SystemExit) as exc:  # a hook's sys.exit() must not end the host program
                for name in added:
                    registry.parts[kind].pop(name, None)
                message = f"kvpolicy: plugin {plugin!r} failed in register_{kind}: {type(exc).__name__}: {exc}"
                if strict:
                    raise PluginError(message) from exc
                registry.failures.append(message)
                warnings.warn(message, RuntimeWarning, stacklevel=2)
