"""The policy step of one layer: call the parts, check what they return, evict window-dead slots first.

The parts are plain objects shared by every layer (:class:`~kvpolicy_core.policy.Policy`);
everything per layer (the layer index in error messages, the PRNG key of each eviction)
is added here. A part that raises, or returns the wrong shape, becomes a
:class:`~kvpolicy_core.errors.PluginError` naming the part and its plugin.
"""

from __future__ import annotations

import math
import warnings
from typing import Dict, Optional, Tuple

import mlx.core as mx

from .errors import KVPolicyError, PluginError
from .parts.base import CacheView, MergeUpdate, Selector, pick_lowest
from .policy import Policy, step_key

Counters = Dict[str, mx.array]


def dead_first(dead: mx.array, chosen: mx.array, n_evict: int) -> mx.array:
    """Losers [B, H, E]: the window-dead slots (dead [B, H, L]) first, then the selector's ``chosen``."""
    picked = mx.put_along_axis(mx.zeros(dead.shape, mx.float32), chosen, mx.array(1.0), axis=2)
    ranked = mx.where(dead, -1.0, mx.where(picked > 0, 0.0, math.inf))
    return pick_lowest(ranked, n_evict)


class PolicyStep:
    """Score, select and dispose for one layer, with the checks at the part boundary."""

    def __init__(self, policy: Policy, layer: int) -> None:
        self.policy, self.layer = policy, layer
        sel = type(policy.selector)
        # selectors on the 0.2.0 form rank; Selector.select then puts window-dead slots first
        self.ranked_selection = getattr(sel, "select", None) is Selector.select
        self._warned = False

    def counter_names(self) -> Dict[str, str]:
        """Counters the parts declare through ``stats()`` (name -> meaning)."""
        names: Dict[str, str] = {}
        for part in (self.policy.scorer, self.policy.selector, self.policy.disposition):
            stats = getattr(part, "stats", None)
            if callable(stats):
                names.update(stats())
        return names

    def call(self, kind: str, fn, *args):
        try:
            return fn(*args)
        except KVPolicyError:
            raise
        except Exception as exc:
            raise PluginError(
                f"layer {self.layer}: {self.policy.owners[kind]} raised {type(exc).__name__}: {exc}"
            ) from exc

    def scores(self, scores, shape: Tuple[int, int, int]) -> mx.array:
        """A scorer's result checked to be [B, H, n]; float32, NaN counts as 0 and +-inf as the largest finite
        float32, so that no score can tie with the +-inf a selector's rank uses for protection."""
        if not isinstance(scores, mx.array) or tuple(scores.shape) != tuple(shape):
            raise PluginError(
                f"layer {self.layer}: {self.policy.owners['scorer']} returned scores of shape "
                f"{getattr(scores, 'shape', type(scores).__name__)}, expected {tuple(shape)}"
            )
        return mx.nan_to_num(scores.astype(mx.float32), nan=0.0)

    def on_append(self, view: CacheView, keys: mx.array, new_positions: mx.array) -> mx.array:
        return self.scores(self.call("scorer", self.policy.scorer.on_append, view, keys, new_positions),
                           view.scores.shape)

    def on_attention(self, view: CacheView, queries: mx.array, scale: float, mask) -> mx.array:
        return self.scores(self.call("scorer", self.policy.scorer.on_attention, view, queries, scale, mask),
                           view.scores.shape)

    def losers(self, view: CacheView, n_evict: int) -> mx.array:
        """[B, H, n_evict] int32: window-dead slots first, then the selector's choice."""
        losers = self.call("selector", self.policy.selector.select, view, n_evict)
        expected = (*view.scores.shape[:2], n_evict)
        if not isinstance(losers, mx.array) or tuple(losers.shape) != expected:
            raise PluginError(
                f"layer {self.layer}: {self.policy.owners['selector']} returned losers of shape "
                f"{getattr(losers, 'shape', type(losers).__name__)}, expected {expected}"
            )
        losers = losers.astype(mx.int32)
        if view.dead is not None and not self.ranked_selection:
            losers = dead_first(view.dead, losers, n_evict)
        return losers

    def dispose(self, view: CacheView, losers: mx.array, offset: int) -> Tuple[Optional[MergeUpdate], Counters]:
        """The disposition's update for the survivors (or None) and the counters it reports."""
        key = step_key(self.policy.config.seed, self.layer, offset)
        update = self.call("disposition", self.policy.disposition.dispose, view, losers, key)
        if update is None:
            return None, {}
        counts = dict(update.stats or {})
        if update.draws is not None or update.merges is not None:
            if not self._warned:
                self._warned = True
                warnings.warn(
                    f"{self.policy.owners['disposition']}: MergeUpdate.draws/merges are deprecated since "
                    "kvpolicy 0.2.0; return MergeUpdate(..., stats={'gate_draws': ..., 'merges': ...})",
                    DeprecationWarning, stacklevel=2,
                )
            for name, value in (("gate_draws", update.draws), ("merges", update.merges)):
                if value is not None:
                    counts.setdefault(name, value)
        return update, counts
