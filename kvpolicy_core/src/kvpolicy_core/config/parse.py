"""Configuration: per-method pydantic models, :class:`KVCacheConfig` and config strings.

A method's own fields live in its :class:`PolicyConfig` subclass (``budget``,
``n_sink``, ...). :class:`KVCacheConfig` adds the fields every method shares
(``method``, ``head_dim``, ``seed``, ``layers``) and accepts the method's fields
either prefixed (``cam_budget=256``, the specification's API) or bare in a dict
or config string (``"cam:budget=256,merge=mean"``).

Config-string grammar::

    config  := method [ ":" item ( "," item )* ]
    item    := key "=" value          (no spaces needed; values are parsed by the field)

A value written as a number in the ASCII digits 0-9 (``16``, ``-0.5``, ``1e-3``, ``inf``) is read
as a number; any other value stays a string for its field to validate (so digits of other scripts,
``１６``, are refused by a numeric field, naming it).

A JSON object string (``'{"method": "cam", "budget": 256}'``) and a dict with the
same keys are accepted as well.
"""

from __future__ import annotations

import json
import re
from typing import Any, Dict, Literal, Mapping, Optional

from pydantic import BaseModel, ConfigDict, Field, SerializeAsAny, ValidationError, field_validator

from ..errors import ConfigError
from ..plugin.attention_config import MAX_TOKENS
from ..plugin.discovery import get_registry
from ..plugin.policy_config import COMMON_FIELDS, PolicyConfig, format_errors

__all__ = ["KVCacheConfig", "PolicyConfig", "COMMON_FIELDS", "parse_config", "parse_config_string"]


#: The largest ``head_dim`` a config may expect (models have 64 to 256; it is only compared with the model's).
MAX_HEAD_DIM = 1 << 16
#: Token counts every method shares, bounded by :data:`~kvpolicy_core.plugin.attention_config.MAX_TOKENS` (positions
#: and counters are int32 on the device; the layer allocation refuses more when the caches are built).
TOKEN_COUNTS = ("budget", "n_sink", "recent")


class KVCacheConfig(BaseModel):
    """A validated cache configuration: the method, shared fields and the method's own config.

    Accepts the specification's flat API::

        KVCacheConfig(method="cam", head_dim=128, cam_budget=512, cam_n_sink=4)

    ``config.cam_budget`` reads the method field back; ``config.policy`` is the
    method's own pydantic model.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    method: str = Field(description="Registered method name, e.g. 'h2o' or 'cam'.")
    head_dim: Optional[int] = Field(
        None, ge=1, le=MAX_HEAD_DIM, description="Expected head dimension; checked against the model."
    )
    seed: int = Field(
        0,
        ge=0,
        le=2**64 - 1,
        description="Seed of every random draw (merge gates), in [0, 2**64 - 1]; same seed, same result.",
    )
    layers: Literal["all", "unbounded"] = Field(
        "all", description="'all' layers, or only layers whose native cache is unbounded."
    )
    policy: SerializeAsAny[PolicyConfig]

    def __init__(self, /, **data: Any) -> None:
        try:
            super().__init__(**(data if _typed(data) else get_registry().resolve(data)))
        except ValidationError as exc:
            raise ConfigError(format_errors(exc, "")) from None
        _check_token_counts(self.method, self.policy)

    @field_validator("seed", "head_dim", mode="before")
    @classmethod
    def _no_bools(cls, value: Any) -> Any:
        if isinstance(value, bool):  # pydantic would take True as 1
            raise ValueError("must be an integer, not a bool")
        return value

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
        """The config-string form of this config (only the fields needed to give it back)."""
        items = _needed_fields(self.policy)
        for key in ("head_dim", "seed", "layers"):
            if getattr(self, key) != type(self).model_fields[key].default:
                items[key] = getattr(self, key)
        body = ",".join(f"{k}={_fmt(v)}" for k, v in items.items())
        return f"{self.method}:{body}" if body else self.method


def _check_token_counts(method: str, policy: PolicyConfig) -> None:
    """Every method's shared token counts at most :data:`MAX_TOKENS`, refused naming the field (one check for every
    method: the fields are :class:`PolicyConfig`'s)."""
    for name in TOKEN_COUNTS:
        value = getattr(policy, name, None)
        if isinstance(value, int) and value > MAX_TOKENS:
            raise ConfigError(
                f"{method}_{name}: must be at most {MAX_TOKENS} tokens (positions are int32) (got {value})"
            )


def _typed(data: Mapping[str, Any]) -> bool:
    """Already resolved: a policy config instance and nothing but common fields (no registry needed)."""
    return isinstance(data.get("policy"), PolicyConfig) and set(data) <= set(COMMON_FIELDS) | {"policy"}


def _needed_fields(policy: PolicyConfig) -> Dict[str, Any]:
    """The smallest field set (by dropping fields in order) that validates back to ``policy``.

    Not simply the non-default fields: a default that depends on another field (CaM's gate:
    off for the mass merges) must be written when it differs from what the rest implies, and
    left out when the rest implies it.
    """
    cls = type(policy)

    def same(data: Dict[str, Any]) -> bool:
        try:
            return cls.model_validate(data) == policy
        except Exception:  # noqa: BLE001 - a field set that does not validate is not the same config
            return False

    items = policy.model_dump()
    if not same(items):  # cannot round-trip by field name: the plain non-default fields
        return policy.model_dump(exclude_defaults=True)
    for key in list(items):
        rest = {k: v for k, v in items.items() if k != key}
        if same(rest):
            items = rest
    return items


def _fmt(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


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
        digits = value.lstrip("+-")
        if _INT.fullmatch(value) and len(digits) > 20:  # beyond 64 bits: a range error, not float('inf')
            raise ConfigError(
                f"{key}: {value[:8]}... ({len(digits)} digits) is out of range; "
                "integer fields hold at most 64-bit values"
            )
        out[key] = _coerce(value)
    return out


#: Numbers in config strings, ASCII only: Python's int() and float() would also read '１６' (full-width) as 16.
_INT = re.compile(r"[+-]?[0-9]+")
_FLOAT = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?|[+-]?(inf|infinity|nan)", re.IGNORECASE)


def _coerce(value: str) -> Any:
    """Config-string values: ints and floats (ASCII digits) become numbers; everything else stays a string."""
    low = value.lower()
    if low in ("none", "null"):
        return None
    if _INT.fullmatch(value):
        return int(value)
    if _FLOAT.fullmatch(value):
        return float(value)
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
                raise ConfigError(
                    f"config JSON is malformed at line {exc.lineno} column {exc.colno}: {exc.msg}"
                ) from None
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
