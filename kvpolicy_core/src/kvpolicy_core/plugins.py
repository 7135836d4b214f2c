"""Plugin discovery: pluggy plus the ``kvpolicy`` entry-point group, loaded lazily.

Environment variables:

* ``KVPOLICY_STRICT_PLUGINS=1`` -- a plugin that fails to import or register raises
  :class:`~kvpolicy_core.errors.PluginError` instead of being skipped with a warning
  (for the CI of plugin authors).
* ``KVPOLICY_BLOCK_PLUGINS=name1,name2`` -- entry points with these names are not loaded.
"""

from __future__ import annotations

import importlib.metadata
import os
import threading
import warnings
from typing import Dict, Optional, Tuple

import pluggy

from . import builtin, hookspecs
from .errors import PluginError
from .registry import Registry, fill

ENTRY_POINT_GROUP = "kvpolicy"
_lock = threading.RLock()
_registry: Optional[Registry] = None
_extra_plugins: Dict[str, object] = {}


def strict_plugins() -> bool:
    return os.environ.get("KVPOLICY_STRICT_PLUGINS", "").strip().lower() in ("1", "true", "yes", "on")


def blocked_plugins() -> set:
    raw = os.environ.get("KVPOLICY_BLOCK_PLUGINS", "")
    return {name.strip() for name in raw.split(",") if name.strip()}


class PluginManager(pluggy.PluginManager):
    """pluggy's manager that remembers which distribution each plugin came from."""

    def __init__(self) -> None:
        super().__init__("kvpolicy")
        self.add_hookspecs(hookspecs)
        self._dists: Dict[str, Tuple[Optional[str], Optional[str]]] = {}

    def register_from(self, plugin, name: str, dist=None, version=None) -> None:
        self.register(plugin, name=name)
        self._dists[name] = (dist, version)

    def dist_of(self, name: str) -> Tuple[Optional[str], Optional[str]]:
        return self._dists.get(name, (None, None))


def _report(message: str, exc: BaseException) -> None:
    if strict_plugins():
        raise PluginError(message) from exc
    warnings.warn(message, RuntimeWarning, stacklevel=3)


def build_plugin_manager(registry: Registry) -> PluginManager:
    """Register the built-in parts, every entry point of the group, and extra plugins."""
    pm = PluginManager()
    pm.register_from(builtin, "kvpolicy_core", "kvpolicy-core", _version("kvpolicy-core"))
    blocked = blocked_plugins()
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in blocked:
            continue
        dist = getattr(ep, "dist", None)
        dist_name = dist.metadata["Name"] if dist is not None else None
        version = dist.version if dist is not None else None
        try:
            module = ep.load()
            if pm.is_registered(module) or pm.get_plugin(ep.name) is not None:
                continue
            pm.register_from(module, ep.name, dist_name, version)
        except Exception as exc:
            message = (
                f"kvpolicy: {'plugin' if strict_plugins() else 'skipping plugin'} {ep.name!r} ({ep.value}"
                f"{', from ' + dist_name if dist_name else ''}): failed to load: "
                f"{type(exc).__name__}: {exc}"
            )
            registry.failures.append(message)
            _report(message, exc)
    for name, plugin in _extra_plugins.items():
        if name not in blocked:
            pm.register_from(plugin, name)
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
