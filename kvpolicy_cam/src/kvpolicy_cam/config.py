"""CaM's configuration: the shared budget fields plus the merge rule."""

from typing import Literal, Optional

from pydantic import AliasChoices, Field, field_validator, model_validator

from kvpolicy_core.config.attention_config import MAX_TOKENS, AttentionPolicyConfig

#: Merges weighted by attention mass: ungated unless ``merge_gate`` is given.
MASS_MERGES = ("mass", "mass_blend")
#: ``merge="mass"``'s default key-cosine threshold: a loser with no close survivor is dropped, not smeared into a
#: stranger (chosen on the default corpus, docs/methods/cam.md).
MASS_MIN_SIM = 0.85
#: ``merge="mass"``'s default cap on a merged slot's attention weight: without one, at small budgets a few slots
#: absorb most of the evicted text and their blended keys and values stand for too much (docs/methods/cam.md).
MASS_CAP = 8.0


class CamConfig(AttentionPolicyConfig):
    """``method="cam"``; the specification's ``cam_*`` fields without the prefix.

    Defaults: ``merge="mass"`` with keys, ``min_sim=0.85``,
    decode-step merges only and ``cap=8``, ``signal="observed"``, no gate. The specification's configuration is
    ``merge="sim_weighted", signal="proxy"`` (its
    gate is on by default for that merge).

    ``merge``: ``"sim_weighted"`` (cosine-weighted blend into the most similar
    survivor), ``"mean"`` (weight 1/2), ``"drop"`` (no merge: exactly H2O),
    ``"paper"`` (the CaM paper's rule: the loser's value / m added to the next m
    retained tokens), ``"mass"`` (attention-rate-weighted blend plus the merged slot's
    attention log-weight, mass preserving), ``"mass_blend"`` (cumulative-mass-weighted blend,
    no log-weight). Config strings may say ``gate``, ``keys`` and ``m``.
    """

    merge: Literal["sim_weighted", "mean", "drop", "paper", "mass", "mass_blend"] = Field(
        "mass", description="Merge rule."
    )
    merge_gate: bool = Field(
        True,
        validation_alias=AliasChoices("merge_gate", "gate"),
        description="Bernoulli gate p = clamp(score(loser) / score(target), 0, 1) (paper's Eq. 14); "
        "when not given: on for sim_weighted, mean and paper, off for mass and mass_blend.",
    )
    merge_keys: bool = Field(
        False, validation_alias=AliasChoices("merge_keys", "keys"), description="Blend keys as well as values."
    )
    merge_min_sim: float = Field(
        -1.0,
        allow_inf_nan=False,
        validation_alias=AliasChoices("merge_min_sim", "min_sim"),
        description="mass merges only: a loser merges only if its key cosine to the target is >= min_sim, "
        "else it is dropped; a cosine in [-1, 1] (-1: always merge; merge=drop never merges, i.e. H2O).",
    )
    merge_prompt: bool = Field(
        True,
        validation_alias=AliasChoices("merge_prompt", "prompt"),
        description="mass merges: merge the losers of prompt chunks too (false: only evictions of one loser "
        "per row, i.e. decode steps, merge; a prompt chunk's losers are dropped, as H2O drops them). "
        "Default off for mass.",
    )
    merge_cap: Optional[float] = Field(
        None,
        ge=1.0,
        allow_inf_nan=False,
        validation_alias=AliasChoices("merge_cap", "cap"),
        description="merge=mass only: the most attention weight a merged slot may carry, exp(log-weight) <= cap "
        "(a loser whose target is at the cap is dropped; none: no cap). Default 8 for mass.",
    )
    merge_after: float = Field(
        1.0,
        ge=1.0,
        allow_inf_nan=False,
        validation_alias=AliasChoices("merge_after", "after"),
        description="mass merges only: merges begin once the cache has seen after x budget tokens (the "
        "compression so far); before, losers are dropped as H2O drops them (1: from the first eviction).",
    )
    merge_window: int = Field(
        16,
        ge=1,
        le=MAX_TOKENS,
        validation_alias=AliasChoices("merge_window", "m"),
        description="m, the number of following tokens the paper's merge spreads a loser over.",
    )

    @field_validator("merge_min_sim")
    @classmethod
    def _min_sim_is_a_cosine(cls, value: float) -> float:
        if not -1.0 <= value <= 1.0:
            raise ValueError(
                f"a key cosine threshold in [-1, 1] (got {value!r}); -1 merges every loser, "
                "and merge=drop merges none (H2O exactly)"
            )
        return value

    @model_validator(mode="before")
    @classmethod
    def _merge_defaults(cls, data):
        """Defaults that depend on the merge: the gate is off for the mass merges and on for the others;
        ``merge="mass"`` blends keys, merges only above ``MASS_MIN_SIM``, only at decode steps and into
        slots below ``MASS_CAP`` (docs/methods/cam.md)."""
        if not isinstance(data, dict):
            return data
        merge = data.get("merge", cls.model_fields["merge"].default)
        given = set(data)
        if not ({"merge_gate", "gate"} & given):
            data = {**data, "merge_gate": merge not in MASS_MERGES}
        if merge == "mass" and not ({"merge_keys", "keys"} & given):
            data = {**data, "merge_keys": True}
        if merge == "mass" and not ({"merge_min_sim", "min_sim"} & given):
            data = {**data, "merge_min_sim": MASS_MIN_SIM}
        if merge == "mass" and not ({"merge_prompt", "prompt"} & given):
            data = {**data, "merge_prompt": False}
        if merge == "mass" and not ({"merge_cap", "cap"} & given):
            data = {**data, "merge_cap": MASS_CAP}
        return data

    @model_validator(mode="after")
    def _min_sim_needs_a_mass_merge(self):
        if self.merge_min_sim != -1.0 and self.merge not in MASS_MERGES:
            raise ValueError(f"min_sim applies to the mass merges {MASS_MERGES}; merge={self.merge!r} does not use it")
        if self.merge_cap is not None and self.merge != "mass":
            raise ValueError(
                f"cap applies to merge='mass' (the merge with log-weights); merge={self.merge!r} does not use it"
            )
        if self.merge_after != 1.0 and self.merge not in MASS_MERGES:
            raise ValueError(f"after applies to the mass merges {MASS_MERGES}; merge={self.merge!r} does not use it")
        if not self.merge_prompt and self.merge not in MASS_MERGES:
            raise ValueError(
                f"prompt=false applies to the mass merges {MASS_MERGES}; merge={self.merge!r} "
                "always merges prompt losers"
            )
        return self

    @property
    def merge_mode(self) -> str:
        """The merge rule (``cache.merge_mode`` reads it)."""
        return self.merge
