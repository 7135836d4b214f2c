"""The fields every budgeted eviction method shares, and how validation errors are worded.

A method's config class subclasses :class:`PolicyConfig`; this module imports nothing of
kvpolicy but its errors, so plugins, the registry and the config API can all build on it.
"""

from __future__ import annotations

import math
from typing import Any, Literal, Mapping, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from .errors import ConfigError

#: Fields of :class:`~kvpolicy_core.config.KVCacheConfig` itself, shared by every method.
COMMON_FIELDS = ("method", "head_dim", "seed", "layers")


class PolicyConfig(BaseModel):
    """Fields shared by every budgeted eviction method.

    ``recent=None`` (the default) protects ``budget // 2`` of the most recent tokens (the
    official H2O's half heavy hitters, half recent split); chosen from a measurement on the
    default model, ``benchmarks/recent_window.py`` (docs/methods/h2o.md).
    """

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    budget: int = Field(512, ge=1, description="Maximum tokens kept per layer, sinks included.")
    n_sink: int = Field(4, ge=0, description="First absolute positions that are never evicted.")
    recent: Optional[int] = Field(
        None, ge=0, description="Most recent tokens protected from eviction (None: budget // 2)."
    )
    signal: Literal["proxy", "observed"] = Field(
        "proxy",
        description="Score signal: 'proxy' uses each new key as the query; 'observed' the model's real queries.",
    )

    @property
    def recent_tokens(self) -> int:
        """The protected recent window actually used: ``recent``, or ``budget // 2`` capped at
        ``budget - n_sink - 1`` so that a token stays evictable."""
        if self.recent is None:
            return max(0, min(self.budget // 2, self.budget - self.n_sink - 1))
        return self.recent

    @model_validator(mode="after")
    def _leave_room_to_evict(self):
        if self.budget <= self.n_sink + self.recent_tokens:
            raise ValueError(
                f"budget must be greater than n_sink + recent so that some token can be evicted; "
                f"got budget={self.budget}, n_sink={self.n_sink}, recent={self.recent_tokens}"
            )
        return self


def format_errors(exc: ValidationError, prefix: str) -> str:
    parts = []
    for err in exc.errors():
        loc = ".".join(str(x) for x in err["loc"]) if err["loc"] else ""
        field = f"{prefix}{loc}" if loc else prefix.rstrip("_.") or "config"
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] in ("extra_forbidden",):
            parts.append(f"{field}: unknown field")
            continue
        shown = err.get("input")
        parts.append(f"{field}: {msg} (got {shown!r})" if err["type"] != "value_error" else f"{field}: {msg}")
    return "; ".join(parts)


def reject_non_finite(data: Mapping[str, Any], where: str) -> None:
    for key, value in data.items():
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{where}{key}: must be a finite number (got {value!r})")


def policy_field_names(config_class) -> set:
    """Field names of a policy config class, with their validation aliases."""
    names = set(config_class.model_fields)
    for field in config_class.model_fields.values():
        alias = field.validation_alias
        if isinstance(alias, str):
            names.add(alias)
        elif alias is not None:
            names.update(a for a in getattr(alias, "choices", []) if isinstance(a, str))
    return names
