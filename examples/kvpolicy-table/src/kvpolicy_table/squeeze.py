"""SqueezeAttention (Wang et al., 2024, arXiv:2404.04793), adapted: per-layer budgets from how much each layer's
attention changes what it reads, measured on the prompt; H2O's score and drop within each layer.

The paper measures ``cos`` of the hidden state before and after each attention block and squeezes the budgets
of the layers that change it least. kvpolicy measures at the attention itself, what the engine sees without
wrapping model modules (:class:`kvpolicy_core.parts.allocation.LayerStats`): ``d_l = mean (1 - cos(o, v))``,
the attention output against the query token's own value. With ``s = strength`` and ``dbar`` the mean::

    b_l = round(budget * ((1 - s) + s * d_l / dbar))

so the mean stays ``budget``; ``strength=0`` is uniform, i.e. ``h2o:when=prompt_end`` bit for bit. The budgets
are set at the end of the prompt (``when="prompt_end"``), once the engine has measured every layer.
"""

from typing import Literal

from pydantic import Field

from kvpolicy_core import AttentionPolicyConfig, MethodSpec, Needs, hookimpl
from kvpolicy_core.parts.allocation import Allocation


class SqueezeConfig(AttentionPolicyConfig):
    """``method="squeeze"``: H2O's fields, cut at the end of the prompt with budgets from the prompt."""

    allocation: str = Field("squeeze", description="Budgets from each layer's attention change.")
    when: Literal["stream", "prompt_end"] = Field("prompt_end", description="Budgets are set at the prompt's end.")
    strength: float = Field(0.5, ge=0.0, le=1.0, description="0: uniform budgets; 1: proportional to the change.")


class SqueezeAllocation(Allocation):
    needs = Needs(layer_stats=True)

    def __init__(self, strength: float = 0.5) -> None:
        self.strength = strength

    @classmethod
    def from_config(cls, config) -> "SqueezeAllocation":
        return cls(getattr(config, "strength", 0.5))

    def budgets(self, budget, layers, stats=None):
        if not stats or self.strength == 0:
            return [budget] * len(layers)
        d = [max(st.change, 1e-6) for st in stats]
        mean = sum(d) / len(d)
        return [int(round(budget * ((1 - self.strength) + self.strength * x / mean))) for x in d]


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
