"""A method resolved once into plain part objects (no pluggy on the per-token path)."""

from __future__ import annotations

from typing import Any, List, NamedTuple, Optional, Sequence

import mlx.core as mx

from ..errors import ConfigError, PluginError, blamed
from ..parts.allocation import within_reach
from ..parts.base import needs_of
from ..plugin.discovery import get_registry
from .cache_config import KVCacheConfig
from .parse import parse_config


class Policy(NamedTuple):
    """A method's parts, built from one config; shared by every layer's cache."""

    config: KVCacheConfig
    scorer: Any
    selector: Any
    disposition: Any
    owners: dict  #: part kind -> "name (plugin)" for error messages
    #: ``when="prompt_end"``: the selector of the end-of-prompt cut, built with ``recent`` = the observation window
    #: (:func:`cut_config`); None: the cut uses ``selector``
    cut_selector: Any = None

    @property
    def budget(self) -> int:
        return self.config.policy.budget


def build_policy(config: Any) -> Policy:
    """Resolve ``config``'s method through the registry and instantiate its parts."""
    config = parse_config(config)
    registry = get_registry()
    spec = registry.method(config.method)
    parts, owners = {}, {}
    for kind, name in spec.part_names(config.policy).items():
        entry = registered(
            registry, kind + "s", name, f"method {config.method!r} needs {kind} {name!r}, which", PluginError
        )
        owners[kind] = f"{kind} {name!r} of plugin {entry.plugin!r}"
        with blamed(f"{owners[kind]} failed to build from the config:"):
            parts[kind] = entry.obj.from_config(config.policy)
    cut = cut_config(config.policy, getattr(parts["scorer"], "window", 0))
    cut_selector = None
    if cut is not None:
        entry = registry.parts["selectors"][spec.part_names(config.policy)["selector"]]
        with blamed(f"{owners['selector']} failed to build for the end-of-prompt cut:"):
            cut_selector = entry.obj.from_config(cut)
    return Policy(config, parts["scorer"], parts["selector"], parts["disposition"], owners, cut_selector)


def cut_config(policy, W: int) -> Any:
    """The config of the end-of-prompt cut (``when="prompt_end"``), or None when the cut is the selector's own.

    The cut keeps the prompt's most important tokens and its last ``W`` (the scorer's observation window, whose
    queries scored it: the question when the prompt ends with one), as SnapKV does, so ``recent = W`` there (at
    most ``budget - n_sink - 1``); decode steps after it protect the method's own ``recent``. ``W``: the scorer's
    ``window`` (:class:`~kvpolicy_core.parts.observation_window.ObservationWindowScorer`); a scorer without one,
    or whose window is every row (0), cuts with the method's own ``recent``."""
    if policy.when != "prompt_end" or not isinstance(W, int) or W <= 0:
        return None
    W = min(W, policy.budget - policy.n_sink - 1)
    return None if W == policy.recent_tokens else policy.model_copy(update={"recent": W})


def allocation_of(config: KVCacheConfig):
    """(the config's allocation part, built, and its owner string for messages)."""
    policy = config.policy
    entry = registered(
        get_registry(), "allocations", policy.allocation, f"allocation: {policy.allocation!r}", ConfigError
    )
    owner = f"allocation {policy.allocation!r} of plugin {entry.plugin!r}"
    with blamed(f"{owner} failed to build from the config:"):
        return entry.obj.from_config(policy), owner


def registered(registry, kind: str, name: str, what: str, error: type):
    """The part ``name`` of ``kind`` (``"allocations"``, ...) in ``registry``, or ``error`` saying that ``what``
    names no registered part, and the registered names."""
    registry.check_refused(kind, name)
    if name not in registry.parts[kind]:
        known = ", ".join(sorted(registry.parts[kind])) or "none"
        raise error(f"{what} is registered by no installed plugin (known {kind}: {known})")
    return registry.parts[kind][name]


def layer_budgets(config: Any, layers: Sequence[Any], stats: Optional[Sequence[Any]] = None) -> List[int]:
    """Each layer's budget: the config's ``allocation`` (:mod:`~kvpolicy_core.parts.allocation`) applied to
    ``budget`` over ``layers`` (:class:`~kvpolicy_core.parts.allocation.LayerInfo`), checked to be one int per
    layer. A budget below the least a layer may keep (``n_sink + recent + 1``, the config's protected tokens
    plus one evictable) is raised to it. ``stats``: the layers' statistics at the end-of-prompt cut, for an
    allocation that needs them (:class:`~kvpolicy_core.parts.allocation.LayerStats`); before it, such an
    allocation's layers keep the default allocation's budgets (``budget``, a sliding-window layer at most its
    window: :func:`~kvpolicy_core.parts.allocation.within_reach`)."""
    config = parse_config(config)
    policy = config.policy
    allocation, owner = allocation_of(config)
    with blamed(f"{owner} raised"):
        if needs_of(allocation).layer_stats and stats is None:
            budgets = within_reach([policy.budget] * len(layers), list(layers))
        else:
            budgets = allocation.budgets(policy.budget, list(layers), *([] if stats is None else [list(stats)]))
    if not isinstance(budgets, (list, tuple)) or len(budgets) != len(layers):
        got = f"{len(budgets)} budgets" if isinstance(budgets, (list, tuple)) else type(budgets).__name__
        raise PluginError(f"{owner} returned {got} for {len(layers)} layers; expected a list of one int per layer")
    floor = policy.n_sink + (policy.recent or 0) + 1
    for info, b in zip(layers, budgets):
        if isinstance(b, bool) or not isinstance(b, int) or b < 1 or b > 2**31 - 1:
            raise PluginError(f"{owner} returned {b!r} for layer {info.index}; expected an int in [1, 2**31 - 1]")
    return [max(b, floor) for b in budgets]


def check_budgets(budgets: Any, n_layers: int) -> List[int]:
    """Explicit per-layer ``budgets`` (``KVCacheBuilder.for_model(..., budgets=...)``): a list or tuple of one int
    in ``[1, 2**31 - 1]`` per layer, else a :class:`ConfigError` naming ``budgets`` (a string ``"8"`` is refused,
    not read as a number: nothing else in the call reads it as text)."""
    if not isinstance(budgets, (list, tuple)):
        raise ConfigError(f"budgets: expected a list of one int per layer ({n_layers}), got {type(budgets).__name__}")
    if len(budgets) != n_layers:
        raise ConfigError(f"budgets: expected one budget per layer ({n_layers}), got {len(budgets)}")
    for i, b in enumerate(budgets):
        if isinstance(b, bool) or not isinstance(b, int) or not 1 <= b <= 2**31 - 1:
            raise ConfigError(f"budgets: layer {i}'s budget must be an int in [1, 2**31 - 1] (got {b!r})")
    return list(budgets)


_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _step_hash(seed: int, layer: int, step: int) -> int:
    return _splitmix64(_splitmix64(_splitmix64(seed & _MASK64) ^ layer) ^ step)


def step_key(seed: int, layer: int, step: int) -> mx.array:
    """The PRNG key of one eviction: a pure function of (seed, layer, step)."""
    return mx.random.key(_step_hash(seed, layer, step))


def step_keys(seed: int, layer: int, steps) -> mx.array:
    """[B, 2] uint32: row b's key is ``step_key(seed, layer, steps[b])`` (``mx.random.key(h)`` is
    ``[h >> 32, h & 0xFFFFFFFF]``), built as one array for a batch of rows."""
    hs = [_step_hash(seed, layer, s) for s in steps]
    return mx.array([[h >> 32, h & 0xFFFFFFFF] for h in hs], dtype=mx.uint32)
