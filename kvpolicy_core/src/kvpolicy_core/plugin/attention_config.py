"""Config fields of the attention-scored methods (H2O, CaM): the signal and the observation window.

``signal``: whose queries score the cache: ``"observed"`` (the model's real queries,
through kvpolicy's attention hook) or ``"proxy"`` (each new key used as the query;
the specification's H2O-adapted, no hook).

``obs_window``/``pool``: a prompt chunk is scored by the attention of its last
``obs_window`` queries, max-pooled over ``pool`` neighbouring positions
(:class:`~kvpolicy_core.parts.observation_window.ObservationWindowScorer`). ``None``
means the signal's default: ``observed`` -> 32 and 15 (measured on the retrieval task,
docs/methods/h2o.md), ``proxy`` -> 0 (every query) and 1 (no pooling), which is exactly
the specification's cumulative scorer, so ``signal=proxy`` is the v0.1 behaviour and
``signal=proxy,recent=0`` the specification's reproduction.
"""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field, model_validator

from .policy_config import PolicyConfig

#: (obs_window, pool) used when the field is None, per signal.
WINDOW_DEFAULTS = {"observed": (32, 15), "proxy": (0, 1)}


class AttentionPolicyConfig(PolicyConfig):
    """:class:`PolicyConfig` plus the scorer fields of attention-scored methods."""

    signal: Literal["proxy", "observed"] = Field(
        "observed",
        description="Score signal: 'observed' the model's real queries (attention hook); 'proxy' each new key as the query.",  # noqa: E501
    )
    obs_window: Optional[int] = Field(
        None,
        ge=0,
        description="Prompt chunks are scored by their last obs_window queries (0: all; None: 32 observed, 0 proxy).",
    )
    pool: Optional[int] = Field(
        None,
        ge=1,
        description="Max-pool width over neighbouring positions for chunk scores (odd; 1: none; None: 15 observed, 1 proxy).",  # noqa: E501
    )

    @model_validator(mode="after")
    def _odd_pool(self):
        if self.pool is not None and self.pool % 2 == 0:
            raise ValueError(f"pool must be odd (a centred window of neighbours); got pool={self.pool}")
        return self

    @property
    def obs_window_rows(self) -> int:
        return WINDOW_DEFAULTS[self.signal][0] if self.obs_window is None else self.obs_window

    @property
    def pool_width(self) -> int:
        return WINDOW_DEFAULTS[self.signal][1] if self.pool is None else self.pool

    @property
    def scorer_name(self) -> str:
        """``cumulative_attention`` when every query counts and nothing is pooled, else ``observation_window``."""
        if self.obs_window_rows == 0 and self.pool_width == 1:
            return "cumulative_attention"
        return "observation_window"
