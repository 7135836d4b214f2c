"""Allocations: how a method's ``budget`` is shared between the layers of a model (a schedule part).

An allocation is registered by name (``register_allocations``) and chosen with the config field
``allocation`` (``"h2o:budget=256,allocation=pyramid"``), so any scorer, selector and disposition
composes with any allocation, as kvpress's ``PyramidKVPress`` and ``PerLayerCompressionPress`` wrap
any scorer press. ``budget`` is then the *mean* tokens kept per layer; layer ``l`` never keeps more
than its own budget ``b_l``. :class:`UniformAllocation` (the default) gives every layer ``budget``.

The builder calls :meth:`Allocation.budgets` once per model, with each layer's :class:`LayerInfo`, and
builds each layer's cache with its own budget (the config of layer ``l`` is the method's config with
``budget = b_l``, so a saved cache resumes with its own budget).
"""

from __future__ import annotations

from typing import List, NamedTuple, Optional, Sequence


class LayerInfo(NamedTuple):
    """What an allocation may know of a layer before any token."""

    index: int  #: the model's global layer index
    n_layers: int  #: layers in the model
    window: Optional[int]  #: the sliding window of the layer, or None for global attention


class Allocation:
    """Per-layer budgets from the method's config. Subclass and implement :meth:`budgets`."""

    @classmethod
    def from_config(cls, config) -> "Allocation":
        return cls()

    def budgets(self, budget: int, layers: Sequence[LayerInfo]) -> List[int]:
        """One int budget per entry of ``layers``; each must leave room to evict (the builder checks)."""
        raise NotImplementedError


class UniformAllocation(Allocation):
    """``b_l = budget`` for every layer."""

    def budgets(self, budget: int, layers: Sequence[LayerInfo]) -> List[int]:
        return [budget] * len(layers)


class PyramidAllocation(Allocation):
    """PyramidKV (Cai et al., 2024, arXiv:2406.02069): budgets falling linearly with depth, mean ``budget``.

    With ``L`` layers, ``b_min = budget / beta`` and ``b_max = 2 * budget - b_min``::

        b_l = round(b_max - l * (b_max - b_min) / (L - 1))

    so the first layers, whose attention is spread wide, keep the most. ``beta`` (the config field
    ``pyramid_beta`` where a method has it, else 20 as in the paper's code) sets the slope: ``beta = 1`` is
    uniform. A budget below the config's floor (``floor``: the least a layer may keep, sinks and recent
    tokens plus one) is raised to it, so the mean can exceed ``budget`` by the raised amounts.
    """

    def __init__(self, beta: float = 20.0) -> None:
        if not beta >= 1:
            raise ValueError(f"pyramid_beta must be >= 1 (got {beta})")
        self.beta = float(beta)

    @classmethod
    def from_config(cls, config) -> "PyramidAllocation":
        return cls(getattr(config, "pyramid_beta", 20.0))

    def budgets(self, budget: int, layers: Sequence[LayerInfo]) -> List[int]:
        if not layers:
            return []
        L = layers[0].n_layers
        lo = budget / self.beta
        hi = 2 * budget - lo
        step = (hi - lo) / (L - 1) if L > 1 else 0.0
        return [int(round(hi - info.index * step)) if L > 1 else budget for info in layers]
