"""Configuration: the config models (one module each: :class:`PolicyConfig`, :class:`AttentionPolicyConfig`,
:class:`KVCacheConfig`), which know no registry; config strings, dicts and JSON resolved once into a
:class:`KVCacheConfig` (:func:`parse_config`, the one lookup of the method); and a config composed into a
:class:`Policy` of the registered parts."""

from .._lazy import lazy_exports

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "KVCacheConfig": ".cache_config",
        "PolicyConfig": ".policy_config",
        "AttentionPolicyConfig": ".attention_config",
        "parse_config": ".parse",
        "parse_config_string": ".parse",
        "Policy": ".policy",
        "build_policy": ".policy",
    },
)
