"""Plugin discovery: kvpolicy-core's own parts, the ``kvpolicy`` entry points and :func:`register_plugin`'s
plugins, loaded once, on first use. A plugin is ``"<dist>:<entry-point name>"`` (``kvpolicy-h2o:h2o``); entry
points load shipped distributions first, then by distribution name, so who wins a name clash never depends on
``sys.path``. ``KVPOLICY_STRICT_PLUGINS`` and ``KVPOLICY_BLOCK_PLUGINS``: docs/configuration.md."""

from __future__ import annotations

import importlib.metadata
import os
import threading
from typing import Dict, Iterable, Optional

import pluggy

from ..errors import PluginError, blamed
from . import hookspecs
from .registry import Registry, fill, normalize_dist, plugin_id, report, shipped_rank

_lock = threading.RLock()
_registry: Optional[Registry] = None
_extra_plugins: Dict[str, object] = {}


def is_blocked(blocked: Iterable[str], dist: Optional[str], name: str) -> bool:
    """Whether an item of ``KVPOLICY_BLOCK_PLUGINS`` names entry point ``name`` of distribution ``dist``: the
    distribution (normalized), ``dist:name``, or the bare entry-point name (of any distribution)."""
    own = normalize_dist(dist) if dist else None
    items = [item.partition(":") for item in blocked]  # (dist or bare name, ":" or "", entry-point name or "")
    return any(normalize_dist(d) == own and (not c or n.strip() == name) or (not c and d == name) for d, c, n in items)


class PluginManager(pluggy.PluginManager):
    """pluggy's manager that remembers each plugin's (label: its entry-point name, distribution, version)."""

    def __init__(self) -> None:
        super().__init__("kvpolicy")
        self.add_hookspecs(hookspecs)
        self.origins: Dict[str, tuple] = {}

    def register_from(self, plugin, name: str, dist=None, version=None, label: Optional[str] = None) -> None:
        self.register(plugin, name=name)
        self.origins[name] = (label or name, dist, version)


def build_plugin_manager(registry: Registry, strict: bool = False) -> PluginManager:
    """kvpolicy-core's parts, the entry points, then :func:`register_plugin`'s, less the blocked ones. One that fails
    to load (raising anything, ``sys.exit()`` too, but Ctrl-C) or loads another's module is reported and skipped."""
    pm = PluginManager()
    version = next((d.version for d in importlib.metadata.distributions(name="kvpolicy-core")), None)
    core = importlib.import_module("kvpolicy_core.default_plugin")  # kvpolicy-core's own plugin: registered first
    pm.register_from(core, "kvpolicy-core:kvpolicy_core", "kvpolicy-core", version, label="kvpolicy_core")
    blocked = {item.strip() for item in os.environ.get("KVPOLICY_BLOCK_PLUGINS", "").split(",") if item.strip()}
    eps = [
        (ep.dist.metadata["Name"] if ep.dist else None, ep) for ep in importlib.metadata.entry_points(group="kvpolicy")
    ]
    plugins = [  # shipped distributions first, then by distribution name: never by sys.path order
        (ep.name, dist, ep.dist.version if dist else None, ep.load, f" ({ep.value}{', from ' + dist if dist else ''})")
        for dist, ep in sorted(
            eps, key=lambda e: (shipped_rank(e[0]), normalize_dist(e[0] or ""), e[1].name, e[1].value)
        )
    ]
    plugins += [(name, None, None, lambda p=plugin: p, "") for name, plugin in _extra_plugins.items()]
    label = "plugin" if strict else "skipping plugin"  # (strict mode raises: it skips nothing)
    for name, dist, version, load, where in plugins:
        if is_blocked(blocked, dist, name):
            registry.blocked.append(plugin_id(dist, name))
            continue
        try:
            with blamed(f"kvpolicy: {label} {name!r}{where}: failed to load:"):
                module = load()
                owner = pm.get_name(module)
                if owner is None:
                    pm.register_from(module, plugin_id(dist, name), dist, version, label=name)
                elif dist is None or pm.origins[owner][1] != dist:  # not an alias within one distribution
                    raise PluginError(f"it loads a module plugin {owner!r} already registered, so not again")
        except PluginError as exc:
            report(registry, str(exc), strict)
    return pm


def get_registry() -> Registry:
    """The registry, filled from all plugins on first use (thread-safe, cached)."""
    global _registry
    with _lock:
        if _registry is None:
            registry = Registry()
            strict = os.environ.get("KVPOLICY_STRICT_PLUGINS", "").strip().lower() in ("1", "true", "yes", "on")
            fill(registry, build_plugin_manager(registry, strict), strict)
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
