"""Allocations: how a method's ``budget`` is shared between the layers of a model (a schedule part).

An allocation is registered by name (``register_allocations``) and chosen with the config field
``allocation`` (``"h2o:budget=256,allocation=pyramid"``), so any scorer, selector and disposition
composes with any allocation, as kvpress's ``PyramidKVPress`` and ``PerLayerCompressionPress`` wrap
any scorer press. ``budget`` is then the *mean* tokens kept per layer; layer ``l`` never keeps more
than its own budget ``b_l``. :class:`ReachAllocation` (the default) gives every layer ``budget`` but a
sliding-window layer no more than its window, and shares what that frees among the global layers;
:class:`UniformAllocation` gives every layer ``budget``; ``hybrid``
(:class:`~.hybrid_allocation.HybridAllocation`) gives a sliding layer a share of ``budget`` and the global layers
the rest.

The builder calls :meth:`Allocation.budgets` once per model, with each layer's :class:`LayerInfo`, and
builds each layer's cache with its own budget (the config of layer ``l`` is the method's config with
``budget = b_l``, so a saved cache resumes with its own budget).

*From data.* An allocation that declares ``needs = Needs(layer_stats=True)`` is called again at the end-of-prompt
cut (``when="prompt_end"``) with ``stats``: one :class:`LayerStats` per layer, measured by the engine over the
prompt (SqueezeAttention's calibration pass, without a second pass and without wrapping model modules); the
caches keep the default allocation's budgets until then. Its layers are those with a policy cache (with
``layers="unbounded"``, a sliding layer that keeps mlx-lm's cache is neither measured nor allocated), and the
statistics are part of each cache's state (:mod:`kvpolicy_core.cache.layer_group`): saved, pickled, copied and
batched with it.
"""

from __future__ import annotations

from typing import List, NamedTuple, Optional, Sequence

from .base import Needs


class LayerInfo(NamedTuple):
    """What an allocation may know of a layer before any token."""

    index: int  #: the model's global layer index
    n_layers: int  #: layers in the model
    window: Optional[int]  #: the sliding window of the layer, or None for global attention


class LayerStats(NamedTuple):
    """What the engine measured of one layer over the prompt (its observed queries, at the attention hook).

    ``change``: how much the layer's attention changes what each query token carries, in the attention's own
    space: ``mean_{h, i} (1 - cos(o_{h,i}, v_{h,i}))`` over the last queries of each prompt chunk (at most 32),
    ``o`` the attention output and ``v`` the token's own value (its query head's KV head). A layer whose
    queries mostly read themselves changes little.
    """

    change: float
    tokens: int  #: the query rows measured


class Allocation:
    """Per-layer budgets from the method's config. Subclass and implement :meth:`budgets`."""

    needs: Needs = Needs()

    @classmethod
    def from_config(cls, config) -> "Allocation":
        return cls()

    def budgets(
        self, budget: int, layers: Sequence[LayerInfo], stats: Optional[Sequence[LayerStats]] = None
    ) -> List[int]:
        """One int budget per entry of ``layers``; each must leave room to evict (the builder checks). ``stats``:
        one :class:`LayerStats` per layer, for an allocation with ``Needs(layer_stats=True)`` at the end-of-prompt
        cut (None when it is built)."""
        raise NotImplementedError


class UniformAllocation(Allocation):
    """``b_l = budget`` for every layer."""

    def budgets(self, budget: int, layers: Sequence[LayerInfo], stats=None) -> List[int]:
        return [budget] * len(layers)


def within_reach(budgets: Sequence[int], layers: Sequence[LayerInfo]) -> List[int]:
    """``budgets`` with every sliding-window layer at most its window, what that frees shared by the others, as
    :class:`ReachAllocation` shares it.

    With ``b_l`` the given budgets, ``w_l`` each layer's reach (its window, or unbounded) and ``T = sum_l b_l``::

        b'_l = min(w_l, b_l + e),   e >= 0 the least level with  sum_l b'_l = T

    (an integer ``e``; a remainder of less than one token per uncapped layer goes one token each to the first of
    them), so the total stays ``T`` unless every layer is capped, and budgets that fit their windows are unchanged.
    Uniform budgets give :class:`ReachAllocation`'s bit for bit; :class:`PyramidAllocation` and data-driven
    allocations (kvpolicy-table's ``squeeze``) apply it to theirs, :class:`UniformAllocation` does not.
    """
    out: List[Optional[int]] = [None] * len(layers)
    free, spare = len(layers), 0  # uncapped layers; slots freed by the capped ones beyond their own budgets
    for room, i in sorted((info.window - budgets[i], i) for i, info in enumerate(layers) if info.window is not None):
        if room * free > spare:  # below the level: the rest stay uncapped
            break
        out[i], spare, free = layers[i].window, spare - room, free - 1
    if free:
        level, extra = divmod(spare, free)
        uncapped = [i for i in range(len(layers)) if out[i] is None]
        for k, i in enumerate(uncapped):
            out[i] = budgets[i] + level + (1 if k < extra else 0)
    return out


class ReachAllocation(Allocation):
    """Equal shares, each layer at most what its attention can reach: ``budget`` is the mean tokens kept per layer.

    A sliding-window layer (window ``w_l``) never attends further than its last ``w_l`` tokens, so slots beyond
    them are dead weight; a global layer reaches every token. With ``N`` layers, the budgets are the water level
    ``c`` capped by each layer's reach ``r_l`` (``w_l``, or unbounded for a global layer)::

        b_l = min(r_l, c),   c the largest level with  sum_l min(r_l, c) <= N * budget

    so a model without sliding layers (or with windows >= ``budget``) gets ``budget`` everywhere, i.e.
    :class:`UniformAllocation` bit for bit, and on a hybrid model (Gemma 3: 5 of 6 layers slide over 512 tokens)
    the slots a window cannot use go to the global layers, which hold the long range: at ``budget=1024`` on
    Gemma 3 270M (15 sliding layers, 3 global) ``b = 512`` sliding and ``3584`` global, the same total
    (docs/results/long-context-budgets-by-reach.md). A remainder of less than one token per uncapped layer
    goes one token each to the first of them, so the total is exactly ``N * budget`` unless every layer is
    capped by its window (then less: no layer could use more).
    """

    def budgets(self, budget: int, layers: Sequence[LayerInfo], stats=None) -> List[int]:
        return within_reach([budget] * len(layers), layers)


class PyramidAllocation(Allocation):
    """PyramidKV (Cai et al., 2024, arXiv:2406.02069): budgets falling linearly with depth, mean ``budget``.

    With ``L`` layers, ``b_min = budget / beta`` and ``b_max = 2 * budget - b_min``::

        b_l = max(1, round(b_max - l * (b_max - b_min) / (L - 1)))

    so the first layers, whose attention is spread wide, keep the most; a sliding-window layer then keeps at most
    its window, what that frees shared by the others (:func:`within_reach`), so ``beta = 1`` is the default
    allocation (:class:`ReachAllocation`) bit for bit. ``beta`` (the config field ``pyramid_beta`` where a method
    has it, else 20 as in the paper's code) sets the slope. A budget below the config's floor (``floor``: the least
    a layer may keep, sinks and recent tokens plus one) is raised to it, so the mean can exceed ``budget`` by the
    raised amounts.
    """

    def __init__(self, beta: float = 20.0) -> None:
        if not beta >= 1:
            raise ValueError(f"pyramid_beta must be >= 1 (got {beta})")
        self.beta = float(beta)

    @classmethod
    def from_config(cls, config) -> "PyramidAllocation":
        return cls(getattr(config, "pyramid_beta", 20.0))

    def budgets(self, budget: int, layers: Sequence[LayerInfo], stats=None) -> List[int]:
        if not layers:
            return []
        L = layers[0].n_layers
        lo = budget / self.beta
        hi = 2 * budget - lo
        step = (hi - lo) / (L - 1) if L > 1 else 0.0
        return within_reach(
            [max(1, int(round(hi - info.index * step))) if L > 1 else budget for info in layers], layers
        )
