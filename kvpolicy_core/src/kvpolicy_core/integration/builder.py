"""Building one policy cache per layer for an mlx-lm model, and attaching them to it."""

from __future__ import annotations

from typing import Any, List, Optional, Tuple

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, CacheList, ChunkedKVCache, KVCache, RotatingKVCache

from ..attention import hook as attention
from ..cache.layer_group import LayerGroup
from ..cache.policy_cache import PolicyCache
from ..config.cache_config import KVCacheConfig
from ..config.parse import parse_config
from ..config.policy import allocation_of, build_policy, check_budgets, layer_budgets
from ..errors import MLX_ERRORS, ConfigError, KVPolicyError, ModelError
from ..parts.allocation import LayerInfo
from ..parts.base import needs_of
from ..runtime.sharding import shard_layout
from .rope import model_ropes

_ORIGINAL = "_kvpolicy_original_make_cache"
_HOOK = "_kvpolicy_attention_hook"
_OWN = "_kvpolicy_own_make_cache"


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


#: Native cache types kvpolicy refuses, with the reason (a policy cache would be wrong for them).
REFUSED = {
    ArraysCache: "a recurrent/linear-attention state (hybrid model), not a KV cache of tokens",
    CacheList: "a list of sub-caches (hybrid layer), not one KV cache of tokens",
    ChunkedKVCache: "chunked attention (llama4): each chunk attends only within itself, which a policy cache cannot mask",  # noqa: E501
}


def check_supported(model, natives: List[Any], layers) -> None:
    """Raise :class:`ModelError` naming the reason when ``model``'s caches cannot be policy caches."""
    name = type(model).__name__
    args = getattr(model, "args", None)
    if getattr(args, "kv_lora_rank", None):
        raise ModelError(
            f"{name}: multi-head latent attention (kv_lora_rank={args.kv_lora_rank}, e.g. deepseek_v3, kimi) "
            "caches compressed latents, not per-head keys; kvpolicy's scores and merges need per-head keys"
        )
    if len(natives) != len(layers):
        raise ModelError(
            f"{name}: the model makes {len(natives)} caches for {len(layers)} layers (layers share KV caches, "
            "e.g. gemma3n); kvpolicy needs one cache per layer"
        )
    for i, native in enumerate(natives):
        for cls, why in REFUSED.items():
            if isinstance(native, cls):
                raise ModelError(f"{name}: layer {i} uses {cls.__name__}: {why}; kvpolicy cannot replace it")
        if type(native) not in (KVCache, RotatingKVCache):
            raise ModelError(
                f"{name}: layer {i} uses {type(native).__name__}, which kvpolicy cannot replace "
                "(supported: mlx-lm KVCache and RotatingKVCache)"
            )


def needs_hook(caches: List[Any]) -> bool:
    """The attention hook is needed for an observed signal, attention log-weights or a sliding window."""
    return any(isinstance(c, PolicyCache) and c.needs_hook for c in caches)


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


def model_kv_shapes(model) -> List[Optional[Tuple[int, int, int]]]:
    """(kv heads, key dim, value dim) of each layer's cache, one entry per cache the model makes (None where a
    layer's cache holds no keys, or for every layer when the model cannot run a one-token step).

    Read from the shapes of a one-token forward pass through the model's own caches that is never evaluated
    (MLX knows shapes without computing), so it is exact for every family (per-layer heads, tensor-parallel
    ranks) and costs only building the graph.
    """
    return model_kv_layout(model)[0]


def model_kv_layout(model) -> Tuple[List[Optional[Tuple[int, int, int]]], int]:
    """(:func:`model_kv_shapes`, the bytes of one K/V element in the model's KV dtype; 4 when unknown)."""
    caches = native_caches(model)
    try:
        model(mx.zeros((1, 1), dtype=mx.int32), cache=caches)
    except (*MLX_ERRORS, TypeError, AttributeError, KeyError, KVPolicyError):  # cannot run a one-token step: unknown
        return [None] * len(caches), 4
    shapes, itemsize = [], 4
    for c in caches:
        k, v = getattr(c, "keys", None), getattr(c, "values", None)
        ok = isinstance(k, mx.array) and isinstance(v, mx.array) and k.ndim == 4 and v.ndim == 4
        shapes.append((k.shape[1], k.shape[3], v.shape[3]) if ok else None)
        itemsize = k.itemsize if ok else itemsize
    return shapes, itemsize


def check_quantizable(model, config: KVCacheConfig) -> None:
    """Refuse ``kv_bits`` (ConfigError naming ``kv_group_size``) when a layer's head dim cannot be quantized so."""
    dims = sorted({d for s in model_kv_shapes(model) if s is not None for d in s[1:]})
    bad = [d for d in dims if d % config.kv_group_size or (d * config.kv_bits) % 32]
    if bad:
        fits = [g for g in (32, 64, 128) if all(d % g == 0 for d in dims)]
        advice = f"use kv_group_size={fits[-1]}" if fits else "no group size of 32, 64 or 128 divides them"
        raise ConfigError(
            f"kv_group_size: {config.kv_group_size} does not divide the model's head dim {bad[0]} (kv_bits="
            f"{config.kv_bits} quantizes groups of a row); {advice}"
        )


def memory_budget(model, config: KVCacheConfig, windows, replaced, layer_offset: int = 0):
    """The :class:`~.memory_budget.MemoryBudget` that fits ``config.kv_memory`` on ``model``'s replaced layers."""
    from .memory_budget import budget_for_memory, bytes_per_token

    shapes, itemsize = model_kv_layout(model)
    if config.kv_dtype is not None:
        itemsize = getattr(mx, config.kv_dtype).size
    costs = bytes_per_token(shapes, itemsize, config.kv_bits, config.kv_group_size)
    costs = [c for c, r in zip(costs, replaced) if r]
    infos = [i for i, r in zip(layer_infos(model, windows, layer_offset), replaced) if r]
    return budget_for_memory(config, infos, costs, config.kv_memory)


class KVCacheBuilder:
    """The specification's entry point: ``KVCacheBuilder.for_model(model, config)``."""

    @staticmethod
    def for_model(model, config: Any, budgets: Optional[List[int]] = None) -> List[Any]:
        """One cache per layer: a :class:`PolicyCache` where the policy applies, else the native one.

        ``config.layers == "all"`` replaces every layer's cache, a sliding-window layer's
        ``RotatingKVCache(W)`` by a policy cache with ``window=W``; ``"unbounded"`` only
        replaces layers whose native cache is an unbounded ``KVCache``. Installs the
        attention hook on the model (idempotent) only where it is needed: an observed
        signal or a sliding-window layer. Models kvpolicy cannot serve correctly (latent
        attention, shared-KV layers, hybrid or chunked caches) raise :class:`ModelError`.
        On a model split by mlx-lm's ``sharded_load`` each cache gets its global layer index
        and KV-head slice (:mod:`kvpolicy_core.runtime.sharding`). A scorer that declares
        ``Needs(rope=True)`` (``score=expected_attention``) gets each layer's RoPE in that layer's config
        (``rope_freqs``, ``rope_traditional``: :mod:`kvpolicy_core.integration.rope`), so the caches of layers
        with different RoPEs (Gemma 3's local and global layers) have different configs.

        Each layer's budget comes from the config's ``allocation`` (:func:`~kvpolicy_core.config.policy.
        layer_budgets`), or from ``budgets`` (one int per layer the model makes a cache for) when given: a cut
        that ranked the layers from data (compress once) builds its caches this way.
        """
        config = parse_config(config)
        layers = _layers(model)
        hd = model_head_dim(model)
        if config.head_dim is not None and hd is not None and config.head_dim != hd:
            raise ConfigError(f"head_dim: the config says {config.head_dim} but the model's head_dim is {hd}")
        natives = native_caches(model)
        check_supported(model, natives, layers)
        if config.kv_bits is not None:
            check_quantizable(model, config)
        layout = shard_layout(model)
        windows = [n.max_size if type(n) is RotatingKVCache else None for n in natives]
        replaced = [not (type(n) is RotatingKVCache and config.layers == "unbounded") for n in natives]
        if config.kv_memory is not None:  # bytes -> the mean token budget that keeps them (memory_budget.py)
            if budgets is not None:
                raise ConfigError("kv_memory: give a memory limit or explicit per-layer budgets, not both")
            config = config.replace(budget=memory_budget(model, config, windows, replaced, layout.layer_offset).budget)
        group = layer_group(model, config, windows, replaced, layout.layer_offset) if budgets is None else None
        if group is not None:  # the allocation shares the budget among the layers it allocates: its group
            budgets = [config.policy.budget] * len(natives)
            for info, b in zip(group.infos, layer_budgets(config, group.infos)):
                budgets[info.index - layout.layer_offset] = b
        policies = layer_policies(model, config, windows, layout.layer_offset, budgets)
        caches = []
        for i, native in enumerate(natives):
            if not replaced[i]:
                caches.append(native)
            else:  # the model's global layer index (a pipeline rank holds layers from layer_offset on)
                caches.append(
                    PolicyCache(policies[i], layer=layout.layer_offset + i, window=windows[i], head_shard=layout.tensor)
                )
                if group is not None:
                    caches[-1].group = group
                    group.join(caches[-1])
        # the caches hold the install (it ends when the last of them is gone); caches whose budgets differ hold it
        # too: mlx-lm builds one mask from the first layer, which a batch's other layers then rebuild for their rows
        differ = group is not None or len({c.budget for c in caches if isinstance(c, PolicyCache)}) > 1
        if needs_hook(caches) or differ:
            hook = attention.install(model)
            for c in caches:
                if isinstance(c, PolicyCache):
                    c.attention_hook = hook
        return caches


def layer_group(model, config: KVCacheConfig, windows, replaced=None, layer_offset: int = 0) -> Optional[LayerGroup]:
    """The :class:`~kvpolicy_core.cache.layer_group.LayerGroup` the caches share when the config's allocation sets
    budgets from the prompt (``Needs(layer_stats=True)``), else None. Such an allocation acts at the end of the
    prompt, so it needs ``when="prompt_end"``. Its layers are those that get a policy cache (``replaced[i]``, all
    by default): a layer that keeps mlx-lm's cache (``layers="unbounded"``) is neither measured nor allocated."""
    allocation, owner = allocation_of(config)
    if not needs_of(allocation).layer_stats:
        return None
    if config.policy.when != "prompt_end":
        raise ConfigError(
            f"allocation: {owner} sets budgets from the prompt, at its end: it needs when='prompt_end' "
            f"(got when={config.policy.when!r})"
        )
    members = [
        info for i, info in enumerate(layer_infos(model, windows, layer_offset)) if replaced is None or replaced[i]
    ]
    return LayerGroup(config, members) if members else None


def layer_infos(model, windows, layer_offset: int = 0) -> List[LayerInfo]:
    """One :class:`~kvpolicy_core.parts.allocation.LayerInfo` per cache: global index, the model's layers, window."""
    total = max(getattr(getattr(model, "args", None), "num_hidden_layers", 0) or 0, layer_offset + len(windows))
    return [LayerInfo(layer_offset + i, total, w) for i, w in enumerate(windows)]


def layer_policies(model, config: KVCacheConfig, windows, layer_offset: int = 0, budgets=None) -> list:
    """The policy of each layer: the config with that layer's budget (its allocation's, or ``budgets[i]``) and,
    for a scorer that needs ``rope``, that layer's ``rope_freqs``/``rope_traditional``; layers with the same
    budget and RoPE share one policy."""
    n_layers = len(windows)
    if budgets is None:
        budgets = layer_budgets(config, layer_infos(model, windows, layer_offset))
    else:
        budgets = check_budgets(budgets, n_layers)
    base = build_policy(config)
    ropes = model_ropes(model, n_layers) if needs_of(base.scorer).rope else [None] * n_layers
    built, out = {(config.policy.budget, None): base}, []
    for b, rope in zip(budgets, ropes):
        if (b, rope) not in built:
            extra = {} if rope is None else dict(zip(("rope_freqs", "rope_traditional"), rope))
            built[(b, rope)] = build_policy(config.replace(budget=b, **extra))
        out.append(built[(b, rope)])
    return out


def attach(model, config: Any):
    """Make ``mlx_lm.generate``/``stream_generate`` use fresh policy caches for every generation.

    Returns the validated config. Undo with :func:`detach`.
    """
    config: KVCacheConfig = parse_config(config)  # once: every generation's caches are built from this typed config
    caches = KVCacheBuilder.for_model(model, config)  # validate now
    hook = model.__dict__.get(_HOOK)
    if needs_hook(caches) and (hook is None or not hook.active):  # keep the hook while attached
        setattr(model, _HOOK, attention.install(model))
    if model.__dict__.get(_ORIGINAL) is None:
        original = getattr(model, "make_cache", None)
        setattr(model, _ORIGINAL, original or (lambda: [KVCache() for _ in _layers(model)]))
        if "make_cache" in model.__dict__:  # the user's own, set on the instance: detach puts it back
            setattr(model, _OWN, model.__dict__["make_cache"])
    # mlx-lm's public protocol: make_prompt_cache(model) calls model.make_cache() when the model has one; an
    # instance attribute shadows the class's (mlx.nn.Module stores a function as a plain attribute)
    model.make_cache = lambda *_a, **_k: KVCacheBuilder.for_model(model, config)
    return config


def detach(model) -> None:
    """Undo :func:`attach` and release its attention hook (caches that need the hook keep it alive)."""
    d = model.__dict__
    if d.pop(_ORIGINAL, None) is not None:
        d.pop("make_cache", None)
        if _OWN in d:
            model.make_cache = d.pop(_OWN)
    hook = d.pop(_HOOK, None)
    if hook is not None:
        hook.remove()
