"""CaM's configuration: the shared budget fields plus the merge rule."""

from typing import Literal

from pydantic import AliasChoices, Field

from kvpolicy_core.config import PolicyConfig


class CamConfig(PolicyConfig):
    """``method="cam"``; the specification's ``cam_*`` fields without the prefix.

    ``merge``: ``"sim_weighted"`` (cosine-weighted blend into the most similar
    survivor, default), ``"mean"`` (weight 1/2), ``"drop"`` (no merge: exactly H2O),
    ``"paper"`` (the CaM paper's rule: the loser's value / m added to the next m
    retained tokens), ``"mass"`` (attention-rate-weighted blend plus the merged slot's
    attention log-weight, mass preserving), ``"mass_blend"`` (cumulative-mass-weighted blend,
    no log-weight). Config strings may say ``gate``, ``keys`` and ``m``.
    """

    merge: Literal["sim_weighted", "mean", "drop", "paper", "mass", "mass_blend"] = Field("sim_weighted", description="Merge rule.")
    merge_gate: bool = Field(
        True,
        validation_alias=AliasChoices("merge_gate", "gate"),
        description="Bernoulli gate p = clamp(score(loser) / score(target), 0, 1) (paper's Eq. 14).",
    )
    merge_keys: bool = Field(
        False, validation_alias=AliasChoices("merge_keys", "keys"), description="Blend keys as well as values."
    )
    merge_window: int = Field(
        16,
        ge=1,
        validation_alias=AliasChoices("merge_window", "m"),
        description="m, the number of following tokens the paper's merge spreads a loser over.",
    )

    @property
    def merge_mode(self) -> str:
        """The merge rule (``cache.merge_mode`` reads it)."""
        return self.merge
