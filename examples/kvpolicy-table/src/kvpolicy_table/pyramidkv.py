"""PyramidKV (Cai et al., 2024, arXiv:2406.02069): H2O with budgets falling linearly with depth.

With ``L`` layers, ``b_min = budget / beta`` and ``b_max = 2 * budget - b_min``, layer ``l`` keeps at most::

    b_l = round(b_max - l * (b_max - b_min) / (L - 1))

(core's ``pyramid`` allocation, :class:`kvpolicy_core.parts.allocation.PyramidAllocation`), so the mean over
layers is ``budget``: the first layers, whose attention is spread wide, keep the most. Scoring, selection and
eviction are H2O's. ``pyramid_beta=1`` is the uniform allocation, i.e. ``h2o`` bit for bit.
"""

from pydantic import Field

from kvpolicy_core import AttentionPolicyConfig, MethodSpec, hookimpl


class PyramidKVConfig(AttentionPolicyConfig):
    """``method="pyramidkv"``: H2O's fields, the pyramid allocation and its slope ``pyramid_beta``."""

    allocation: str = Field("pyramid", description="How the budget is shared between layers (the pyramid).")
    pyramid_beta: float = Field(20.0, ge=1.0, le=1e6, description="b_max / b_min ratio term (1: uniform).")


@hookimpl
def register_methods(register):
    register(
        MethodSpec(
            "pyramidkv",
            PyramidKVConfig,
            PyramidKVConfig.scorer_name.fget,
            "lowest_score",
            "drop",
            description="PyramidKV: H2O with per-layer budgets falling linearly with depth (mean = budget).",
        )
    )
