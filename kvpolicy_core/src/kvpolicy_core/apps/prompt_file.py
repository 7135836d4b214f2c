"""Compress once, ask many: a long document prefilled once through a policy cache, saved as an mlx-lm prompt cache.

:func:`cache_prompt` runs mlx-lm's own chunked prefill (``generate_step`` with ``max_tokens=0``, as
``mlx_lm.cache_prompt`` does) over the document with policy caches and writes them with mlx-lm's
``save_prompt_cache``, so the file is an mlx-lm prompt-cache file: ``kvpolicy generate --prompt-cache``,
``kvpolicy serve --prompt-cache`` and mlx-lm's ``generate --prompt-cache-file`` (run with kvpolicy's cache
classes registered: ``python -m kvpolicy_core.apps.with_mlx_lm generate ...``) answer any number of questions
from it. Each question starts from its own copy of the loaded caches; the file is never written by asking.

The document and the questions are tokenized as mlx-lm's ``cache_prompt`` and ``generate`` do (with a chat
template: the document opens the user turn, each question continues it), so all three answer alike.
The file's metadata holds what mlx-lm's ``generate`` reads (``model``, ``tokenizer_config``), the
method, budget, tokens seen and kept, the compression ratio (flat string fields), under ``kvpolicy``
a JSON object with the full config, the dtype, the prefill step, the document's token ids (the
server matches requests against them) and the model's fingerprint (:func:`model_fingerprint`: its config and a
sample of its weight files, so other weights at the recorded path are refused), and under ``sha256`` the checksum of
every array and every other metadata field (:func:`~kvpolicy_core.integration.persistence.digest`, the checksum of
``save_caches`` files). Loading (:func:`load_prompt_file`) reads the file once, verifies the checksum and that every
layer's keys and values are finite, and refuses a damaged file with an error naming it; writing is atomic.
"""

from __future__ import annotations

import hashlib
import io
import json
import struct
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

FORMAT = "kvpolicy-prompt-cache/2"  # /2: the file carries a checksum (/1 files had none and are refused)
_OLD_FORMATS = ("kvpolicy-prompt-cache/1",)
#: the user-metadata field of the checksum (stored as ``0.sha256`` by ``save_prompt_cache``'s flattening)
DIGEST_FIELD = "sha256"
_FLAT_DIGEST = f"0.{DIGEST_FIELD}"
#: the dtypes a file may record (the model's, as ``--dtype`` takes them)
DTYPES = ("float32", "float16", "bfloat16")
_SAMPLE = 1 << 16  # bytes of each weight file read into the fingerprint, at four places
#: what ``compress_once`` takes besides the compress-once scorers: the method's own eviction, chunk by chunk
STREAM = "stream"


def rows_dtype(cache) -> str:
    """The dtype name of the keys a cache hands to attention (the model's, for quantized policy rows)."""
    slots = getattr(cache, "_slots", None)  # a PolicyCache's store: its rows may be quantized (tuples)
    dtype = slots.dtypes[0] if slots is not None and slots.dtypes else cache.keys.dtype
    return str(dtype).removeprefix("mlx.core.")


def document_ids(tokenizer, text: str) -> List[int]:
    """The document's token ids, as ``mlx_lm.cache_prompt`` makes them."""
    if tokenizer.has_chat_template:
        return list(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=False, continue_final_message=True
            )
        )
    return list(tokenizer.encode(text))


def question_ids(tokenizer, text: str) -> List[int]:
    """A question's token ids after a cached document, as ``mlx_lm.generate --prompt-cache-file`` makes them."""
    if not tokenizer.has_chat_template:
        return list(tokenizer.encode(text, add_special_tokens=True))
    messages = [{"role": "user", "content": text}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    marker = tokenizer.apply_chat_template(
        [{"role": "user", "content": "<query>"}], tokenize=False, add_generation_prompt=True
    )
    return list(tokenizer.encode(prompt[marker.index("<query>") :], add_special_tokens=False))


def model_fingerprint(model_path) -> Optional[str]:
    """A cheap fingerprint of the model directory ``model_path`` (None for anything else): ``config.json`` (as
    JSON, key order and spacing aside) and, per ``*.safetensors`` file, its name, size, header (every tensor's
    name, dtype, shape and offsets) and 64 KiB of its data at its start, a third, two thirds and its end. Other
    weights (another seed, a fine-tune, another size) change it; the dtype a model is run in does not."""
    d = Path(model_path)
    if not d.is_dir():
        return None
    h = hashlib.sha256()
    config = d / "config.json"
    if config.is_file():
        raw = config.read_bytes()
        try:
            raw = json.dumps(json.loads(raw), sort_keys=True).encode()
        except ValueError:
            pass
        h.update(b"config.json|" + raw)
    for f in sorted(d.glob("*.safetensors")):
        size = f.stat().st_size
        h.update(f"|{f.name}|{size}|".encode())
        with open(f, "rb") as fh:
            head = fh.read(8)
            n = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
            start = 8 + n if 8 + n <= size else size
            h.update(fh.read(start - 8))
            for at in (start, start + (size - start) // 3, start + 2 * (size - start) // 3, size - _SAMPLE):
                fh.seek(max(start, at))
                h.update(fh.read(_SAMPLE))
    return "sha256:" + h.hexdigest()


def cache_prompt(
    model,
    tokenizer,
    text: str,
    config: Any,
    path,
    *,
    model_path: str,
    prefill_step_size: int = 2048,
    progress=None,
    compress_once: Optional[str] = None,
) -> Dict[str, Any]:
    """Prefill ``text`` through policy caches built from ``config`` and save them to ``path`` (``.safetensors``).

    ``compress_once`` (``"kvzip"``; or a ``config`` written ``"kvzip+METHOD"``): the document is prefilled into
    full caches, scored by reconstruction and cut to the budget at once
    (:func:`~kvpolicy_core.integration.compress_once.compress_context`) instead of streamed through the policy;
    a document no longer than the budget has nothing to cut and is streamed (``compress_once`` "" in the summary).
    ``"stream"`` (or None with a plain method) streams it; ``"stream"`` with a ``kvzip+METHOD`` config is refused.
    ``progress(done, total)`` is called as the streamed prefill goes (default: :func:`.progress.reporter`'s lines
    on stderr; compress-once reports its prefill and reconstruction the same way).
    Returns the summary recorded in the file's metadata. ``model_path`` is recorded for mlx-lm's
    ``generate``, which loads the model from it, with its fingerprint (:func:`model_fingerprint`).
    """
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import save_prompt_cache

    from ..config.parse import parse_config
    from ..errors import KVPolicyError
    from ..eval.perplexity import kv_bytes
    from ..integration.builder import KVCacheBuilder
    from ..integration.compress_once import SCORERS, compress_context, repeat_prompt, split_spec
    from ..integration.persistence import write_atomically
    from ..runtime.files import check_writable
    from ..runtime.progress import reporter

    path = Path(path)
    if path.suffix != ".safetensors":
        raise KVPolicyError(f"{path}: prompt-cache files must end in .safetensors")
    if prefill_step_size < 1:
        raise KVPolicyError(f"prefill_step_size must be >= 1 (got {prefill_step_size})")
    check_writable(path, str(path), KVPolicyError)  # a device, pipe or missing directory: refused before the prefill
    if compress_once not in (None, STREAM, *SCORERS):
        raise KVPolicyError(f"--compress-once {compress_once}: must be one of {', '.join((*SCORERS, STREAM))}")
    once = split_spec(config)
    if once is not None:
        if compress_once == STREAM:
            raise KVPolicyError(
                f"--compress-once stream contradicts the method {once.to_string()}, which compresses the document "
                f"once with {once.scorer}: drop --compress-once, or give the method without '{once.scorer}+' "
                "to stream it"
            )
        if compress_once not in (None, once.scorer):
            raise KVPolicyError(f"--compress-once {compress_once} contradicts the method {once.to_string()}")
        compress_once, config = once.scorer, once.config
    config = parse_config(config)
    if compress_once == STREAM:  # the method's own streaming eviction: never more than budget + one chunk held
        compress_once, config = None, parse_config(config, when="stream")
    ids = document_ids(tokenizer, text)
    if not ids:
        raise KVPolicyError("the document has no tokens")
    if compress_once is not None and len(ids) <= config.policy.budget:
        compress_once = None  # nothing to cut: streaming keeps every token of a document within the budget
    if compress_once is not None:
        repeat = repeat_prompt(tokenizer)
        caches = compress_context(
            model, ids, config, scorer=compress_once, prefill_step=prefill_step_size, repeat=repeat
        ).caches
    else:
        caches = KVCacheBuilder.for_model(model, config)
        for _ in generate_step(
            mx.array(ids),
            model,
            max_tokens=0,
            prompt_cache=caches,
            prefill_step_size=prefill_step_size,
            prompt_progress_callback=progress or reporter("prefill"),
        ):
            pass
    for c in caches:  # the compressed state every question starts from (saving settles it too)
        getattr(c, "settle", lambda: None)()
    _check_finite(caches, f"{path}: the document's caches")
    kept, full = kv_bytes(caches)
    sizes = [int(c.size()) for c in caches]
    dtype = next((rows_dtype(c) for c in caches if getattr(c, "keys", None) is not None), None)
    summary = {
        "method": config.method,
        "budget": config.policy.budget,
        "compress_once": compress_once or "",
        "tokens_seen": len(ids),
        "tokens_kept": round(sum(sizes) / len(sizes), 1) if sizes else 0,  # per layer on average: the budget's unit
        "max_tokens_kept": max(sizes, default=0),  # the most any one layer keeps
        "tokens_kept_per_layer": sizes,
        "compression_ratio": round(full / kept, 4) if kept else 1.0,
        "kv_bytes_kept": kept,
        "kv_bytes_full": full,
    }
    meta = {
        "model": str(model_path),
        "tokenizer_config": json.dumps({}),
        **{k: str(v) for k, v in summary.items()},
        "kvpolicy": json.dumps(
            {
                "format": FORMAT,
                **summary,
                "config": config.to_dict(),
                "dtype": dtype,
                "prefill_step_size": prefill_step_size,
                "document_ids": ids,
                "model_fingerprint": model_fingerprint(model_path),
            }
        ),
    }

    def write(tmp: Path) -> None:
        """mlx-lm's file, then its checksum added to its metadata (the arrays as mlx-lm flattened them)."""
        save_prompt_cache(str(tmp), caches, meta)
        arrays, flat = mx.load(str(tmp), return_metadata=True)
        mx.save_safetensors(str(tmp), arrays, {**flat, _FLAT_DIGEST: _file_digest(arrays, flat)})

    write_atomically(path, write)
    return {**summary, "prompt_cache_file": str(path), "dtype": dtype, "prefill_step_size": prefill_step_size}


def _file_digest(arrays, flat: Dict[str, str]) -> str:
    """The checksum of a prompt-cache file: every array and every metadata field but the checksum's own
    (:func:`~kvpolicy_core.integration.persistence.digest`, as for ``save_caches`` files)."""
    from ..integration.persistence import digest

    return digest(arrays, {k: v for k, v in flat.items() if k != _FLAT_DIGEST})


def _check_finite(caches: List[Any], what: str) -> None:
    """Every layer's keys and values finite (a NaN or Inf key turns every later answer into noise)."""
    import mlx.core as mx

    from ..integration.persistence import CacheFileError

    for i, c in enumerate(caches):
        for name in ("keys", "values"):
            a = getattr(c, name, None)
            if isinstance(a, mx.array) and mx.issubdtype(a.dtype, mx.floating) and not mx.all(mx.isfinite(a)).item():
                raise CacheFileError(f"{what}: layer {i} holds non-finite {name} (NaN or Inf)")


def _check_finite_arrays(arrays: Dict[str, Any], what: str) -> None:
    """Every layer's keys and values finite, read from the file's arrays as ``save_prompt_cache`` names them
    (``"<layer>.0"`` the keys, ``"<layer>.1"`` the values of a layer's state)."""
    import mlx.core as mx

    from ..integration.persistence import CacheFileError

    for name, a in arrays.items():
        layer, _, part = name.partition(".")
        if part in ("0", "1") and mx.issubdtype(a.dtype, mx.floating) and not mx.all(mx.isfinite(a)).item():
            raise CacheFileError(f"{what}: layer {layer} holds non-finite {('keys', 'values')[int(part)]} (NaN or Inf)")


def read_info(metadata: Dict[str, str], path) -> Optional[Dict[str, Any]]:
    """The ``kvpolicy`` object of a prompt-cache file's metadata (None for a file mlx-lm wrote by itself)."""
    from ..errors import KVPolicyError

    raw = metadata.get("kvpolicy")
    if raw is None:
        return None
    try:
        info = json.loads(raw)
    except json.JSONDecodeError:
        info = None
    if isinstance(info, dict) and info.get("format") in _OLD_FORMATS:
        raise KVPolicyError(
            f"{path}: a {info['format']} file, written without a checksum, so it cannot be verified; "
            "write it again with kvpolicy cache-prompt"
        )
    if not isinstance(info, dict) or info.get("format") != FORMAT:
        raise KVPolicyError(f"{path}: its kvpolicy metadata is not a {FORMAT} object")
    ids = info.get("document_ids")
    if (
        not isinstance(info.get("config"), dict)
        or not isinstance(ids, list)
        or not ids
        or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids)
    ):
        raise KVPolicyError(f"{path}: its kvpolicy metadata needs a config object and the document's token ids")
    if info.get("dtype") is not None and info["dtype"] not in DTYPES:
        raise KVPolicyError(
            f"{path}: metadata field dtype is {info['dtype']!r}; a prompt-cache file records one of "
            f"{', '.join(DTYPES)} (the file was modified, or written by something else)"
        )
    if "model_fingerprint" not in info:
        raise KVPolicyError(
            f"{path}: metadata field model_fingerprint is missing; kvpolicy cache-prompt always records it "
            "(the file was modified)"
        )
    fingerprint = info.get("model_fingerprint")
    if fingerprint is not None and not isinstance(fingerprint, str):
        raise KVPolicyError(f"{path}: metadata field model_fingerprint must be a string (got {fingerprint!r})")
    if not isinstance(metadata.get("model", ""), str):
        raise KVPolicyError(f"{path}: metadata field model must be a path")
    if fingerprint is None and metadata.get("model") and model_fingerprint(metadata["model"]) is not None:
        raise KVPolicyError(
            f"{path}: metadata field model_fingerprint is null, but the model {metadata['model']} is a model "
            "directory, which cache-prompt fingerprints (the file was modified)"
        )
    seen = info.get("tokens_seen")
    if seen != len(ids):
        raise KVPolicyError(
            f"{path}: metadata field document_ids holds {len(ids)} tokens, but tokens_seen is {seen!r} "
            "(the file was modified)"
        )
    try:
        from ..config.parse import parse_config

        parse_config(info["config"])
    except KVPolicyError as exc:
        raise KVPolicyError(f"{path}: metadata field config: {exc}") from None
    return info


def check_model(path, info: Optional[Dict[str, Any]], model_path) -> None:
    """Refuse a model directory whose fingerprint is not the one ``path``'s metadata records (other weights or
    another model at the recorded path, or a tampered ``model`` field). Files without a fingerprint, and a
    ``model_path`` that is not a directory (nothing to compare), pass."""
    from ..errors import KVPolicyError

    want = (info or {}).get("model_fingerprint")
    if want is None:
        return
    got = model_fingerprint(model_path)
    if got is not None and got != want:
        raise KVPolicyError(
            f"{path}: metadata field model: the model at {model_path} is not the one this file was made with "
            "(its config or weights differ from the fingerprint the file records); write the file again "
            "with kvpolicy cache-prompt for this model"
        )


def file_metadata(path) -> Tuple[Dict[str, str], Optional[Dict[str, Any]]]:
    """(the user metadata mlx-lm's ``save_prompt_cache`` wrote, its kvpolicy object or None), read from the
    file's header without loading the caches."""
    from ..errors import KVPolicyError
    from ..runtime.files import not_a_file

    path = Path(path)
    why = not_a_file(path)
    if why is not None:  # missing, a directory, a symlink loop, a device
        raise KVPolicyError(f"--prompt-cache {path}: {why}")
    try:
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            if size > 100_000_000:  # safetensors' own limit on the header
                raise ValueError(f"a header of {size} bytes")
            header = json.loads(f.read(size))
    except (OSError, struct.error, ValueError) as exc:
        raise KVPolicyError(f"{path}: not a safetensors prompt-cache file ({type(exc).__name__}: {exc})") from None
    raw = header.get("__metadata__", {}) if isinstance(header, dict) else header
    if not isinstance(raw, dict):
        field = "header's __metadata__" if isinstance(header, dict) else "header"
        kind = {list: "an array", str: "a string", int: "a number", float: "a number"}.get(type(raw), repr(raw))
        raise KVPolicyError(f"{path}: not a safetensors prompt-cache file (its {field} is {kind}, not a JSON object)")
    # save_prompt_cache flattens [metadata, classes, scalars]: the user metadata's keys are "0.<key>"
    metadata = {k[2:]: v for k, v in raw.items() if isinstance(k, str) and k.startswith("0.")}
    return metadata, read_info(metadata, path)


def load_prompt_file(
    path, model=None, *, model_path=None
) -> Tuple[List[Any], Dict[str, str], Optional[Dict[str, Any]]]:
    """(caches, metadata, kvpolicy info) of a prompt-cache file; a fresh set of caches on every call.

    The file is read once; a kvpolicy file's checksum must match every array and metadata field read, and every
    layer's keys and values must be finite, else :class:`~kvpolicy_core.integration.persistence.CacheFileError`
    naming the file (a file mlx-lm wrote by itself carries no checksum: only its values are checked). With
    ``model``: :func:`check_caches` (layers, KV heads and head dims, the model directory's fingerprint: ``model_path``,
    default the one the file records).
    """
    import mlx.core as mx
    from mlx_lm.models.cache import load_prompt_cache

    from ..cache import policy_cache as _registered  # noqa: F401  (PolicyCache and BatchPolicyCache, where mlx-lm looks)
    from ..errors import MLX_ERRORS, KVPolicyError
    from ..integration.persistence import CacheFileError
    from ..runtime.files import not_a_file

    path = Path(path)
    why = not_a_file(path)
    if why is not None:  # missing, a directory, a symlink loop, a device
        raise KVPolicyError(f"--prompt-cache {path}: {why}")
    try:
        data = path.read_bytes()
        arrays, flat = mx.load(_named(data), return_metadata=True)
    except (RuntimeError, ValueError, OSError) as exc:
        raise CacheFileError(f"{path}: not a readable prompt-cache file ({type(exc).__name__}: {exc})") from None
    metadata = {k[2:]: v for k, v in flat.items() if k.startswith("0.")}
    info = read_info(metadata, path)
    if info is not None and flat.get(_FLAT_DIGEST) != _file_digest(arrays, flat):
        raise CacheFileError(
            f"{path}: checksum mismatch: the file was modified or corrupted"
            if _FLAT_DIGEST in flat
            else f"{path}: has no checksum (metadata field {DIGEST_FIELD}): it was modified, or not written by "
            "kvpolicy cache-prompt"
        )
    _check_finite_arrays(arrays, str(path))  # before the loader, whose restore refuses them with a vaguer message
    del arrays
    try:  # the very bytes just verified, as mlx-lm's loader reads them
        caches, metadata = load_prompt_cache(_named(data), return_metadata=True)
    except (*MLX_ERRORS, OSError, KVPolicyError, TypeError, KeyError, AttributeError) as exc:  # a damaged file's
        raise CacheFileError(f"{path}: not a loadable prompt-cache file ({type(exc).__name__}: {exc})") from None
    # evaluate now, on this thread: an unevaluated array is bound to the loading thread's stream (a server
    # hands the caches to its generation thread)
    mx.eval([c.state for c in caches])
    _check_finite(caches, str(path))
    if model is not None:
        check_caches(path, caches, model, info, model_path or metadata.get("model"))
    return caches, metadata, info


def _named(data: bytes) -> io.BytesIO:
    """``data`` as a file MLX reads as safetensors (it takes the format from the name)."""
    f = io.BytesIO(data)
    f.name = "prompt-cache.safetensors"
    return f


def check_recorded(path, caches: List[Any], model, info: Dict[str, Any]) -> None:
    """The caches are what the file's kvpolicy metadata says cache-prompt made: every layer saw the document
    (``offset`` = ``tokens_seen``), keeps ``tokens_kept_per_layer`` tokens, is a cache of the recorded method
    (its config apart from the budget and the layer's RoPE) and, for a document streamed through an allocation
    that does not read the prompt, keeps that allocation's budget for its layer (a compress-once cut or a
    data-driven allocation sets budgets from the document: each layer then keeps at most its own). Else a
    :class:`~kvpolicy_core.integration.persistence.CacheFileError` naming the field and the file."""
    from mlx_lm.models.cache import RotatingKVCache

    from ..cache.policy_cache import PolicyCache
    from ..config.parse import parse_config
    from ..config.policy import allocation_of, layer_budgets
    from ..integration.builder import layer_infos, native_caches
    from ..integration.persistence import CacheFileError
    from ..parts.base import needs_of
    from ..runtime.sharding import shard_layout

    config = parse_config(info["config"])
    seen, kept = info["tokens_seen"], info.get("tokens_kept_per_layer")
    if not isinstance(kept, list) or len(kept) != len(caches):
        raise CacheFileError(f"{path}: metadata field tokens_kept_per_layer must list one count per layer")
    loose = ("budget", "rope_freqs", "rope_traditional")
    want = {k: v for k, v in config.to_dict().items() if k not in loose}
    budgets = None
    if not info.get("compress_once") and not needs_of(allocation_of(config)[0]).layer_stats:
        windows = [n.max_size if type(n) is RotatingKVCache else None for n in native_caches(model)]
        budgets = layer_budgets(config, layer_infos(model, windows, shard_layout(model).layer_offset))
    for i, c in enumerate(caches):
        if getattr(c, "offset", seen) != seen:
            raise CacheFileError(
                f"{path}: layer {i}: offset {c.offset}, but the file's document has {seen} tokens (tokens_seen)"
            )
        if int(c.size()) != kept[i]:
            raise CacheFileError(
                f"{path}: layer {i}: holds {int(c.size())} tokens, but tokens_kept_per_layer records {kept[i]!r}"
            )
        if not isinstance(c, PolicyCache):
            continue
        mine = {k: v for k, v in c.policy.config.to_dict().items() if k not in loose}
        if mine != want:
            fields = sorted(k for k in set(mine) | set(want) if mine.get(k) != want.get(k))
            raise CacheFileError(
                f"{path}: layer {i}: config field(s) {', '.join(fields)} differ from the file's config "
                f"({config.to_string()})"
            )
        if budgets is not None and c.budget != budgets[i]:
            raise CacheFileError(
                f"{path}: layer {i}: budget {c.budget}, but {config.to_string()} gives this layer {budgets[i]} "
                "(the file was modified)"
            )


def check_caches(path, caches: List[Any], model, info: Optional[Dict[str, Any]] = None, model_path=None) -> None:
    """Refuse caches that are not ``model``'s (their layers, KV heads or head dims; with ``model_path``, a model
    directory whose fingerprint is not the file's: :func:`check_model`), then let caches whose layers keep
    different numbers of tokens (a kvzip cut) hold the attention hook, which batched serving needs for them
    (:func:`~kvpolicy_core.integration.compress_once.hold_hook`)."""
    from ..errors import KVPolicyError
    from ..integration.builder import model_kv_shapes
    from ..integration.compress_once import hold_hook
    from ..integration.persistence import check_layers

    if model_path is not None:
        check_model(path, info, model_path)
    check_layers(path, caches, model)
    if info is not None:
        check_recorded(path, caches, model, info)
    shapes = model_kv_shapes(model)
    if len(shapes) != len(caches):
        raise KVPolicyError(f"{path}: holds caches for {len(caches)} layers, but the model has {len(shapes)}")
    for i, (c, want) in enumerate(zip(caches, shapes)):
        k = getattr(c, "keys", None)
        if k is None or want is None:
            continue
        slots = getattr(c, "_slots", None)  # a PolicyCache's store: its rows may be quantized (tuples)
        have = slots.shape()[1:] if slots is not None else (k.shape[1], k.shape[3], c.values.shape[3])
        if have != want:
            raise KVPolicyError(
                f"{path}: layer {i} holds (kv heads, key dim, value dim) {have}, but the model has {want}"
            )
    from ..attention import hook as attention

    found = attention.model_modules(model)
    for i, c in enumerate(caches):
        hook = getattr(c, "attention_hook", None)
        if hook is not None and sorted(hook.modules) != found:
            raise KVPolicyError(
                f"{path}: layer {i} was saved for the attention of {', '.join(hook.modules)}, but the model's "
                f"attention is in {', '.join(found) or 'no mlx-lm module'}: the file belongs to another model family"
            )
    hold_hook(model, caches)
