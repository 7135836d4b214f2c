"""Plugin discovery: pluggy plus the ``kvpolicy`` entry-point group, loaded lazily.

A plugin is known by its distribution and its entry-point name, ``"<dist>:<name>"`` (``kvpolicy-h2o:h2o``),
so two distributions may use one entry-point name without either hiding the other. Entry points load in a
fixed order, the shipped distributions (:data:`~kvpolicy_core.plugin.registry.SHIPPED`) first, then the others by
distribution name, so which plugin wins a name clash never depends on ``sys.path`` order.

Environment variables:

* ``KVPOLICY_STRICT_PLUGINS=1`` -- a plugin that fails to import or register, or registers a name another
  plugin owns, raises :class:`~kvpolicy_core.errors.PluginError` instead of being skipped with a warning
  (for the CI of plugin authors).
* ``KVPOLICY_BLOCK_PLUGINS=item,...`` -- plugins that are not loaded. An item is a distribution name
  (``other-pkg``: all its entry points; compared normalized, ``Other_Pkg`` is ``other-pkg``), ``dist:name``
  (that distribution's entry point ``name``), or a bare entry-point name (``h2o``: every entry point so
  named, whichever distribution declares it; also the name given to :func:`register_plugin`).
  kvpolicy-core's built-in parts cannot be blocked.
"""

from __future__ import annotations

import importlib.metadata
import os
import threading
import warnings
from typing import Dict, Iterable, Optional, Tuple

import pluggy

from ..errors import PluginError
from . import builtin, hookspecs
from .registry import Registry, fill, normalize_dist, shipped_rank

ENTRY_POINT_GROUP = "kvpolicy"
_lock = threading.RLock()
_registry: Optional[Registry] = None
_extra_plugins: Dict[str, object] = {}


def strict_plugins() -> bool:
    return os.environ.get("KVPOLICY_STRICT_PLUGINS", "").strip().lower() in ("1", "true", "yes", "on")


def blocked_plugins() -> set:
    raw = os.environ.get("KVPOLICY_BLOCK_PLUGINS", "")
    return {name.strip() for name in raw.split(",") if name.strip()}


def is_blocked(blocked: Iterable[str], dist: Optional[str], name: str) -> bool:
    """Whether an item of ``KVPOLICY_BLOCK_PLUGINS`` names entry point ``name`` of distribution ``dist``."""
    own = normalize_dist(dist) if dist else None
    for item in blocked:
        item_dist, colon, item_name = item.partition(":")
        if colon:
            if own is not None and normalize_dist(item_dist) == own and item_name.strip() == name:
                return True
        elif item == name or (own is not None and normalize_dist(item) == own):
            return True
    return False


def plugin_id(dist: Optional[str], name: str) -> str:
    """A plugin's identity: ``"<dist>:<entry-point name>"``, or the bare name of a plugin without a distribution."""
    return f"{dist}:{name}" if dist else name


class PluginManager(pluggy.PluginManager):
    """pluggy's manager that remembers which distribution each plugin came from."""

    def __init__(self) -> None:
        super().__init__("kvpolicy")
        self.add_hookspecs(hookspecs)
        self._origins: Dict[str, Tuple[str, Optional[str], Optional[str]]] = {}

    def register_from(self, plugin, name: str, dist=None, version=None, label: Optional[str] = None) -> None:
        """Register ``plugin`` under the unique pluggy ``name``; ``label`` (default ``name``) is the plugin's
        name in messages and in :attr:`~kvpolicy_core.plugin.registry.Registered.plugin` (its entry-point name)."""
        self.register(plugin, name=name)
        self._origins[name] = (label or name, dist, version)

    def dist_of(self, name: str) -> Tuple[Optional[str], Optional[str]]:
        """(distribution, version) of the plugin registered as ``name``."""
        return self._origins.get(name, (name, None, None))[1:]

    def label_of(self, name: str) -> str:
        return self._origins.get(name, (name,))[0]


def _report(message: str, exc: Optional[BaseException]) -> None:
    if strict_plugins():
        raise PluginError(message) from exc
    warnings.warn(message, RuntimeWarning, stacklevel=3)


def _load_order(ep) -> tuple:
    dist = _dist_name(ep)
    return (shipped_rank(dist), normalize_dist(dist or ""), ep.name, ep.value)


def _dist_name(ep) -> Optional[str]:
    dist = getattr(ep, "dist", None)
    return dist.metadata["Name"] if dist is not None else None


def build_plugin_manager(registry: Registry) -> PluginManager:
    """Register the built-in parts, every entry point of the group, and extra plugins.

    A plugin that fails to load is recorded in ``registry.failures`` and reported; one that is blocked
    is recorded in ``registry.blocked``. A plugin's import may raise anything but ``KeyboardInterrupt``
    (``sys.exit()`` included) and is skipped like any other broken plugin.
    """
    pm = PluginManager()
    pm.register_from(
        builtin,
        plugin_id("kvpolicy-core", "kvpolicy_core"),
        "kvpolicy-core",
        _version("kvpolicy-core"),
        label="kvpolicy_core",
    )
    blocked = blocked_plugins()
    for ep in sorted(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP), key=_load_order):
        dist_name = _dist_name(ep)
        version = ep.dist.version if dist_name is not None else None
        ident = plugin_id(dist_name, ep.name)
        if is_blocked(blocked, dist_name, ep.name):
            registry.blocked.append(ident)
            continue
        try:
            module = ep.load()
            owner = pm.get_name(module)
            if owner is not None:  # a second entry point loading a module already registered
                if pm.dist_of(owner)[0] == dist_name:
                    continue  # an alias within one distribution: its hooks are registered once
                raise PluginError(
                    f"it loads {ep.value}, which plugin {owner!r} already registered; "
                    "its hooks are not registered a second time"
                )
            pm.register_from(module, ident, dist_name, version, label=ep.name)
        except (Exception, SystemExit) as exc:  # a plugin's sys.exit() must not end the host program
            message = (
                f"kvpolicy: {'plugin' if strict_plugins() else 'skipping plugin'} {ep.name!r} ({ep.value}"
                f"{', from ' + dist_name if dist_name else ''}): failed to load: "
                f"{type(exc).__name__}: {exc}"
            )
            registry.failures.append(message)
            _report(message, exc)
    for name, plugin in _extra_plugins.items():
        if name in blocked:
            registry.blocked.append(name)
            continue
        try:
            pm.register_from(plugin, name)
        except Exception as exc:  # a name or object pluggy already holds, or hooks it refuses
            message = f"kvpolicy: {'plugin' if strict_plugins() else 'skipping plugin'} {name!r}: {exc}"
            registry.failures.append(message)
            _report(message, exc)
    return pm


def _version(dist: str) -> Optional[str]:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def get_registry() -> Registry:
    """The registry, filled from all plugins on first use (thread-safe, cached)."""
    global _registry
    with _lock:
        if _registry is None:
            registry = Registry()
            pm = build_plugin_manager(registry)
            fill(registry, pm, strict=strict_plugins())
            _registry = registry
        return _registry


def reset_registry() -> None:
    """Forget the registry: the next use rediscovers plugins (after installs, env changes)."""
    global _registry
    with _lock:
        _registry = None


def register_plugin(plugin, name: str) -> None:
    """Register a plugin object or module by hand (notebooks, tests), then rediscover."""
    with _lock:
        _extra_plugins[name] = plugin
        reset_registry()


def unregister_plugin(name: str) -> None:
    with _lock:
        _extra_plugins.pop(name, None)
        reset_registry()
