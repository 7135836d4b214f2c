"""Configuration: per-method pydantic models, :class:`KVCacheConfig` and config strings.

A method's own fields live in its :class:`PolicyConfig` subclass (``budget``,
``n_sink``, ...). :class:`KVCacheConfig` adds the fields every method shares
(``method``, ``head_dim``, ``seed``, ``layers``) and accepts the method's fields
either prefixed (``cam_budget=256``, the specification's API) or bare in a dict
or config string (``"cam:budget=256,merge=mean"``).

Config-string grammar::

    config  := method [ ":" item ( "," item )* ]
    item    := key "=" value          (no spaces needed; values are parsed by the field)

A JSON object string (``'{"method": "cam", "budget": 256}'``) and a dict with the
same keys are accepted as well.
"""

from __future__ import annotations

import json
import math
from typing import Any, Dict, Literal, Mapping, Optional

from pydantic import BaseModel, ConfigDict, Field, SerializeAsAny, ValidationError, model_validator

from .errors import ConfigError

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


def _format_errors(exc: ValidationError, prefix: str) -> str:
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


def _reject_non_finite(data: Mapping[str, Any], where: str) -> None:
    for key, value in data.items():
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{where}{key}: must be a finite number (got {value!r})")


class KVCacheConfig(BaseModel):
    """A validated cache configuration: the method, shared fields and the method's own config.

    Accepts the specification's flat API::

        KVCacheConfig(method="cam", head_dim=128, cam_budget=512, cam_n_sink=4)

    ``config.cam_budget`` reads the method field back; ``config.policy`` is the
    method's own pydantic model.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    method: str = Field(description="Registered method name, e.g. 'h2o' or 'cam'.")
    head_dim: Optional[int] = Field(None, ge=1, description="Expected head dimension; checked against the model.")
    seed: int = Field(0, description="Seed of every random draw (merge gates); same seed, same result.")
    layers: Literal["all", "unbounded"] = Field(
        "all", description="'all' layers, or only layers whose native cache is unbounded."
    )
    policy: SerializeAsAny[PolicyConfig]

    def __init__(self, /, **data: Any) -> None:
        try:
            super().__init__(**_split_fields(data))
        except ValidationError as exc:
            raise ConfigError(_format_errors(exc, "")) from None

    def __getattr__(self, name: str):
        policy = self.__dict__.get("policy")
        method = self.__dict__.get("method")
        if policy is not None and method and name.startswith(method + "_"):
            field = name[len(method) + 1 :]
            if field in type(policy).model_fields:
                return getattr(policy, field)
        return super().__getattr__(name)

    def to_dict(self) -> Dict[str, Any]:
        """Flat, JSON-ready form: common fields plus the method's fields (unprefixed)."""
        out = {k: getattr(self, k) for k in COMMON_FIELDS}
        out.update(self.policy.model_dump())
        return out

    def to_string(self) -> str:
        """The config-string form of this config (only non-default fields)."""
        items = {**self.policy.model_dump(exclude_defaults=True)}
        for key in ("head_dim", "seed", "layers"):
            if getattr(self, key) != type(self).model_fields[key].default:
                items[key] = getattr(self, key)
        body = ",".join(f"{k}={_fmt(v)}" for k, v in items.items())
        return f"{self.method}:{body}" if body else self.method


def _fmt(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


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


def _split_fields(data: Dict[str, Any]) -> Dict[str, Any]:
    """Resolve the method and validate its fields; raise :class:`ConfigError` on any problem."""
    from .plugins import get_registry

    data = dict(data)
    method = data.get("method")
    if not isinstance(method, str) or not method:
        raise ConfigError(f"method: a method name is required (got {method!r})")
    spec = get_registry().method(method)
    policy = data.pop("policy", None)
    if isinstance(policy, spec.config_class):
        fields: Dict[str, Any] = policy.model_dump()
    elif isinstance(policy, Mapping):
        fields = dict(policy)
    elif policy is None:
        fields = {}
    else:
        raise ConfigError(f"policy: expected a {spec.config_class.__name__} or a dict (got {policy!r})")
    prefix = method + "_"
    known = policy_field_names(spec.config_class)
    for key in list(data):
        if key in COMMON_FIELDS:
            continue
        if key.startswith(prefix):
            fields[key[len(prefix) :]] = data.pop(key)
        elif key in known:
            fields[key] = data.pop(key)
        else:
            allowed = ", ".join(list(COMMON_FIELDS) + sorted(prefix + f for f in spec.config_class.model_fields))
            raise ConfigError(f"{key}: unknown field for method {method!r}; accepted fields: {allowed}")
    _reject_non_finite(fields, prefix)
    _reject_non_finite({k: v for k, v in data.items() if k != "method"}, "")
    try:
        data["policy"] = spec.config_class(**fields)
    except ValidationError as exc:
        raise ConfigError(_format_errors(exc, prefix)) from None
    return data


def _validate_common(data: Dict[str, Any]) -> KVCacheConfig:
    return KVCacheConfig(**data)


def parse_config_string(text: str) -> Dict[str, Any]:
    """Parse ``"method:key=value,..."`` into a dict; errors point at the offending part."""
    text = text.strip()
    if not text:
        raise ConfigError("config string is empty; expected 'method' or 'method:key=value,...'")
    method, _, body = text.partition(":")
    method = method.strip()
    if not method.isidentifier():
        raise ConfigError(f"config string {text!r}: {method!r} is not a method name")
    out: Dict[str, Any] = {"method": method}
    if _ and not body.strip():
        raise ConfigError(f"config string {text!r}: nothing after ':'; expected key=value,...")
    for i, item in enumerate(body.split(",") if body.strip() else [], start=1):
        key, eq, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not eq or not key or not value:
            raise ConfigError(f"config string {text!r}: item {i} {item.strip()!r} is not key=value")
        if key in out:
            raise ConfigError(f"config string {text!r}: {key!r} is given twice")
        out[key] = _coerce(value)
    return out


def _coerce(value: str) -> Any:
    """Config-string values: ints and floats become numbers; everything else stays a string."""
    low = value.lower()
    if low in ("none", "null"):
        return None
    for cast in (int, float):
        try:
            return cast(value)
        except ValueError:
            pass
    return value


def parse_config(spec: Any, **overrides: Any) -> KVCacheConfig:
    """Any config form -> a validated :class:`KVCacheConfig`.

    ``spec`` may be a :class:`KVCacheConfig`, a config string (``"cam:budget=256"``),
    a JSON object string, or a dict. ``overrides`` are applied on top.
    """
    if isinstance(spec, KVCacheConfig):
        if not overrides:
            return spec
        data: Dict[str, Any] = {**spec.to_dict(), **overrides}
        return _validate_common(data)
    if isinstance(spec, str):
        stripped = spec.strip()
        if stripped.startswith("{"):
            try:
                data = json.loads(stripped)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"config JSON is malformed at line {exc.lineno} column {exc.colno}: {exc.msg}") from None
            if not isinstance(data, dict):
                raise ConfigError("config JSON must be an object")
        else:
            data = parse_config_string(stripped)
    elif isinstance(spec, Mapping):
        data = dict(spec)
    else:
        raise ConfigError(f"config: expected a KVCacheConfig, a config string or a dict (got {type(spec).__name__})")
    data.update(overrides)
    return _validate_common(data)
