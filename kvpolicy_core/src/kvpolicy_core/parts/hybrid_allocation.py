"""The ``hybrid`` allocation: on a model that mixes sliding-window and global layers, the budget goes where
attention can still reach at decode time.

Past its window a sliding-window layer attends only its last ``w`` positions, so at decode the tokens it keeps
serve local quality only; a fact stated early in a long prompt reaches the answer through the global layers
alone. :class:`HybridAllocation` gives each sliding layer a share ``s`` of the mean budget and the global
layers the rest; the total is the same as every other allocation's (``N * budget``).
"""

from __future__ import annotations

from typing import List, Optional, Sequence

from .allocation import Allocation, LayerInfo, ReachAllocation
from .base import Needs

#: the share of the mean budget a sliding-window layer keeps (chosen on the tuning set:
#: benchmarks/hybrid_allocation.py, docs/results/long-context-budgets-by-reach.md)
DEFAULT_SLIDE_SHARE = 0.5


class HybridAllocation(Allocation):
    """Sliding-window layers keep a share of the budget, the global layers the rest.

    With ``N`` layers, ``S`` of them sliding (windows ``w_l``) and ``G = N - S`` global, the mean budget
    ``budget``, the share ``s`` (the config field ``slide_share`` where a method has it, else
    :data:`DEFAULT_SLIDE_SHARE`) and ``f`` the least a layer may keep (``n_sink + recent + 1``)::

        b_l = min(w_l, max(f, round(s * budget)))                   a sliding layer
        b_g = (N * budget - sum_sliding b_l) / G                    each global layer (the remainder of the
                                                                    division one token each to the first ones)

    so the total is exactly ``N * budget`` and each global layer keeps at least ``budget``. ``s = 1`` is
    :class:`~.allocation.ReachAllocation` (a sliding layer ``min(w_l, budget)``, the global layers what that
    frees); at a budget of ``w_l / s`` or more a sliding layer keeps its whole window under both. On Gemma 3 270M
    (15 sliding layers of 512, 3 global) at ``budget=187`` (8x of a 1.5k-token prompt), ``s = 0.5``: sliding
    94, global 652 (``reach``: 187 everywhere).

    A model without sliding layers gets ``budget`` everywhere (:class:`~.allocation.UniformAllocation` bit for
    bit); a model whose layers all slide gets :class:`~.allocation.ReachAllocation`'s budgets (no global layer
    to give to). The rule assumes prompts longer than the window, where a sliding layer cannot reach the
    prompt's start; a sliding layer whose window exceeds the prompt attends like a global one and is still
    given ``s * budget``.

    *When.* Under the end-of-prompt cut (``when="prompt_end"``) these budgets are taken at the cut, where a prompt's
    facts must be carried past the sliding windows; before it, and in decode-only streaming where no prompt is ever
    cut (perplexity token by token), every layer keeps :class:`~.allocation.ReachAllocation`'s budget, the local
    context the sliding layers' quality needs. With ``when="stream"`` they hold from the start.

    Not the default: it answers questions about facts far back in the prompt where ``reach`` cannot, but takes
    local context from the sliding layers, which a short prompt's questions can need
    (docs/results/long-context-budgets-by-reach.md#hybrid-models-the-budget-where-attention-reaches).
    """

    def __init__(self, share: float = DEFAULT_SLIDE_SHARE, floor: int = 1) -> None:
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 < share <= 1:
            raise ValueError(f"slide_share must be a number in (0, 1] (got {share!r})")
        if isinstance(floor, bool) or not isinstance(floor, int) or floor < 1:
            raise ValueError(f"floor must be an int >= 1 (got {floor!r})")
        self.share, self.floor = float(share), floor

    @classmethod
    def from_config(cls, config) -> "HybridAllocation":
        floor = getattr(config, "n_sink", 0) + (getattr(config, "recent", None) or 0) + 1
        allocation = cls(getattr(config, "slide_share", DEFAULT_SLIDE_SHARE), floor)
        if getattr(config, "when", "stream") == "prompt_end":
            # taken at the cut, when a prompt is cut: until then, and in decode-only streaming where no prompt is
            # ever cut (perplexity token by token), each layer keeps reach's budget (the statistics are not read)
            allocation.needs = Needs(layer_stats=True)
        return allocation

    def budgets(self, budget: int, layers: Sequence[LayerInfo], stats=None) -> List[int]:
        n_global = sum(1 for info in layers if info.window is None)
        if n_global in (0, len(layers)):  # nothing to move: uniform (no window) or reach (every layer slides)
            return ReachAllocation().budgets(budget, layers)
        local = max(self.floor, int(round(self.share * budget)))
        out: List[Optional[int]] = [None if info.window is None else min(info.window, local) for info in layers]
        rest = budget * len(layers) - sum(b for b in out if b is not None)
        level, extra = divmod(rest, n_global)
        k = 0
        for i, b in enumerate(out):
            if b is None:
                out[i] = level + (1 if k < extra else 0)
                k += 1
        return out
