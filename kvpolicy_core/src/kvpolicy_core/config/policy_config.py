"""The fields every budgeted eviction method shares, and how a method's fields are validated into its config.

A method's config class subclasses :class:`PolicyConfig`; this module imports nothing of
kvpolicy but its errors (no registry), so plugins, the registry and the config API can all build on it.
:func:`policy_from_fields` sorts a method's fields (bare, prefixed or aliased) from the common ones and
validates them by the method's config class: the registry only finds that class (:func:`.parse.resolve`).
"""

from __future__ import annotations

import math
from typing import Any, Dict, Literal, Mapping, Optional, Tuple

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from ..errors import ConfigError

#: Fields of :class:`~kvpolicy_core.config.cache_config.KVCacheConfig` itself, shared by every method.
COMMON_FIELDS = ("method", "head_dim", "seed", "layers", "kv_memory", "kv_bits", "kv_group_size", "kv_dtype")

#: ``Field(..., json_schema_extra=FILLED_BY_BUILDER)`` marks a config field that the builder fills per layer from
#: the model (``rope_freqs``): a user does not set it, so ``kvpolicy methods`` lists it only in ``--json``.
FILLED_BY_BUILDER = {"filled_by": "builder"}


def filled_by_builder(field) -> bool:
    """Whether a pydantic field (``Model.model_fields[name]``) is marked :data:`FILLED_BY_BUILDER`."""
    extra = field.json_schema_extra
    return isinstance(extra, dict) and extra.get("filled_by") == "builder"


class PolicyConfig(BaseModel):
    """Fields shared by every budgeted eviction method.

    ``recent=None`` (the default) protects ``budget // 2`` of the most recent tokens (the
    official H2O's half heavy hitters, half recent split); chosen from a measurement on the
    default model, ``benchmarks/recent_window.py`` (docs/methods/h2o.md).
    """

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    budget: int = Field(
        512,
        ge=1,
        le=2**31 - 1,
        description="Tokens kept per layer on average over the model's layers, sinks included; each layer keeps at "
        "most its own budget: `budget` itself on a model without sliding-window layers under the default `reach` "
        "allocation (a sliding layer keeps at most its window, the global layers share what that frees), more or "
        "less where `allocation` (pyramid, data-driven) or a compress-once ranking shares it unevenly.",
    )
    n_sink: int = Field(4, ge=0, le=2**31 - 1, description="First absolute positions that are never evicted.")
    recent: Optional[int] = Field(
        None, ge=0, le=2**31 - 1, description="Most recent tokens protected from eviction (None: budget // 2)."
    )
    signal: Literal["proxy", "observed"] = Field(
        "proxy",
        description="Score signal: 'proxy' uses each new key as the query; 'observed' the model's real queries.",
    )
    when: Literal["stream", "prompt_end"] = Field(
        "stream",
        description="When the cache evicts: 'stream' after every update (prefill memory bounded by budget + one "
        "chunk); 'prompt_end' holds the prompt whole and cuts it once when the first decode step arrives, scored "
        "with the prompt's last queries (the question's) in view, then streams.",
    )
    hold: Optional[float] = Field(
        None,
        ge=1.0,
        le=2**20,
        description="With when='prompt_end': the most a layer holds while the prompt streams in, as a multiple of "
        "its budget (2: twice the budget); above it the method evicts as it streams, and the prompt's end is cut to "
        "the budget with the question in view. None: the whole prompt is held. 1 holds what when='stream' holds.",
    )
    hold_bits: Optional[Literal[4, 8]] = Field(
        8,
        description="With when='prompt_end' and full-precision rows: a held prompt past the budget is stored "
        "quantized to this many bits (mlx-lm's QuantizedKVCache rows) until its cut, where the kept rows are decoded "
        "back to full precision; a prompt within the budget is held exactly. Default 8. None: held in full precision. "
        "With kv_bits the held rows are stored at kv_bits already.",
    )
    allocation: str = Field(
        "reach",
        description="How the budget is shared between layers: a registered allocation ('reach': every layer "
        "`budget`, a sliding-window layer at most its window, what that frees shared by the global layers; "
        "'uniform': every layer keeps `budget`; 'pyramid': budgets falling linearly with depth, their mean `budget`; "
        "'hybrid': a sliding-window layer a share of `budget`, the global layers the rest).",
    )

    @property
    def recent_tokens(self) -> int:
        """The protected recent window actually used: ``recent``, or ``budget // 2`` capped at
        ``budget - n_sink - 1`` so that a token stays evictable."""
        if self.recent is None:
            return max(0, min(self.budget // 2, self.budget - self.n_sink - 1))
        return self.recent

    def hold_tokens(self) -> Optional[int]:
        """The most slots this layer holds during a prompt chunk under ``when="prompt_end"``:
        ``ceil(hold * budget)``, or None (the whole prompt)."""
        return None if self.hold is None else math.ceil(self.hold * self.budget)

    @model_validator(mode="after")
    def _leave_room_to_evict(self):
        if self.budget <= self.n_sink + self.recent_tokens:
            raise ValueError(
                f"budget must be greater than n_sink + recent so that some token can be evicted; "
                f"got budget={self.budget}, n_sink={self.n_sink}, recent={self.recent_tokens}"
            )
        return self


def format_errors(exc: ValidationError, prefix: str, written: Optional[Mapping[str, str]] = None) -> str:
    """pydantic's errors as one line; ``written`` maps field names to the key the user wrote."""
    parts = []
    written = written or {}
    for err in exc.errors():
        loc = ".".join(str(x) for x in err["loc"]) if err["loc"] else ""
        if loc in written:
            loc, field = loc, written[loc]
        else:
            field = f"{prefix}{loc}" if loc else prefix.rstrip("_.") or "config"
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] in ("extra_forbidden",):
            parts.append(f"{field}: unknown field")
            continue
        shown = err.get("input")
        if err["type"] in ("int_parsing", "float_parsing") and isinstance(shown, str) and _foreign_digits(shown):
            msg += "; numbers are written in the ASCII digits 0-9"
        parts.append(f"{field}: {msg} (got {shown!r})" if err["type"] != "value_error" else f"{field}: {msg}")
    return "; ".join(parts)


def _foreign_digits(text: str) -> bool:
    """Whether ``text`` has digits of another script than ASCII (``１６``, ``٣``), which Python's int() reads."""
    return any(not c.isascii() and c.isnumeric() for c in text)


#: Integer fields hold at most a signed 64-bit value (MLX and JSON round trips need it).
INT_RANGE = (-(2**63), 2**63 - 1)


def _int_field(annotation) -> bool:
    """Whether a field's annotation is int or Optional[int] (and not bool)."""
    args = getattr(annotation, "__args__", None)
    return annotation is int or (args is not None and int in args and bool not in args)


def reject_bad_ints(config_class, data: Mapping[str, Any], where: str) -> None:
    """Integer fields: a bool is not an integer (pydantic would take True as 1) and the value must fit
    in 64 bits. ``data`` is keyed by the names the user wrote (aliases included)."""
    ints = set()
    for name, field in config_class.model_fields.items():
        if _int_field(field.annotation):
            ints.add(name)
            alias = field.validation_alias
            ints.update(a for a in getattr(alias, "choices", [alias]) if isinstance(a, str))
    for key, value in data.items():
        if key not in ints:
            continue
        if isinstance(value, bool):
            raise ConfigError(f"{where}{key}: must be an integer, not a bool (got {value!r})")
        if isinstance(value, int) and not INT_RANGE[0] <= value <= INT_RANGE[1]:
            raise ConfigError(
                f"{where}{key}: must be an integer in [{INT_RANGE[0]}, {INT_RANGE[1]}] "
                f"(got a {value.bit_length()}-bit number)"
            )


def canonical_names(config_class) -> dict:
    """Every accepted name of a policy config class's fields (aliases included) -> the field's name."""
    out = {}
    for name, field in config_class.model_fields.items():
        out[name] = name
        alias = field.validation_alias
        out.update({a: name for a in getattr(alias, "choices", [alias]) if isinstance(a, str)})
    return out


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


def policy_from_fields(config_class, method: str, data: Mapping[str, Any]) -> Tuple[Dict[str, Any], Any]:
    """``data`` sorted into (the common fields, an instance of ``config_class``), with no registry.

    ``data`` holds the common fields (:data:`COMMON_FIELDS`) and ``method``'s fields, bare (``budget``),
    prefixed (``cam_budget``) or aliased, or a ``policy`` (a ``config_class`` instance or a dict). Any problem is
    a :class:`ConfigError` naming the field as the user wrote it and the accepted fields.
    """
    data = dict(data)
    policy = data.pop("policy", None)
    if isinstance(policy, config_class):
        fields: Dict[str, Any] = policy.model_dump()
    elif isinstance(policy, Mapping):
        fields = dict(policy)
    elif policy is None:
        fields = {}
    else:
        raise ConfigError(f"policy: expected a {config_class.__name__} or a dict (got {policy!r})")
    prefix = method + "_"
    known = policy_field_names(config_class)
    canonical = canonical_names(config_class)
    written = {canonical.get(name, name): name for name in fields}  # field -> the key the user wrote
    if len(written) < len(fields):
        raise ConfigError(f"policy: a field is given twice under two of its names ({', '.join(fields)})")
    as_written = {f: prefix + n for f, n in written.items()}  # what an error names: the key as the user wrote it
    for key in list(data):
        if key in COMMON_FIELDS:
            continue
        name = key[len(prefix) :] if key.startswith(prefix) else key
        field = canonical.get(name, name)
        if field in written:
            raise ConfigError(
                f"{key}: the field {field!r} is given twice (as {written[field]!r} and as "
                f"{key!r}: bare, prefixed, aliased or in policy)"
            )
        if key.startswith(prefix) or key in known:
            fields[name] = data.pop(key)
            written[field] = name
            as_written[field] = key if key.startswith(prefix) else f"{key}, i.e. {prefix}{name}"
        else:
            allowed = ", ".join(list(COMMON_FIELDS) + sorted(prefix + f for f in config_class.model_fields))
            raise ConfigError(f"{key}: unknown field for method {method!r}; accepted fields: {allowed}")
    reject_non_finite(fields, prefix)
    reject_non_finite({k: v for k, v in data.items() if k != "method"}, "")
    reject_bad_ints(config_class, fields, prefix)
    try:
        policy = config_class(**fields)
    except ValidationError as exc:  # errors name the field as the user wrote it (an alias stays an alias)
        raise ConfigError(format_errors(exc, prefix, as_written)) from None
    return data, policy


def field_name(config_class, method: str, key: str) -> str:
    """The field of ``config_class`` that ``key`` (bare, prefixed with ``method_`` or aliased) names, or ``key``."""
    prefix = method + "_"
    name = key[len(prefix) :] if key.startswith(prefix) else key
    return canonical_names(config_class).get(name, name)


def is_resolved(data: Mapping[str, Any]) -> bool:
    """Whether ``data`` is already a typed config's fields: a policy config instance and nothing but common fields
    (resolving it needs no registry)."""
    return isinstance(data.get("policy"), PolicyConfig) and set(data) <= set(COMMON_FIELDS) | {"policy"}
