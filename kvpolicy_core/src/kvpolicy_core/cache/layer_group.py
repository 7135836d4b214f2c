"""The caches of one model built together, for an allocation that sets the layers' budgets from the prompt.

An allocation with ``Needs(layer_stats=True)`` (:mod:`kvpolicy_core.parts.allocation`) needs every layer's
statistics of the prompt before any layer is cut. With ``when="prompt_end"`` that holds at the first decode
step: mlx-lm has run the whole prompt through every layer. So each cache records its statistic as its
prompt chunks pass the attention hook (:meth:`LayerGroup.record`: lazy MLX sums, no host sync), and the first
cache to cut asks the group for its budget (:meth:`LayerGroup.budget_for`): the group then reads every layer's
statistic (one host sync, once per prompt), calls the allocation once and gives each layer its budget. A later
prompt on the same caches (the next turn of a chat) is measured and shared again.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional

import mlx.core as mx

from ..parts.allocation import LayerInfo, LayerStats

#: query rows measured per prompt chunk and layer (the chunk's last ones: the question when it ends the prompt)
ROWS = 32


def attention_change(out: mx.array, values: mx.array) -> mx.array:
    """``sum_{b, h, i} (1 - cos(o_{h,i}, v_{h,i}))`` float32 scalar: out [B, Hq, R, Dv] the attention output of
    R query tokens, values [B, H, R, Dv] those tokens' own values (Hq a multiple of H: each query head reads
    its KV head's value)."""
    H, Hq = values.shape[1], out.shape[1]
    v = mx.repeat(values, Hq // H, axis=1) if Hq != H else values
    o, v = out.astype(mx.float32), v.astype(mx.float32)
    cos = (o * v).sum(-1) / (mx.sqrt((o * o).sum(-1) * (v * v).sum(-1)) + 1e-12)
    return mx.nan_to_num(1.0 - cos, nan=0.0).sum()


class LayerGroup:
    """What the caches of one model share for a data-driven allocation (see the module).

    Args:
        budgets: ``(infos, stats) -> budgets``, the checked allocation (:func:`~kvpolicy_core.config.policy.
            layer_budgets` with the config bound).
        infos: one :class:`~kvpolicy_core.parts.allocation.LayerInfo` per cache of the group, in order.
        policy_for: ``(layer, budget) -> Policy``: the layer's policy with that budget (shared by equal ones).
    """

    def __init__(
        self,
        budgets: Callable[[List[LayerInfo], List[LayerStats]], List[int]],
        infos: List[LayerInfo],
        policy_for: Callable[[int, int], Any],
    ):
        self._budgets, self.infos, self.policy_for = budgets, infos, policy_for
        self._sums: Dict[int, mx.array] = {}
        self._rows: Dict[int, int] = {}
        self._decided: Optional[Dict[int, int]] = None

    def record(self, layer: int, out: mx.array, values: mx.array) -> None:
        """Add one prompt chunk's last query rows of ``layer`` (:func:`attention_change`); a new prompt after a
        decision starts a new measurement."""
        if self._decided is not None:
            self._decided, self._sums, self._rows = None, {}, {}
        R = min(ROWS, out.shape[2])
        change = attention_change(out[:, :, -R:], values[:, :, -R:])
        self._sums[layer] = change if layer not in self._sums else self._sums[layer] + change
        self._rows[layer] = self._rows.get(layer, 0) + out.shape[0] * out.shape[1] * R

    def budget_for(self, layer: int, default: int) -> int:
        """``layer``'s budget for this prompt's cut (``default`` when nothing was measured)."""
        if self._decided is None:
            if len(self._sums) < len(self.infos):  # a layer saw no prompt chunk (a one-token prompt)
                return default
            sums = [self._sums[i.index] for i in self.infos]
            values = mx.stack(sums).tolist()  # one host sync per prompt, at its end
            stats = [
                LayerStats(v / max(self._rows[i.index], 1), self._rows[i.index]) for v, i in zip(values, self.infos)
            ]
            self._decided = dict(zip((i.index for i in self.infos), self._budgets(self.infos, stats)))
        return self._decided.get(layer, default)
