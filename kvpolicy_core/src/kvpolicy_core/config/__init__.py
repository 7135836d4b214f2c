"""Configuration resolved: config strings, dicts and JSON parsed into a :class:`KVCacheConfig`, and a
config composed into a :class:`Policy` of the registered parts."""

from .._lazy import lazy_exports

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "KVCacheConfig": ".parse",
        "parse_config": ".parse",
        "parse_config_string": ".parse",
        "PolicyConfig": "..plugin.policy_config",
        "Policy": ".policy",
        "build_policy": ".policy",
    },
)
