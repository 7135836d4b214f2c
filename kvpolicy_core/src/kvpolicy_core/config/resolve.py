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
    common, policy = policy_from_fields(get_registry().method(method).config_class, method, data)
    return {**common, "policy": policy}
