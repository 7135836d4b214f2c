"""Budgets in bytes: the token budget that keeps a model's kept KV cache within ``kv_memory`` bytes.

A layer ``l`` stores, per kept token and sequence, its keys and values and the slot's position and score::

    c_l = H_l * (r(D_k) + r(D_v) + 8)        (int32 position + float32 score per KV head)

with ``H_l`` the layer's KV heads, ``D_k``/``D_v`` its key and value head dims and ``r(D)`` the bytes of a stored row
of ``D`` elements: ``D * itemsize`` in the model's KV dtype (or ``kv_dtype``'s), and with ``kv_bits = q`` and
``kv_group_size = g`` (``mx.quantize`` rows) ``D * q / 8 + 2 * (D / g) * itemsize`` (the packed integers and one
scale and bias per group). Under the config's allocation a mean budget ``b`` gives layer ``l`` its budget
``b_l(b)``; the chosen budget is the largest ``b`` whose kept bytes fit::

    bytes(b) = sum_l b_l(b) * c_l  <=  kv_memory        (per sequence; batch rows each hold their own)

found by bisection (``b_l`` never falls when ``b`` grows). These are the bytes the caches keep once the prompt is
cut; a prompt held for its cut holds up to ``hold`` times as much (docs/configuration.md).
"""

from __future__ import annotations

from typing import List, NamedTuple, Optional, Tuple

from ..config.attention_config import MAX_TOKENS
from ..config.cache_config import KVCacheConfig
from ..config.policy import layer_budgets
from ..errors import ConfigError, ModelError
from ..parts.allocation import LayerInfo


class MemoryBudget(NamedTuple):
    """What :func:`budget_for_memory` chose."""

    budget: int  #: the mean token budget per layer
    kept_bytes: int  #: bytes the caches keep at that budget (one sequence)
    bytes_per_token: int  #: ``sum_l c_l``: one token kept in every layer


def row_bytes(d: int, itemsize: int, bits: Optional[int] = None, group_size: int = 64) -> int:
    """``r(D)`` (see the module): bytes of one stored row of ``d`` elements."""
    return d * itemsize if bits is None else d * bits // 8 + 2 * (d // group_size) * itemsize


def bytes_per_token(
    shapes: List[Optional[Tuple[int, int, int]]], itemsize: int, bits: Optional[int] = None, group_size: int = 64
) -> List[int]:
    """``c_l`` of each layer (see the module) from its (KV heads, key dim, value dim); 0 for a layer without keys."""
    r = lambda d: row_bytes(d, itemsize, bits, group_size)  # noqa: E731
    return [0 if s is None else s[0] * (r(s[1]) + r(s[2]) + 8) for s in shapes]


def budget_for_memory(config: KVCacheConfig, infos: List[LayerInfo], costs: List[int], kv_memory: int) -> MemoryBudget:
    """The largest mean budget whose kept bytes ``sum_l b_l * c_l`` fit ``kv_memory`` (see the module).

    Raises :class:`ConfigError` naming ``kv_memory`` when not even the method's least budget fits."""
    per_token = sum(costs)
    if per_token <= 0:
        raise ModelError("kv_memory: the model's caches hold no keys to budget")

    def kept(b: int) -> Optional[int]:
        try:
            budgets = layer_budgets(config.replace(budget=b, kv_memory=None), infos)
        except ConfigError:
            return None  # below the method's least budget (n_sink + recent + 1)
        return sum(bl * c for bl, c in zip(budgets, costs))

    lo, hi = 1, min(MAX_TOKENS, kv_memory // min(c for c in costs if c > 0) + 1)
    while kept(lo) is None and lo < hi:  # the least budget the method accepts
        lo += 1
    least = kept(lo)
    if least is None or least > kv_memory:
        raise ConfigError(
            f"kv_memory: {kv_memory} bytes is less than this method's least cache on this model "
            f"({'?' if least is None else least} bytes at budget={lo}: {per_token} bytes per token over its layers); "
            "give more memory or a smaller n_sink/recent"
        )
    while lo < hi:  # invariant: kept(lo) fits; the answer is in [lo, hi]
        mid = (lo + hi + 1) // 2
        k = kept(mid)
        if k is not None and k <= kv_memory:
            lo = mid
        else:
            hi = mid - 1
    return MemoryBudget(lo, kept(lo), per_token)
