"""The one place a config's method name is looked up in the plugin registry.

:func:`resolve` turns a method name and its fields (bare, prefixed or in ``policy``) into the common fields plus
an instance of the method's config class. :func:`~.parse.parse_config` calls it once per entry point (a config
string, JSON or dict); a typed :class:`~.cache_config.KVCacheConfig` passed onward is never resolved again.
"""

from __future__ import annotations

import difflib
import importlib.metadata
from typing import Any, Dict, Mapping

from ..errors import ConfigError, UnknownMethodError
from ..plugin.discovery import get_registry
from ..plugin.registry import normalize_dist
from .policy_config import is_resolved, policy_from_fields


def resolve(data: Mapping[str, Any]) -> Dict[str, Any]:
    """``data["method"]`` found in the registry and the rest validated by its config class: the common fields plus
    ``policy``, the method's config instance (any problem is a :class:`ConfigError` naming the field). Fields
    already resolved (a typed ``policy`` and common fields) are returned as they are, without the registry."""
    if is_resolved(data):
        return dict(data)
    method = data.get("method")
    if not isinstance(method, str) or not method:
        raise ConfigError(f"method: a method name is required (got {method!r})")
    spec = method_spec(method)
    common, policy = policy_from_fields(spec.config_class, method, data)
    refuse_ignored(spec, policy)
    return {**common, "policy": policy}


def method_spec(method: str):
    """The registered method called ``method``, or an :class:`UnknownMethodError` naming the installed ones and
    why not it: its plugin (``kvpolicy-<method>``) is blocked; a name close to an installed one (another case, a
    typo: ``H2O``, ``h20``) gets "did you mean"; else whether its plugin is installed, or the ``pip install``."""
    registry = get_registry()
    installed = sorted(registry.methods())
    if method in installed:
        return registry.method(method)
    dist = f"kvpolicy-{method}"
    blocked = [b for b in registry.blocked if normalize_dist(b.partition(":")[0]) == normalize_dist(dist)]
    close = [m for m in installed if m.lower() == method.lower()]
    close = close or difflib.get_close_matches(method.lower(), installed, n=3, cutoff=0.6)
    failed = f" ({len(registry.failures)} plugin problems: `kvpolicy methods` lists them)" if registry.failures else ""
    if blocked:
        why = f"{dist} is installed, but KVPOLICY_BLOCK_PLUGINS blocks its plugin ({', '.join(blocked)})"
    elif close:
        why = f"did you mean {' or '.join(repr(m) for m in close)}? (method names are lower case)"
    elif _installed(dist):
        why = f"{dist} is installed but did not register {method!r}{failed}"
    else:
        why = f"To add it, install its plugin: pip install {dist}{failed}"
    raise UnknownMethodError(f"unknown method {method!r}; installed methods: {', '.join(installed) or 'none'}. {why}")


def _installed(dist: str) -> bool:
    try:
        importlib.metadata.distribution(dist)
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return False
    return True


def refuse_ignored(spec, policy) -> None:
    """A shared field the method's parts never read (``spec.ignores``: StreamingLLM's ``recent`` and ``signal``)
    given a value other than its default is refused, naming it: it would change nothing the method does."""
    fields = type(policy).model_fields
    for name in spec.ignores:
        if name in fields and getattr(policy, name) != fields[name].default:
            raise ConfigError(
                f"{spec.name}_{name}: method {spec.name!r} does not use {name} (its parts never read it), so "
                f"{getattr(policy, name)!r} would change nothing; leave it out (its value is {fields[name].default!r})"
            )
