"""kvpolicy-core: plugin-based KV-cache eviction policies for MLX and mlx-lm.

Importing this package does not import mlx, so that
``kvpolicy_core.blas.load_optimized_blas()`` can run first; the names below are
loaded on first access.
"""

from __future__ import annotations

import importlib

__version__ = "0.2.0"

_EXPORTS = {
    "hookimpl": "hookspecs",
    "hookspec": "hookspecs",
    "KVCacheConfig": "config",
    "PolicyConfig": "config",
    "AttentionPolicyConfig": "attention_config",
    "parse_config": "config",
    "ConfigError": "errors",
    "UnknownMethodError": "errors",
    "PluginError": "errors",
    "ModelError": "errors",
    "KVPolicyError": "errors",
    "MethodSpec": "registry",
    "get_registry": "plugins",
    "register_plugin": "plugins",
    "reset_registry": "plugins",
    "PolicyCache": "cache",
    "Policy": "policy",
    "build_policy": "policy",
    "KVCacheBuilder": "builder",
    "attach": "builder",
    "detach": "builder",
    "load_optimized_blas": "blas",
    "blas_info": "blas",
    "save_caches": "persistence",
    "load_caches": "persistence",
    "CacheFileError": "persistence",
    "CacheView": "parts.base",
    "MergeUpdate": "parts.base",
    "Scorer": "parts.base",
    "Selector": "parts.base",
    "Disposition": "parts.base",
    "AttentionScorer": "parts.attention_scorer",
    "observed_weights": "parts.cumulative_attention",
    "masked_softmax": "parts.cumulative_attention",
    "causal_allowed": "parts.cumulative_attention",
    "pick_lowest": "parts.base",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        module = importlib.import_module(f".{_EXPORTS[name]}", __name__)
        value = getattr(module, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'kvpolicy_core' has no attribute {name!r}")


def __dir__():
    return __all__
