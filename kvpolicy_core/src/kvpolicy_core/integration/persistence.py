"""Save and load a model's set of caches (policy caches and mlx-lm's own) to one safetensors file.

The file holds every layer's physical buffers exactly as they are (including a pending eviction),
the configs, offsets and counters, and a SHA-256 over all arrays: loading it back continues a
generation bit for bit, and a truncated or modified file is rejected, never half-loaded.

mlx-lm's ``save_prompt_cache``/``load_prompt_cache`` also work with kvpolicy caches (their
``state`` carries the config), but they save the settled state (settling the saved caches in place).
Every layer is checked against its meta when loaded (:mod:`kvpolicy_core.cache.restore_checks`), and the
caches that need the attention hook get it again (:mod:`kvpolicy_core.cache.state`).

Under ``mlx.launch`` each rank holds only its own heads or layers: ``save_caches("run.safetensors")``
on rank r of N writes ``run.rank<r>-of-<N>.safetensors`` (the header records (r, N)), and
``load_caches("run.safetensors")`` reads back this rank's file, refusing a file from another rank
or world size (:mod:`kvpolicy_core.runtime.distributed`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
import stat
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
from mlx_lm.models.cache import KVCache, RotatingKVCache

from ..cache.policy_cache import PolicyCache
from ..cache.slots import first_rows, length
from ..cache.state import from_meta, load_state, meta_json, open_run
from ..errors import KVPolicyError, ModelError
from ..runtime.distributed import check_shard, missing_rank_file, rank_path, resolve_shard
from ..runtime.files import check_output_target, check_writable

#: the parts of a quantized row as stored in a cache file (``mx.quantize``'s words, scales, biases)
QUANT_PARTS = ("words", "scales", "biases")

FORMAT = "kvpolicy-caches/2"  # /2: the checksum covers the header too (/1 files still load)
_FORMATS = ("kvpolicy-caches/1", FORMAT)


class CacheFileError(KVPolicyError):
    """A cache file that cannot be loaded: missing, truncated, modified or of another format."""


def digest(arrays: Dict[str, mx.array], header: Optional[Dict[str, Any]] = None) -> str:
    """SHA-256 over every array (name, dtype, shape, bytes) and the header JSON (without the digest): the checksum
    of ``save_caches`` files and of prompt-cache files (:mod:`kvpolicy_core.apps.prompt_file`)."""
    h = hashlib.sha256()
    if header is not None:
        h.update(json.dumps({k: v for k, v in header.items() if k != "sha256"}, sort_keys=True).encode())
    for name in sorted(arrays):
        a = arrays[name]
        h.update(f"{name}|{a.dtype}|{tuple(a.shape)}|".encode())
        h.update(memoryview(mx.contiguous(a).view(mx.uint8).reshape(-1)))
    return h.hexdigest()


_digest = digest  # the name it had before prompt-cache files used it


def save_caches(
    path, caches: Sequence[Any], metadata: Optional[Dict[str, str]] = None, *, shard: Optional[Tuple[int, int]] = None
) -> Path:
    """Write ``caches`` (one per layer) to ``path`` (a ``.safetensors`` file); returns the path written.

    ``shard`` = (rank, world size), default this process's: with a world size > 1 the file is
    ``path``'s rank file (``run.rank0-of-2.safetensors``).
    """
    shard = resolve_shard(shard)
    path = check_target(path, shard)  # before any work: a device, pipe or missing directory is refused now
    arrays: Dict[str, mx.array] = {}
    layers: List[Dict[str, Any]] = []
    for i, c in enumerate(caches):
        if isinstance(c, PolicyCache):
            entry = {"class": "PolicyCache", "meta": meta_json(c), "n": c.n}
            if c.keys is not None:
                n = c.n
                for name in ("keys", "values"):  # quantized rows (a tuple): one array per part, as stored
                    rows = first_rows(getattr(c, name), n)
                    if isinstance(rows, tuple):
                        arrays.update({f"{i}.{name}.{part}": x for part, x in zip(QUANT_PARTS, rows)})
                    else:
                        arrays[f"{i}.{name}"] = rows
                arrays.update({f"{i}.positions": c.positions[..., :n], f"{i}.scores": c.scores})
                if c.log_weights is not None:
                    arrays[f"{i}.log_weights"] = c.log_weights
            if c.row_state().run_open:  # a run of prompt chunks in progress: its scorer state (arrays) continues too
                run = open_run(c.row_state())
                entry["run"] = sorted(run)
                arrays.update({f"{i}.run.{k}": v for k, v in run.items()})
        elif type(c) is KVCache:
            entry = {"class": "KVCache", "offset": c.offset}
            if c.keys is not None:
                arrays.update({f"{i}.keys": c.keys[..., : c.offset, :], f"{i}.values": c.values[..., : c.offset, :]})
        elif type(c) is RotatingKVCache:
            entry = {
                "class": "RotatingKVCache",
                "offset": c.offset,
                "keep": c.keep,
                "max_size": c.max_size,
                "idx": c._idx,
            }
            if c.keys is not None:
                arrays.update({f"{i}.keys": c.keys, f"{i}.values": c.values})
        else:
            raise CacheFileError(
                f"layer {i}: cannot save a {type(c).__name__} (supported: PolicyCache, KVCache, RotatingKVCache)"
            )
        layers.append(entry)
    arrays = {k: mx.contiguous(v) for k, v in arrays.items()}
    mx.eval(arrays)
    header = {"format": FORMAT, "layers": layers, "user": dict(metadata or {})}
    if shard != (0, 1):
        header["shard"] = list(shard)
    header["sha256"] = digest(arrays, header)  # covers the header (shard included) too
    _write_atomically(path, arrays, {"kvpolicy": json.dumps(header)})
    return path


def check_target(path, shard: Optional[Tuple[int, int]] = None) -> Path:
    """The file :func:`save_caches` writes for ``path`` (this rank's), checked before any work: it ends in
    ``.safetensors``, is missing or a regular file (never a directory, FIFO or device, nor a symlink to one), and its
    directory exists and is writable; else :class:`CacheFileError`."""
    path = Path(path)
    if path.suffix != ".safetensors":
        raise CacheFileError(f"{path}: cache files must end in .safetensors")
    path = rank_path(path, resolve_shard(shard))
    check_writable(path, str(path), CacheFileError)
    return path


def _write_atomically(path: Path, arrays: Dict[str, mx.array], metadata: Dict[str, str]) -> None:
    write_atomically(path, lambda tmp: mx.save_safetensors(str(tmp), arrays, metadata=metadata))


def write_atomically(path, write) -> None:
    """``write(tmp)`` a ``.safetensors`` file in the target's directory, fsync, then rename it over ``path``.

    A failed write (disk full, interrupted) leaves the previous file as it was. The file gets the mode a new
    file gets (``0o666`` less the umask) or, when it replaces one, the old file's mode; a symlink is written
    through (its target is replaced, the link stays); a missing directory is an error, not created; a path that is
    not a regular file (a folder, FIFO or device, or a symlink to one) is refused, before and just before the
    rename (:func:`~kvpolicy_core.runtime.files.check_output_target`).
    """
    path = Path(path)
    check_output_target(path, str(path), CacheFileError)  # a directory, FIFO or device is refused, never replaced
    target = Path(os.path.realpath(path))
    if not target.parent.is_dir():
        raise CacheFileError(f"{path}: directory {target.parent} does not exist; create it first")
    try:
        mode = stat.S_IMODE(os.stat(target).st_mode)
    except FileNotFoundError:
        mode = None
    except OSError as exc:
        raise CacheFileError(f"{path}: cannot write there: {exc}") from None
    try:
        tmp = _new_file(target.parent, target.stem)
        if mode is not None:
            os.chmod(tmp, mode)
    except OSError as exc:
        raise CacheFileError(f"{path}: cannot write there: {exc}") from None
    try:
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        check_output_target(target, str(path), CacheFileError)  # still not made a device or pipe meanwhile
        os.replace(tmp, target)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(exc, Exception):
            raise CacheFileError(
                f"{path}: writing failed ({type(exc).__name__}: {exc}); the previous file is unchanged"
            ) from None
        raise
    with contextlib.suppress(OSError):  # make the rename itself durable
        dfd = os.open(target.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)


def _new_file(directory: Path, stem: str) -> Path:
    """A new, empty temporary ``.safetensors`` file in ``directory``, created with mode 0o666 less the umask
    (``tempfile.mkstemp`` would make it 0o600 whatever the umask)."""
    while True:
        tmp = directory / f".{stem}.{secrets.token_hex(8)}.tmp.safetensors"
        try:
            os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
            return tmp
        except FileExistsError:
            continue


def load_caches(
    path, *, shard: Optional[Tuple[int, int]] = None, model=None, expect_layers: Optional[int] = None
) -> List[Any]:
    """Read caches written by :func:`save_caches`; raises :class:`CacheFileError` on any damage.

    ``shard`` = (rank, world size), default this process's: the file read is ``path``'s rank
    file, and a file saved by another rank or world size is refused. ``model`` (the caches'
    model: one cache per entry of its ``make_prompt_cache``) or ``expect_layers``: a file with
    another number of layers is refused instead of failing (or silently misaligning) in generation;
    with ``model`` also a layer whose KV heads or head dims are not the model's, and the attention hook
    is installed on the model's modules (else on the modules the file records) for the caches that need it.
    Every layer's arrays are checked against its meta (:func:`.restore_checks.check_restored`).
    """
    shapes = None
    if model is not None:
        from .builder import model_kv_shapes

        shapes = model_kv_shapes(model)
        expect_layers = len(shapes)
    base, shard = Path(path), resolve_shard(shard)
    path = rank_path(base, shard)
    if not path.is_file():
        raise CacheFileError(missing_rank_file(base, path, shard))
    try:
        arrays, meta = mx.load(str(path), return_metadata=True)
    except (RuntimeError, ValueError, OSError) as exc:
        raise CacheFileError(f"{path}: unreadable safetensors file (truncated or corrupted): {exc}") from None
    try:
        header = json.loads(meta["kvpolicy"])
    except (KeyError, json.JSONDecodeError):
        raise CacheFileError(f"{path}: not a kvpolicy cache file (use kvpolicy_core.save_caches)") from None
    if not isinstance(header, dict) or header.get("format") not in _FORMATS:
        raise CacheFileError(
            f"{path}: format {header.get('format') if isinstance(header, dict) else None!r}, expected {FORMAT!r}"
        )
    covered = header if header["format"] == FORMAT else None
    if digest(arrays, covered) != header.get("sha256"):
        raise CacheFileError(f"{path}: checksum mismatch: the file was modified or corrupted")
    check_shard(path, header.get("shard"), shard, CacheFileError)
    layers = header.get("layers")
    if not isinstance(layers, list) or not all(isinstance(e, dict) for e in layers):
        raise CacheFileError(f"{path}: the header's layers must be a list of objects")
    if expect_layers is not None and len(layers) != expect_layers:
        raise CacheFileError(
            f"{path}: holds caches for {len(layers)} layers, but the model has "
            f"{expect_layers}: these caches belong to another model"
        )
    caches = []
    for i, entry in enumerate(layers):
        try:
            caches.append(_load_layer(arrays, i, entry, model))
        except (CacheFileError, ModelError):
            raise
        except KVPolicyError as exc:
            raise CacheFileError(f"{path}: layer {i}: {exc}") from None
    _check_shapes(path, caches, shapes)
    if model is not None:
        check_layers(path, caches, model)
    return caches


def check_layers(path, caches: Sequence[Any], model) -> None:
    """Each policy cache's ``window`` and ``layer`` are its model layer's: the window of the model's own cache
    there (None on a global layer) and the layer's index (its position, plus a pipeline rank's first layer); else
    :class:`CacheFileError` naming the field and the file. A checksum proves a file unchanged only against someone
    who cannot recompute it: a re-signed ``window`` on a global layer would silently limit its attention."""
    from ..runtime.sharding import shard_layout
    from .builder import native_caches

    natives = native_caches(model)
    if len(natives) != len(caches):
        raise CacheFileError(f"{path}: holds caches for {len(caches)} layers, but the model has {len(natives)}")
    first = shard_layout(model).layer_offset
    for i, (c, native) in enumerate(zip(caches, natives)):
        if not isinstance(c, PolicyCache):
            continue
        window = native.max_size if type(native) is RotatingKVCache else None
        if c.window != window:
            kind = f"a sliding-window layer of window {window}" if window is not None else "global (window None)"
            raise CacheFileError(
                f"{path}: layer {i}: window {c.window} in the file, but the model's layer {first + i} is {kind}: "
                "the file was modified or made for another model"
            )
        if c.layer != first + i:
            raise CacheFileError(
                f"{path}: layer {i}: layer {c.layer} in the file, but it holds the model's layer {first + i} "
                "(its place in the file): the file was modified"
            )


def _int(entry: Dict[str, Any], key: str, low: int = 0) -> int:
    x = entry.get(key)
    if isinstance(x, bool) or not isinstance(x, int) or x < low:
        raise KVPolicyError(f"{key} must be an int >= {low} (got {x!r})")
    return x


def _load_layer(arrays: Dict[str, mx.array], i: int, entry: Dict[str, Any], model) -> Any:
    """One layer's cache from the file's arrays ``{i}.*`` and its header entry, checked."""
    get = lambda name: arrays.get(f"{i}.{name}")  # noqa: E731
    kind = entry.get("class")
    if kind == "PolicyCache":
        meta = entry.get("meta")
        cache = from_meta(PolicyCache, meta, model=model)
        run = entry.get("run", [])
        if not isinstance(run, list) or any(get(f"run.{k}") is None for k in run):
            raise KVPolicyError(f"its run of prompt chunks names arrays the file lacks ({run!r})")
        keys, values = (
            tuple(get(f"{name}.{part}") for part in QUANT_PARTS) if get(f"{name}.words") is not None else get(name)
            for name in ("keys", "values")
        )
        if any(isinstance(x, tuple) and any(p is None for p in x) for x in (keys, values)):
            raise KVPolicyError(f"its quantized rows lack a part ({', '.join(QUANT_PARTS)})")
        state = (keys, values, get("positions"), get("scores"), meta)
        state += (get("log_weights"), {k: get(f"run.{k}") for k in run})
        if state[0] is None and any(x is not None for x in state[1:4]):
            raise KVPolicyError("it has values, positions or scores but no keys")
        if state[0] is not None and entry.get("n") != length(state[0]):
            raise KVPolicyError(f"n = {entry.get('n')!r} but {length(state[0])} keys are stored")
        load_state(cache, state, settled=False, model=model)
        return cache
    if kind not in ("KVCache", "RotatingKVCache"):
        raise CacheFileError(f"layer {i} has unknown cache class {kind!r}")
    keys, values = get("keys"), get("values")
    offset = _int(entry, "offset")
    if (keys is None) != (values is None):
        raise KVPolicyError("it has keys without values or values without keys")
    if keys is not None:
        if keys.ndim != 4 or values.ndim != 4 or keys.shape[:3] != values.shape[:3]:
            raise KVPolicyError(
                f"keys and values must be [B, H, L, D] with equal B, H, L (got keys "
                f"{list(keys.shape)}, values {list(values.shape)})"
            )
        if not (mx.issubdtype(keys.dtype, mx.floating) and mx.issubdtype(values.dtype, mx.floating)):
            raise KVPolicyError(f"keys and values must have a floating dtype (got {keys.dtype}, {values.dtype})")
    if kind == "KVCache":
        if keys is not None and keys.shape[2] != offset:
            raise KVPolicyError(f"a KVCache holds its offset's {offset} tokens, but {keys.shape[2]} are stored")
        c = KVCache()
    else:
        max_size, keep, idx = _int(entry, "max_size", 1), _int(entry, "keep"), _int(entry, "idx")
        held = 0 if keys is None else keys.shape[2]
        if keep > max_size or idx > held:
            raise KVPolicyError(
                f"RotatingKVCache with max_size {max_size}, keep {keep}: idx {idx} is not within "
                f"its {held} stored slots, or keep exceeds max_size"
            )
        c = RotatingKVCache(max_size=max_size, keep=keep)
        c._idx = idx
    if keys is not None:
        c.keys, c.values = keys, values
    c.offset = offset
    return c


def _check_shapes(path: Path, caches: List[Any], shapes) -> None:
    """All layers hold one batch; with the model's (kv heads, key dim, value dim) per layer, each layer has them."""
    shape = lambda c: (
        c._slots.shape() if isinstance(c, PolicyCache) else (*c.keys.shape[:2], c.keys.shape[3], c.values.shape[3])
    )  # noqa: E731
    batch = {shape(c)[0] for c in caches if getattr(c, "keys", None) is not None}
    if len(batch) > 1:
        raise CacheFileError(f"{path}: layers hold different batch sizes ({sorted(batch)}); one file holds one batch")
    for i, (c, want) in enumerate(zip(caches, shapes or [])):
        k = getattr(c, "keys", None)
        if want is None or k is None:
            continue
        got = shape(c)[1:]
        if got != want:
            raise CacheFileError(
                f"{path}: layer {i} holds (kv heads, key dim, value dim) {got}, but the model's "
                f"layer {i} has {want}: these caches belong to another model"
            )
