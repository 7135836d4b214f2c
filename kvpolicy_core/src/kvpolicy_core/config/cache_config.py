"""The cache configuration: a method's name, the fields every method shares and the method's own config.

:class:`KVCacheConfig` is a plain, frozen pydantic model of typed fields: ``policy`` is already an instance of the
method's config class (a :class:`~.policy_config.PolicyConfig` subclass), so validating it needs no registry, and
:meth:`KVCacheConfig.replace` derives a changed config from the method's own class. Config strings, JSON and
dicts are resolved once, at the entry point, by :func:`~.parse.parse_config`.
"""

from __future__ import annotations

from typing import Any, Dict, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, SerializeAsAny, ValidationError, field_validator

from ..errors import ConfigError
from .attention_config import MAX_TOKENS
from .policy_config import (
    COMMON_FIELDS,
    PolicyConfig,
    field_name,
    format_errors,
    is_resolved,
    policy_from_fields,
)

__all__ = ["KVCacheConfig", "MAX_HEAD_DIM", "TOKEN_COUNTS"]

#: The largest ``head_dim`` a config may expect (models have 64 to 256; it is only compared with the model's).
MAX_HEAD_DIM = 1 << 16
#: Token counts every method shares, bounded by :data:`~kvpolicy_core.config.attention_config.MAX_TOKENS`
#: (positions and counters are int32 on the device; the layer allocation refuses more when the caches are built).
TOKEN_COUNTS = ("budget", "n_sink", "recent")


class KVCacheConfig(BaseModel):
    """A validated cache configuration: the method, shared fields and the method's own config (``policy``).

    ``KVCacheConfig(method="h2o", seed=3, policy=H2OConfig(budget=256))`` needs no registry. The specification's
    flat form, ``KVCacheConfig(method="cam", head_dim=128, cam_budget=512)``, is a config dict: it goes through
    :func:`~kvpolicy_core.config.parse.parse_config`'s one lookup of the method (:func:`~.resolve.resolve`).

    ``config.cam_budget`` reads the method field back; ``config.policy`` is the method's own pydantic model.
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
    kv_memory: Optional[int] = Field(
        None,
        ge=1,
        le=2**63 - 1,
        description="Bytes the kept KV cache of one sequence may take (e.g. 512MB, 2GB, 1.5GiB, or bytes); when "
        "given, the caches are built with the largest budget that fits on the model (its layer shapes, dtype and "
        "allocation), in place of `budget`.",
    )
    kv_bits: Optional[Literal[2, 3, 4, 5, 6, 8]] = Field(
        None,
        description="Store the kept keys and values quantized to this many bits (mx.quantize per token row, as "
        "mlx-lm's QuantizedKVCache: 4 or 8 are the usual choices), under any method; None: the model's dtype.",
    )
    kv_group_size: Literal[32, 64, 128] = Field(
        64, description="Elements per quantization group of a row (with kv_bits); must divide the head dim."
    )
    kv_dtype: Optional[Literal["float16", "bfloat16", "float32"]] = Field(
        None,
        description="Store the kept keys and values in this floating dtype (e.g. float16 under a float32 model: "
        "half the bytes), decoded to the model's dtype for attention; None: the model's dtype. Not with kv_bits.",
    )
    policy: SerializeAsAny[PolicyConfig]

    def __init__(self, /, **data: Any) -> None:
        if not is_resolved(data):  # the specification's flat form: a config dict, resolved once by the registry
            from .resolve import resolve

            data = resolve(data)
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise ConfigError(format_errors(exc, "")) from None
        _check_token_counts(self.method, self.policy)
        if self.kv_bits is not None and self.kv_dtype is not None:
            raise ConfigError("kv_dtype: rows are stored either quantized (kv_bits) or in a floating dtype, not both")

    @field_validator("kv_memory", mode="before")
    @classmethod
    def _bytes(cls, value: Any) -> Any:
        return parse_bytes(value)

    @field_validator("seed", "head_dim", "kv_bits", "kv_group_size", mode="before")
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

    def replace(self, **changes: Any) -> "KVCacheConfig":
        """This config with ``changes``: common fields, or the method's fields bare, prefixed or aliased
        (``budget=64``, ``cam_merge="mean"``), validated by the method's own config class (no registry)."""
        if not changes:
            return self
        cls = type(self.policy)
        changed = {field_name(cls, self.method, k) for k in changes if k not in COMMON_FIELDS}
        kept = {k: v for k, v in self.policy.model_dump().items() if k not in changed}
        common = {k: getattr(self, k) for k in COMMON_FIELDS}
        data, policy = policy_from_fields(cls, self.method, {**common, **changes, "policy": kept})
        if data.get("method") != self.method:
            raise ConfigError(
                f"method: a config changes its fields, not its method ({self.method!r} -> {data.get('method')!r}); "
                "parse the other method's config instead"
            )
        return KVCacheConfig(**data, policy=policy)

    def to_dict(self) -> Dict[str, Any]:
        """Flat, JSON-ready form: common fields plus the method's fields (unprefixed)."""
        out = {k: getattr(self, k) for k in COMMON_FIELDS}
        out.update(self.policy.model_dump())
        return out

    def to_string(self) -> str:
        """The config-string form of this config (only the fields needed to give it back)."""
        items = _needed_fields(self.policy)
        for key in COMMON_FIELDS[1:]:
            if getattr(self, key) != type(self).model_fields[key].default:
                items[key] = getattr(self, key)
        body = ",".join(f"{k}={_fmt(v)}" for k, v in items.items())
        return f"{self.method}:{body}" if body else self.method


#: byte units of ``kv_memory``: SI (kB, MB, GB, TB: powers of 1000) and binary (KiB, MiB, GiB, TiB: of 1024)
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS.update({"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "k": 10**3, "m": 10**6, "g": 10**9})


def parse_bytes(value: Any) -> Any:
    """``"512MB"``, ``"1.5GiB"``, ``"2 GB"`` or an int -> bytes (an int); other input is left to the field's
    validation. Units: :data:`_UNITS` (case-insensitive)."""
    if isinstance(value, bool):
        raise ValueError("must be a size in bytes (e.g. 512MB, 2GB, 1.5GiB), not a bool")
    if not isinstance(value, str):
        return value
    text = value.strip().lower().replace(" ", "")
    number = text.rstrip("bikmgt")
    unit = text[len(number) :]
    try:
        amount = float(number)
    except ValueError:
        amount = None
    if amount is None or unit not in _UNITS or not amount > 0 or amount != amount or amount == float("inf"):
        raise ValueError(
            f"must be a size in bytes: a positive number with an optional unit kB, MB, GB, TB, KiB, MiB, GiB, TiB "
            f"(got {value!r})"
        )
    return int(amount * _UNITS[unit])


def _check_token_counts(method: str, policy: PolicyConfig) -> None:
    """Every method's shared token counts at most :data:`MAX_TOKENS`, refused naming the field (one check for every
    method: the fields are :class:`PolicyConfig`'s)."""
    for name in TOKEN_COUNTS:
        value = getattr(policy, name, None)
        if isinstance(value, int) and value > MAX_TOKENS:
            raise ConfigError(
                f"{method}_{name}: must be at most {MAX_TOKENS} tokens (positions are int32) (got {value})"
            )


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
        except (ValidationError, ValueError, TypeError):  # a field set that does not validate is not the same config
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
    """A value in the config-string grammar (:mod:`.parse`): a list or tuple as ``[a,b,...]``."""
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_fmt(v) for v in value) + "]"
    return str(value).lower() if isinstance(value, bool) else str(value)
