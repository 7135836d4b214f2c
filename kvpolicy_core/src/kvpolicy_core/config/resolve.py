"""The one place a config's method name is looked up in the plugin registry.

:func:`resolve` turns a method name and its fields (bare, prefixed or in ``policy``) into the common fields plus
an instance of the method's config class. :func:`~.parse.parse_config` calls it once per entry point (a config
string, JSON or dict); a typed :class:`~.cache_config.KVCacheConfig` passed onward is never resolved again.
"""

from __future__ import annotations

from typing import Any, Dict, Mapping

from ..errors import ConfigError
from ..plugin.discovery import get_registry
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
    spec = get_registry().method(method)
    common, policy = policy_from_fields(spec.config_class, method, data)
    refuse_ignored(spec, policy)
    return {**common, "policy": policy}


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
