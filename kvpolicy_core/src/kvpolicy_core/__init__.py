"""kvpolicy-core: plugin-based KV-cache eviction policies for MLX and mlx-lm.

Importing this package does not import mlx, so that
``kvpolicy_core.runtime.blas.load_optimized_blas()`` can run first; the names below are
loaded on first access.

Importing it is still enough for mlx-lm's own loaders (``load_prompt_cache``) to know ``PolicyCache`` and
``BatchPolicyCache``: they look a class up in ``mlx_lm.models.cache``'s globals, so the classes are put there
as soon as both this package and ``mlx_lm.models.cache`` are imported, in either order (right away if mlx-lm's
module is already imported, else right after its import, by :mod:`_kvpolicy_core_hook`'s finder). Nothing here imports
mlx before the user's code does.
"""

from __future__ import annotations

import importlib
import sys

__version__ = "0.3.0"

_EXPORTS = {
    "hookimpl": "plugin.hookspecs",
    "hookspec": "plugin.hookspecs",
    "KVCacheConfig": "config.cache_config",
    "PolicyConfig": "config.policy_config",
    "AttentionPolicyConfig": "config.attention_config",
    "parse_config": "config.parse",
    "ConfigError": "errors",
    "UnknownMethodError": "errors",
    "PluginError": "errors",
    "ModelError": "errors",
    "KVPolicyError": "errors",
    "MethodSpec": "plugin.registry",
    "get_registry": "plugin.discovery",
    "register_plugin": "plugin.discovery",
    "reset_registry": "plugin.discovery",
    "PolicyCache": "cache.policy_cache",
    "Policy": "config.policy",
    "build_policy": "config.policy",
    "KVCacheBuilder": "integration.builder",
    "attach": "integration.builder",
    "detach": "integration.builder",
    "load_optimized_blas": "runtime.blas",
    "blas_info": "runtime.blas",
    "save_caches": "integration.persistence",
    "load_caches": "integration.persistence",
    "CacheFileError": "integration.persistence",
    "CacheView": "parts.base",
    "MergeUpdate": "parts.base",
    "Needs": "parts.base",
    "Scorer": "parts.base",
    "Selector": "parts.base",
    "Disposition": "parts.base",
    "Allocation": "parts.allocation",
    "LayerInfo": "parts.allocation",
    "LayerStats": "parts.allocation",
    "AttentionScorer": "parts.attention_scorer",
    "observed_weights": "parts.cumulative_attention",
    "masked_softmax": "parts.cumulative_attention",
    "causal_allowed": "parts.cumulative_attention",
    "pick_lowest": "parts.base",
    # the test kits, concept (12) of docs/plugins/hooks.md (imported on first use: they build tiny models)
    "run_conformance": "testing.conformance",
    "assert_equivalent": "testing.equivalence",
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


def _register_with_mlx_lm() -> None:
    """Put the classes in ``mlx_lm.models.cache`` now if it is imported, else when it is: by the one
    ``sys.meta_path`` finder of :mod:`_kvpolicy_core_hook` (the start-up hook that ``kvpolicy_core_mlx_lm.pth``
    runs; imported here too, for a Python that skipped site-packages' ``.pth`` files)."""
    if "mlx_lm.models.cache" in sys.modules:
        from .cache import batch, policy_cache  # noqa: F401 -- each registers its class on import (cache/batch.py)

        return
    try:
        import _kvpolicy_core_hook  # noqa: F401 -- installs its finder (once)
    except ImportError:  # not installed beside the package: importing PolicyCache still registers it
        pass


_register_with_mlx_lm()
