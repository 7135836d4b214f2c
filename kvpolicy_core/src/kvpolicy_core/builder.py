"""Building one policy cache per layer for an mlx-lm model, and attaching them to it."""

from __future__ import annotations

from typing import Any, List

from mlx_lm.models.cache import KVCache, RotatingKVCache

from . import attention
from .cache import PolicyCache
from .config import KVCacheConfig, parse_config
from .errors import ConfigError, ModelError
from .policy import build_policy
from .sharding import shard_layout

_ORIGINAL = "_kvpolicy_original_make_cache"
_HOOK = "_kvpolicy_attention_hook"


def native_caches(model) -> List[Any]:
    """The caches the model would make by itself (before any kvpolicy attach)."""
    make = model.__dict__.get(_ORIGINAL) or getattr(model, "make_cache", None)
    return list(make()) if make is not None else [KVCache() for _ in _layers(model)]


def _layers(model):
    try:
        layers = model.layers
    except AttributeError:
        raise ModelError(
            f"{type(model).__name__} has no `layers`; kvpolicy needs an mlx-lm model whose layers each "
            "take one KV cache"
        ) from None
    return layers


def model_head_dim(model) -> int | None:
    """The attention head dim from the model's args (head_dim, or hidden_size / heads)."""
    args = getattr(model, "args", None)
    if args is None:
        return None
    hd = getattr(args, "head_dim", None)
    if hd:
        return int(hd)
    hidden, heads = getattr(args, "hidden_size", None), getattr(args, "num_attention_heads", None)
    return hidden // heads if hidden and heads else None


class KVCacheBuilder:
    """The specification's entry point: ``KVCacheBuilder.for_model(model, config)``."""

    @staticmethod
    def for_model(model, config: Any) -> List[Any]:
        """One cache per layer: a :class:`PolicyCache` where the policy applies, else the native one.

        ``config.layers == "all"`` replaces every layer's cache, a sliding-window layer's
        ``RotatingKVCache(W)`` by a policy cache with ``window=W``; ``"unbounded"`` only
        replaces layers whose native cache is an unbounded ``KVCache``. Installs the
        attention hook on the model (idempotent). On a model split by mlx-lm's ``sharded_load``
        each cache gets its global layer index and KV-head slice (:mod:`kvpolicy_core.sharding`).
        """
        config = parse_config(config)
        layers = _layers(model)
        hd = model_head_dim(model)
        if config.head_dim is not None and hd is not None and config.head_dim != hd:
            raise ConfigError(f"head_dim: the config says {config.head_dim} but the model's head_dim is {hd}")
        policy = build_policy(config)
        natives = native_caches(model)
        if len(natives) != len(layers):
            raise ModelError(f"the model made {len(natives)} caches for {len(layers)} layers")
        layout = shard_layout(model)
        caches = []
        for i, native in enumerate(natives):
            i = layout.layer_offset + i  # the model's global layer index
            if type(native) is KVCache:
                caches.append(PolicyCache(policy, layer=i, head_shard=layout.tensor))
            elif type(native) is RotatingKVCache:
                if config.layers == "unbounded":
                    caches.append(native)
                else:
                    caches.append(PolicyCache(policy, layer=i, window=native.max_size, head_shard=layout.tensor))
            else:
                raise ModelError(
                    f"layer {i} uses {type(native).__name__}, which kvpolicy cannot replace "
                    "(supported: mlx-lm KVCache and RotatingKVCache)"
                )
        hook = model.__dict__.get(_HOOK)
        if hook is None or not hook.active:
            object.__setattr__(model, _HOOK, attention.install(model))
        return caches


def attach(model, config: Any):
    """Make ``mlx_lm.generate``/``stream_generate`` use fresh policy caches for every generation.

    Returns the validated config. Undo with :func:`detach`.
    """
    config: KVCacheConfig = parse_config(config)
    KVCacheBuilder.for_model(model, config)  # validate now, install the hook
    if model.__dict__.get(_ORIGINAL) is None:
        original = getattr(model, "make_cache", None)
        object.__setattr__(model, _ORIGINAL, original or (lambda: [KVCache() for _ in _layers(model)]))
    object.__setattr__(model, "make_cache", lambda *_a, **_k: KVCacheBuilder.for_model(model, config))
    return config


def detach(model) -> None:
    """Undo :func:`attach` and remove the attention hook installed for ``model``."""
    d = model.__dict__
    if d.pop(_ORIGINAL, None) is not None:
        d.pop("make_cache", None)
    hook = d.pop(_HOOK, None)
    if hook is not None:
        hook.remove()
