"""SqueezeAttention (Wang et al., 2024, arXiv:2404.04793), adapted: per-layer budgets from how much each layer's
attention changes what it reads, measured on the prompt; H2O's score and drop within each layer.

The paper measures ``cos`` of the hidden state before and after each attention block and squeezes the budgets
of the layers that change it least. kvpolicy measures at the attention itself, what the engine sees without
wrapping model modules (:class:`kvpolicy_core.parts.allocation.LayerStats`): ``d_l = mean (1 - cos(o, v))``,
the attention output against the query token's own value. With ``s = strength`` and ``dbar`` the mean::

    x_l = budget * ((1 - s) + s * d_l / dbar),   b_l = x_l apportioned to integers, each at least f

so the mean stays ``budget`` exactly: a layer whose share is below the least a layer may keep
(``f = n_sink + recent + 1``, at least 1) keeps ``f``, the others share the rest in proportion to ``x_l``, and the
integers are the largest remainders of those shares (ties to the first layer). ``strength=0`` is uniform, i.e.
``h2o:when=prompt_end`` bit for bit, on a model with sliding-window layers too: each sliding layer then keeps at
most its window, what that frees shared by the others, as the default allocation shares it
(:func:`~kvpolicy_core.parts.allocation.within_reach`). The budgets are set at the end of the prompt
(``when="prompt_end"``), once the engine has measured every layer.
"""

from typing import List, Literal

from pydantic import Field

from kvpolicy_core import AttentionPolicyConfig, MethodSpec, Needs, hookimpl
from kvpolicy_core.parts.allocation import Allocation, within_reach


class SqueezeConfig(AttentionPolicyConfig):
    """``method="squeeze"``: H2O's fields, cut at the end of the prompt with budgets from the prompt."""

    allocation: str = Field("squeeze", description="Budgets from each layer's attention change.")
    when: Literal["stream", "prompt_end"] = Field("prompt_end", description="Budgets are set at the prompt's end.")
    strength: float = Field(0.5, ge=0.0, le=1.0, description="0: uniform budgets; 1: proportional to the change.")


class SqueezeAllocation(Allocation):
    needs = Needs(layer_stats=True)

    def __init__(self, strength: float = 0.5, floor: int = 1) -> None:
        self.strength, self.floor = strength, max(1, floor)

    @classmethod
    def from_config(cls, config) -> "SqueezeAllocation":
        floor = getattr(config, "n_sink", 0) + (getattr(config, "recent", None) or 0) + 1
        return cls(getattr(config, "strength", 0.5), floor)

    def budgets(self, budget, layers, stats=None):
        if not stats or self.strength == 0:
            return within_reach([budget] * len(layers), layers)
        d = [max(st.change, 1e-6) for st in stats]
        mean = sum(d) / len(d)
        shares = [budget * ((1 - self.strength) + self.strength * x / mean) for x in d]
        return within_reach(apportion(shares, budget * len(layers), min(self.floor, budget)), layers)


def apportion(shares: List[float], total: int, floor: int) -> List[int]:
    """Integers >= ``floor`` summing to ``total`` (``len(shares) * floor <= total``), in proportion to ``shares``
    above the floor: the shares below it are raised to it, the rest scaled to what remains (repeated while a
    scaled share falls below), then rounded down and the remaining units given to the largest remainders."""
    fixed = [False] * len(shares)
    while True:
        rest = total - floor * sum(fixed)
        weight = sum(s for s, f in zip(shares, fixed) if not f)
        x = [
            floor if f else (s * rest / weight if weight > 0 else rest / (len(shares) - sum(fixed)))
            for s, f in zip(shares, fixed)
        ]
        low = [i for i, v in enumerate(x) if not fixed[i] and v < floor]
        if not low:
            break
        for i in low:
            fixed[i] = True
    out = [max(floor, int(v)) for v in x]
    order = sorted(range(len(x)), key=lambda i: (-(x[i] - int(x[i])), i))
    for i in order[: total - sum(out)]:
        out[i] += 1
    return out


@hookimpl
def register_allocations(register):
    register("squeeze", SqueezeAllocation)


@hookimpl
def register_methods(register):
    register(
        MethodSpec(
            "squeeze",
            SqueezeConfig,
            SqueezeConfig.scorer_name.fget,
            "lowest_score",
            "drop",
            description="SqueezeAttention (adapted): budgets per layer from its attention change on the prompt.",
        )
    )
