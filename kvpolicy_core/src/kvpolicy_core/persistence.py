"""Save and load a model's set of caches (policy caches and mlx-lm's own) to one safetensors file.

The file holds every layer's physical buffers exactly as they are (including a pending eviction),
the configs, offsets and counters, and a SHA-256 over all arrays: loading it back continues a
generation bit for bit, and a truncated or modified file is rejected, never half-loaded.

mlx-lm's ``save_prompt_cache``/``load_prompt_cache`` also work with kvpolicy caches (their
``state`` carries the config), but they save the settled state; use these for exact resumption.

Under ``mlx.launch`` each rank holds only its own heads or layers: ``save_caches("run.safetensors")``
on rank r of N writes ``run.rank<r>-of-<N>.safetensors`` (the header records (r, N)), and
``load_caches("run.safetensors")`` reads back this rank's file, refusing a file from another rank
or world size (:mod:`kvpolicy_core.distributed`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
from mlx_lm.models.cache import KVCache, RotatingKVCache

from .cache import PolicyCache
from .distributed import check_shard, missing_rank_file, rank_path, resolve_shard
from .errors import KVPolicyError

FORMAT = "kvpolicy-caches/2"  # /2: the checksum covers the header too (/1 files still load)
_FORMATS = ("kvpolicy-caches/1", FORMAT)


class CacheFileError(KVPolicyError):
    """A cache file that cannot be loaded: missing, truncated, modified or of another format."""


def _digest(arrays: Dict[str, mx.array], header: Optional[Dict[str, Any]] = None) -> str:
    """SHA-256 over every array (name, dtype, shape, bytes) and the header JSON (without the digest)."""
    h = hashlib.sha256()
    if header is not None:
        h.update(json.dumps({k: v for k, v in header.items() if k != "sha256"}, sort_keys=True).encode())
    for name in sorted(arrays):
        a = arrays[name]
        h.update(f"{name}|{a.dtype}|{tuple(a.shape)}|".encode())
        h.update(memoryview(mx.contiguous(a).view(mx.uint8).reshape(-1)))
    return h.hexdigest()


def save_caches(path, caches: Sequence[Any], metadata: Optional[Dict[str, str]] = None, *,
                shard: Optional[Tuple[int, int]] = None) -> Path:
    """Write ``caches`` (one per layer) to ``path`` (a ``.safetensors`` file); returns the path written.

    ``shard`` = (rank, world size), default this process's: with a world size > 1 the file is
    ``path``'s rank file (``run.rank0-of-2.safetensors``).
    """
    path = Path(path)
    if path.suffix != ".safetensors":
        raise CacheFileError(f"{path}: cache files must end in .safetensors")
    shard = resolve_shard(shard)
    path = rank_path(path, shard)
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
            if c._run_open:  # a run of prompt chunks in progress: its scorer state (arrays) continues too
                run = {k: v for k, v in c._run.items() if isinstance(v, mx.array)}
                entry["run"] = sorted(run)
                arrays.update({f"{i}.run.{k}": v for k, v in run.items()})
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
    header = {"format": FORMAT, "layers": layers, "user": dict(metadata or {})}
    if shard != (0, 1):
        header["shard"] = list(shard)
    header["sha256"] = _digest(arrays, header)  # covers the header (shard included) too
    _write_atomically(path, arrays, {"kvpolicy": json.dumps(header)})
    return path


def _write_atomically(path: Path, arrays: Dict[str, mx.array], metadata: Dict[str, str]) -> None:
    """Write to a temporary file in the same directory, fsync, then rename over ``path``.

    A failed write (disk full, interrupted) leaves the previous file as it was.
    """
    if path.is_dir():
        raise CacheFileError(f"{path}: is a directory; give a file name ending in .safetensors")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=".safetensors")
        os.close(fd)
    except OSError as exc:
        raise CacheFileError(f"{path}: cannot write there: {exc}") from None
    try:
        mx.save_safetensors(tmp, arrays, metadata=metadata)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(exc, Exception):
            raise CacheFileError(f"{path}: writing failed ({type(exc).__name__}: {exc}); the previous file is unchanged") from None
        raise
    with contextlib.suppress(OSError):  # make the rename itself durable
        dfd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)


def load_caches(path, *, shard: Optional[Tuple[int, int]] = None, model=None,
                expect_layers: Optional[int] = None) -> List[Any]:
    """Read caches written by :func:`save_caches`; raises :class:`CacheFileError` on any damage.

    ``shard`` = (rank, world size), default this process's: the file read is ``path``'s rank
    file, and a file saved by another rank or world size is refused. ``model`` (the caches'
    model: one cache per entry of its ``make_prompt_cache``) or ``expect_layers``: a file with
    another number of layers is refused instead of failing (or silently misaligning) in generation.
    """
    if model is not None:
        from mlx_lm.models.cache import make_prompt_cache

        expect_layers = len(make_prompt_cache(model))
    base, shard = Path(path), resolve_shard(shard)
    path = rank_path(base, shard)
    if not path.is_file():
        raise CacheFileError(missing_rank_file(base, path, shard))
    try:
        arrays, meta = mx.load(str(path), return_metadata=True)
    except Exception as exc:
        raise CacheFileError(f"{path}: unreadable safetensors file (truncated or corrupted): {exc}") from None
    try:
        header = json.loads(meta["kvpolicy"])
    except (KeyError, json.JSONDecodeError):
        raise CacheFileError(f"{path}: not a kvpolicy cache file (use kvpolicy_core.save_caches)") from None
    if header.get("format") not in _FORMATS:
        raise CacheFileError(f"{path}: format {header.get('format')!r}, expected {FORMAT!r}")
    covered = header if header["format"] == FORMAT else None
    if _digest(arrays, covered) != header.get("sha256"):
        raise CacheFileError(f"{path}: checksum mismatch: the file was modified or corrupted")
    check_shard(path, header.get("shard"), shard, CacheFileError)
    if expect_layers is not None and len(header["layers"]) != expect_layers:
        raise CacheFileError(f"{path}: holds caches for {len(header['layers'])} layers, but the model has "
                             f"{expect_layers}: these caches belong to another model")
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
            if "run" in entry:
                caches[-1]._run = {k: get(f"run.{k}") for k in entry["run"]}
                caches[-1]._run_open = True
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
