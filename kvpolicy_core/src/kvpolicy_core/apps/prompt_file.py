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
method, budget, tokens seen and kept, the compression ratio (flat string fields), and under ``kvpolicy``
a JSON object with the full config, the dtype, the prefill step and the document's token ids (the
server matches requests against them).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

FORMAT = "kvpolicy-prompt-cache/1"


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
    Returns the summary recorded in the file's metadata. ``model_path`` is recorded for mlx-lm's
    ``generate``, which loads the model from it.
    """
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import save_prompt_cache

    from ..config.parse import parse_config
    from ..errors import KVPolicyError
    from ..eval.perplexity import kv_bytes
    from ..integration.builder import KVCacheBuilder
    from ..integration.compress_once import compress_context, repeat_prompt, split_spec
    from ..integration.persistence import write_atomically

    path = Path(path)
    if path.suffix != ".safetensors":
        raise KVPolicyError(f"{path}: prompt-cache files must end in .safetensors")
    if prefill_step_size < 1:
        raise KVPolicyError(f"prefill_step_size must be >= 1 (got {prefill_step_size})")
    once = split_spec(config)
    if once is not None:
        if compress_once not in (None, once.scorer):
            raise KVPolicyError(f"--compress-once {compress_once} contradicts the method {once.to_string()}")
        compress_once, config = once.scorer, once.config
    config = parse_config(config)
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
            prompt_progress_callback=progress,
        ):
            pass
    for c in caches:  # the compressed state every question starts from (saving settles it too)
        getattr(c, "settle", lambda: None)()
    kept, full = kv_bytes(caches)
    sizes = [int(c.size()) for c in caches]
    dtype = next(
        (str(c.keys.dtype).removeprefix("mlx.core.") for c in caches if getattr(c, "keys", None) is not None), None
    )
    summary = {
        "method": config.method,
        "budget": config.policy.budget,
        "compress_once": compress_once or "",
        "tokens_seen": len(ids),
        "tokens_kept": max(sizes, default=0),  # the most any layer keeps
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
            }
        ),
    }
    write_atomically(path, lambda tmp: save_prompt_cache(str(tmp), caches, meta))
    return {**summary, "prompt_cache_file": str(path), "dtype": dtype, "prefill_step_size": prefill_step_size}


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
    return info


def file_metadata(path) -> Tuple[Dict[str, str], Optional[Dict[str, Any]]]:
    """(the user metadata mlx-lm's ``save_prompt_cache`` wrote, its kvpolicy object or None), read from the
    file's header without loading the caches."""
    import struct

    from ..errors import KVPolicyError

    path = Path(path)
    if not path.is_file():
        raise KVPolicyError(f"--prompt-cache {path}: no such file")
    try:
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            if size > 100_000_000:  # safetensors' own limit on the header
                raise ValueError(f"a header of {size} bytes")
            header = json.loads(f.read(size))
        raw = header.get("__metadata__", {})
    except (OSError, struct.error, ValueError, AttributeError) as exc:
        raise KVPolicyError(f"{path}: not a safetensors prompt-cache file ({type(exc).__name__}: {exc})") from None
    # save_prompt_cache flattens [metadata, classes, scalars]: the user metadata's keys are "0.<key>"
    metadata = {k[2:]: v for k, v in raw.items() if isinstance(k, str) and k.startswith("0.")}
    return metadata, read_info(metadata, path)


def load_prompt_file(path, model=None) -> Tuple[List[Any], Dict[str, str], Optional[Dict[str, Any]]]:
    """(caches, metadata, kvpolicy info) of a prompt-cache file; a fresh set of caches on every call.

    With ``model``: a file whose layers, KV heads or head dims are not the model's is refused.
    """
    import mlx.core as mx
    from mlx_lm.models.cache import load_prompt_cache

    from ..cache import policy_cache as _registered  # noqa: F401  (PolicyCache and BatchPolicyCache, where mlx-lm looks)
    from ..errors import KVPolicyError
    from ..integration.builder import model_kv_shapes

    path = Path(path)
    if not path.is_file():
        raise KVPolicyError(f"--prompt-cache {path}: no such file")
    try:
        caches, metadata = load_prompt_cache(str(path), return_metadata=True)
    except KVPolicyError:
        raise
    except Exception as exc:
        raise KVPolicyError(f"{path}: not a readable prompt-cache file ({type(exc).__name__}: {exc})") from None
    # read the file now, on this thread: an unevaluated array is bound to the loading thread's stream (a server
    # hands the caches to its generation thread) and would read whatever the file holds when it is evaluated
    mx.eval([c.state for c in caches])
    info = read_info(metadata, path)
    if model is not None:
        shapes = model_kv_shapes(model)
        if len(shapes) != len(caches):
            raise KVPolicyError(f"{path}: holds caches for {len(caches)} layers, but the model has {len(shapes)}")
        for i, (c, want) in enumerate(zip(caches, shapes)):
            k = getattr(c, "keys", None)
            if want is not None and k is not None and (k.shape[1], k.shape[3], c.values.shape[3]) != want:
                raise KVPolicyError(
                    f"{path}: layer {i} holds (kv heads, key dim, value dim) "
                    f"{(k.shape[1], k.shape[3], c.values.shape[3])}, but the model has {want}"
                )
    return caches, metadata, info
