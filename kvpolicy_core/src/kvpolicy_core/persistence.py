"""Save and load a model's set of caches (policy caches and mlx-lm's own) to one safetensors file.

The file holds every layer's physical buffers exactly as they are (including a pending eviction),
the configs, offsets and counters, and a SHA-256 over all arrays: loading it back continues a
generation bit for bit, and a truncated or modified file is rejected, never half-loaded.

mlx-lm's ``save_prompt_cache``/``load_prompt_cache`` also work with kvpolicy caches (their
``state`` carries the config), but they save the settled state; use these for exact resumption.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import mlx.core as mx
from mlx_lm.models.cache import KVCache, RotatingKVCache

from .cache import PolicyCache
from .errors import KVPolicyError

FORMAT = "kvpolicy-caches/1"


class CacheFileError(KVPolicyError):
    """A cache file that cannot be loaded: missing, truncated, modified or of another format."""


def _digest(arrays: Dict[str, mx.array]) -> str:
    h = hashlib.sha256()
    for name in sorted(arrays):
        a = arrays[name]
        h.update(f"{name}|{a.dtype}|{tuple(a.shape)}|".encode())
        h.update(memoryview(mx.contiguous(a).view(mx.uint8).reshape(-1)))
    return h.hexdigest()


def save_caches(path, caches: Sequence[Any], metadata: Optional[Dict[str, str]] = None) -> Path:
    """Write ``caches`` (one per layer) to ``path`` (a ``.safetensors`` file); returns the path."""
    path = Path(path)
    if path.suffix != ".safetensors":
        raise CacheFileError(f"{path}: cache files must end in .safetensors")
    arrays: Dict[str, mx.array] = {}
    layers: List[Dict[str, Any]] = []
    for i, c in enumerate(caches):
        if isinstance(c, PolicyCache):
            entry = {"class": "PolicyCache", "meta": c._meta_json(), "n": c.n}
            if c.keys is not None:
                n = c.n
                arrays.update({f"{i}.keys": c.keys[..., :n, :], f"{i}.values": c.values[..., :n, :],
                               f"{i}.positions": c.positions[..., :n], f"{i}.scores": c.scores})
                if c.log_weights is not None:
                    arrays[f"{i}.log_weights"] = c.log_weights
        elif type(c) is KVCache:
            entry = {"class": "KVCache", "offset": c.offset}
            if c.keys is not None:
                arrays.update({f"{i}.keys": c.keys[..., : c.offset, :], f"{i}.values": c.values[..., : c.offset, :]})
        elif type(c) is RotatingKVCache:
            entry = {"class": "RotatingKVCache", "offset": c.offset, "keep": c.keep, "max_size": c.max_size, "idx": c._idx}
            if c.keys is not None:
                arrays.update({f"{i}.keys": c.keys, f"{i}.values": c.values})
        else:
            raise CacheFileError(f"layer {i}: cannot save a {type(c).__name__} (supported: PolicyCache, KVCache, RotatingKVCache)")
        layers.append(entry)
    arrays = {k: mx.contiguous(v) for k, v in arrays.items()}
    mx.eval(arrays)
    header = {"format": FORMAT, "layers": layers, "user": dict(metadata or {}), "sha256": _digest(arrays)}
    path.parent.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(path), arrays, metadata={"kvpolicy": json.dumps(header)})
    return path


def load_caches(path) -> List[Any]:
    """Read caches written by :func:`save_caches`; raises :class:`CacheFileError` on any damage."""
    path = Path(path)
    if not path.is_file():
        raise CacheFileError(f"{path}: no such cache file")
    try:
        arrays, meta = mx.load(str(path), return_metadata=True)
    except Exception as exc:
        raise CacheFileError(f"{path}: unreadable safetensors file (truncated or corrupted): {exc}") from None
    try:
        header = json.loads(meta["kvpolicy"])
    except (KeyError, json.JSONDecodeError):
        raise CacheFileError(f"{path}: not a kvpolicy cache file (use kvpolicy_core.save_caches)") from None
    if header.get("format") != FORMAT:
        raise CacheFileError(f"{path}: format {header.get('format')!r}, expected {FORMAT!r}")
    if _digest(arrays) != header.get("sha256"):
        raise CacheFileError(f"{path}: checksum mismatch: the file was modified or corrupted")
    caches = []
    for i, entry in enumerate(header["layers"]):
        get = lambda name: arrays.get(f"{i}.{name}")  # noqa: E731
        kind = entry["class"]
        if kind == "PolicyCache":
            if get("keys") is None:
                caches.append(PolicyCache.from_meta(entry["meta"]))
            else:
                state = (get("keys"), get("values"), get("positions"), get("scores"), entry["meta"])
                if get("log_weights") is not None:
                    state += (get("log_weights"),)
                caches.append(PolicyCache.from_state(state, (entry["meta"],)))
        elif kind == "KVCache":
            c = KVCache()
            if get("keys") is not None:
                c.keys, c.values = get("keys"), get("values")
            c.offset = entry["offset"]
            caches.append(c)
        elif kind == "RotatingKVCache":
            c = RotatingKVCache(max_size=entry["max_size"], keep=entry["keep"])
            if get("keys") is not None:
                c.keys, c.values = get("keys"), get("values")
            c.offset, c._idx = entry["offset"], entry["idx"]
            caches.append(c)
        else:
            raise CacheFileError(f"{path}: layer {i} has unknown cache class {kind!r}")
    return caches
