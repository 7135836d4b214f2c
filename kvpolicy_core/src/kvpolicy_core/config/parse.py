"""Config strings, JSON and dicts resolved, once, into a typed :class:`~.cache_config.KVCacheConfig`.

:func:`parse_config` is the one entry: every form but a typed config is read into a dict and resolved once
(:func:`~.resolve.resolve`, the only lookup of the method in the plugin registry); a :class:`KVCacheConfig` is
returned as it is, or changed by :meth:`KVCacheConfig.replace` (no registry). The method's own fields live in
its :class:`~.policy_config.PolicyConfig` subclass (``budget``, ``n_sink``, ...); :class:`KVCacheConfig` adds the
fields every method shares (``method``, ``head_dim``, ``seed``, ``layers``). A dict or config string gives the
method's fields bare (``"cam:budget=256,merge=mean"``) or prefixed (``cam_budget=256``, the specification's API).

Config-string grammar::

    config  := method [ ":" item ( "," item )* ]
    item    := key "=" value          (no spaces needed; values are parsed by the field)
    value   := scalar | "[" [ scalar ( "," scalar )* ] "]"      (a list: ``rope_freqs=[1.0,0.5]``)

A list's commas are inside its brackets, so they do not separate items; a list holds scalars (no nested lists),
and :meth:`~.cache_config.KVCacheConfig.to_string` writes a list or tuple field in this form, so that
``parse_config(config.to_string())`` gives the config back.

A value written as a number in the ASCII digits 0-9 (``16``, ``-0.5``, ``1e-3``, ``inf``) is read
as a number; any other value stays a string for its field to validate (so digits of other scripts,
``１６``, are refused by a numeric field, naming it).

A JSON object string (``'{"method": "cam", "budget": 256}'``) and a dict with the
same keys are accepted as well.
"""

from __future__ import annotations

import json
import re
from typing import Any, Dict, Mapping

from ..errors import ConfigError
from .cache_config import KVCacheConfig
from .resolve import resolve

__all__ = ["parse_config", "parse_config_string"]


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
    for i, item in enumerate(_items(text, body) if body.strip() else [], start=1):
        key, eq, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not eq or not key or not value:
            raise ConfigError(f"config string {text!r}: item {i} {item.strip()!r} is not key=value")
        if key in out:
            raise ConfigError(f"config string {text!r}: {key!r} is given twice")
        if value.startswith("["):
            inner = value[1:-1].strip() if value.endswith("]") else None
            if inner is None or "[" in inner or "]" in inner:
                raise ConfigError(f"config string {text!r}: {key}={value!r} is not a list of values '[a,b,...]'")
            parts = [v.strip() for v in inner.split(",")] if inner else []
            if any(not v for v in parts):
                raise ConfigError(f"config string {text!r}: {key}={value!r} has an empty list element")
            out[key] = [_scalar(key, v) for v in parts]
        else:
            out[key] = _scalar(key, value)
    return out


def _items(text: str, body: str):
    """The ``key=value`` items of ``body``: split at the commas outside ``[...]``."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(body):
        depth += (ch == "[") - (ch == "]")
        if depth < 0:
            raise ConfigError(f"config string {text!r}: a ']' closes no list")
        if ch == "," and depth == 0:
            items.append(body[start:i])
            start = i + 1
    if depth:
        raise ConfigError(f"config string {text!r}: a '[' list is not closed")
    return items + [body[start:]]


def _scalar(key: str, value: str) -> Any:
    digits = value.lstrip("+-")
    if _INT.fullmatch(value) and len(digits) > 20:  # beyond 64 bits: a range error, not float('inf')
        raise ConfigError(
            f"{key}: {value[:8]}... ({len(digits)} digits) is out of range; integer fields hold at most 64-bit values"
        )
    return _coerce(value)


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
    """Any config form -> a validated :class:`KVCacheConfig`, the method looked up once.

    ``spec`` may be a :class:`KVCacheConfig` (returned as it is, or :meth:`~KVCacheConfig.replace`'d with
    ``overrides``: no registry), a config string (``"cam:budget=256"``), a JSON object string, or a dict.
    ``overrides`` are applied on top.
    """
    if isinstance(spec, KVCacheConfig):
        if overrides.get("method", spec.method) != spec.method:  # another method: its own config, resolved
            return KVCacheConfig(**resolve({**spec.to_dict(), **overrides}))
        return spec.replace(**overrides)
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
    return KVCacheConfig(**resolve(data))
