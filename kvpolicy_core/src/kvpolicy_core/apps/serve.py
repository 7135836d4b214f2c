"""``kvpolicy serve``: mlx-lm's own OpenAI-compatible server, with policy caches on every request.

Nothing here serves HTTP by itself: :func:`main` runs ``mlx_lm.server.main`` (so every mlx-lm
server option parses and behaves as upstream) with these pieces swapped in:

- :class:`PolicyModelProvider` attaches the method to the model it loads (every cache the
  server makes, batched or not, is a policy cache) and recomputes whether it can batch;
- ``RecordingBatchGenerator`` (mlx-lm's ``BatchGenerator``) and :class:`StatsPromptCache`
  (mlx-lm's ``LRUPromptCache``) record each finished request's cache: tokens seen and kept
  per layer, KV bytes;
- :class:`PolicyAPIHandler`, mlx-lm's handler plus ``GET /kvpolicy/stats``; it checks each
  request before mlx-lm's generation thread sees it (``serve_requests``: headers, body, fields,
  an empty prompt), so bad input is an HTTP 400;
- :class:`PolicyResponseGenerator`, mlx-lm's generation loop, restarted when it fails: the
  requests it held get the error, the server keeps serving (upstream, the thread dies and every
  later request is refused).

One method per server. mlx-lm builds caches in its generation thread from the model alone
(``make_prompt_cache(model)``) and keys reusable prompt caches by model, so a per-request
method cannot be honoured without replacing that loop; a request that asks for one (a
``kvpolicy`` or ``method`` field) is refused with HTTP 400 instead of being silently ignored.

Prompt-cache reuse is mlx-lm's own: a stored cache is handed out as a deep copy; mlx-lm trims
a longer one to serve a shorter prompt only if ``is_trimmable()``, which a policy cache answers
truthfully (:meth:`PolicyCache.is_trimmable`: while nothing was evicted and its scores are per token,
or for the tokens of a short last update, which a stored cache never has; so never for H2O/CaM, whose
scores carry the attention of the tokens a trim would drop). Otherwise a stored cache is reused only
as an exact prefix of the new prompt.
``--prompt-cache FILE`` (:mod:`kvpolicy_core.apps.prompt_file`) pins a compressed document: every request
whose prompt extends it starts from a copy of its caches, with the file's model and method. The file is verified
(checksum, finite values, the model's fingerprint) before the model loads. A request that does not extend the
document is prefilled from scratch: logged as a warning and counted in ``/kvpolicy/stats`` (``prompt_cache_file``).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import io
import json
import logging
import os
import socket
import sys
import threading
import time
import types
import warnings
from collections import deque
from pathlib import Path
from typing import Any, List, Optional

from ..integration.token_ids import check_token_ids
from .serve_requests import (
    EMPTY_PROMPT,
    FINITE_FIELDS,
    BadRequest,
    check_fields,
    check_logit_bias,
    check_prompt_shape,
    check_sampling,
    content_length,
    parse_body,
    read_body,
)

_RECENT = 64  # finished requests kept for /kvpolicy/stats


class StartupError(Exception):
    """The server cannot start (e.g. its port is in use): one error line, exit status 2."""


class GenerationFailed(RuntimeError):
    """The generation loop failed while it held this request (the request gets it as its error)."""


class _TrackedQueue:
    """A request's response queue as the generation loop sees it: it knows when the request is done
    (``None`` or an exception put on it), so a failed loop can fail exactly the requests it held."""

    __slots__ = ("queue", "finished")

    def __init__(self, queue) -> None:
        self.queue = queue
        self.finished = False

    def put(self, item) -> None:
        if item is None or isinstance(item, BaseException):
            self.finished = True
        self.queue.put(item)


def _vocab_size(model, tokenizer) -> Optional[int]:
    """Rows of the model's logits: its config's ``vocab_size`` (or its text config's), else the tokenizer's size."""
    args = getattr(model, "args", None)
    for source in (args, getattr(args, "text_config", None)):
        n = source.get("vocab_size") if isinstance(source, dict) else getattr(source, "vocab_size", None)
        if isinstance(n, int) and n > 0:
            return n
    with contextlib.suppress(Exception):
        return len(tokenizer)  # mlx-lm's TokenizerWrapper passes len() to the Hugging Face tokenizer
    return None


def _has_images(messages) -> bool:
    """Whether a chat's messages have an image part (mlx-lm tokenizes those with the model's processor, in its
    generation thread: not tokenized ahead here). The part types mlx-lm's server reads as images."""
    return any(
        isinstance(part, dict)
        and part.get("type") in ("image_url", "input_image", "image")
        and part.get("image_url", part.get("image")) is not None
        for message in messages or ()
        if isinstance(message, dict) and isinstance(message.get("content"), list)
        for part in message["content"]
    )


#: mlx-lm's numeric server options and their bounds ((low, high), None: unbounded), checked at start-up: mlx-lm
#: takes any number (``--prefill-step-size 0`` spun the generation thread forever on the first request)
SERVER_OPTIONS = {
    "max_tokens": ("--max-tokens", 1, None),
    "decode_concurrency": ("--decode-concurrency", 1, None),
    "prompt_concurrency": ("--prompt-concurrency", 1, None),
    "prefill_step_size": ("--prefill-step-size", 1, None),
    "prompt_cache_size": ("--prompt-cache-size", 0, None),
    "prompt_cache_bytes": ("--prompt-cache-bytes", 0, None),
    "num_draft_tokens": ("--num-draft-tokens", 0, None),
    "temp": ("--temp", 0, None),
    "top_p": ("--top-p", 0, 1),
    "top_k": ("--top-k", 0, None),
    "min_p": ("--min-p", 0, 1),
    "kv_bits": ("--kv-bits", 1, 8),
    "kv_group_size": ("--kv-group-size", 1, None),
    "quantized_kv_start": ("--quantized-kv-start", 0, None),
}
#: seconds the generation loop may hold unfinished requests without a step (a decode step, a prefill chunk, a
#: token, a request taken) before ``/health`` answers 503 ``stalled``
STALL_SECONDS = 600.0


def prefill_transient(model, rows: int, S: int, decode_rows: int = 1) -> int:
    """Bytes one prefill step of ``rows`` prompts of ``S`` tokens takes beyond the K/V it writes, measured by MLX's
    allocator on mlx-lm's own caches: the chunk's logits (a prompt's last chunk computes them for each of its tokens,
    ``rows x S x vocab``), hidden states, MLP activations and attention over itself; or one decode step of
    ``decode_rows`` rows, if more. (A chunk's attention over a longer cache is counted by :func:`request_memory`.)"""
    import gc

    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    caches = make_prompt_cache(model)
    tokens = mx.zeros((rows, S), dtype=mx.int32)
    mx.eval(tokens)
    gc.collect()
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    mx.eval(model(tokens, cache=caches))
    peak = mx.get_peak_memory() - before
    kv = [getattr(c, n, None) for c in caches for n in ("keys", "values")]
    chunk = peak - sum(int(a.nbytes) for a in kv if isinstance(a, mx.array))
    caches = make_prompt_cache(model)
    step = mx.zeros((decode_rows, 1), dtype=mx.int32)
    mx.eval(step)
    gc.collect()
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    mx.eval(model(step, cache=caches))
    return max(0, int(chunk), int(mx.get_peak_memory() - before))


def request_memory(model, config, provider) -> int:
    """The kept bytes of one request under ``kvpolicy serve --kv-memory M``: ``M`` bounds the KV caches of the
    requests in flight (at most ``R = --decode-concurrency + --prompt-concurrency``, what mlx-lm's batch holds at
    once) together with the prefill step's own memory: ``A`` (:func:`prefill_transient`, measured at start-up for
    ``P = --prompt-concurrency`` prompts of ``S = --prefill-step-size`` tokens, or a decode step of ``R`` rows) and
    the chunk's attention logits over a held cache, ``a = P * Hq * S * 4 * k`` bytes per budget token (one layer at a
    time, ``Hq`` query heads). Each request's most is ``max(k * b, b + S) * c`` (``b`` its budget, ``c`` its bytes
    per token over the layers, ``k`` the method's ``hold``, 1 when it streams), so::

        R * max(k * b, b + S) * c + a * b + A <= M
        kept = b * c,  b = min((M - A) / (R * k * c + a), (M - A - R * S * c) / (R * c + a))

    A method that holds whole prompts (``when="prompt_end"`` without ``hold``) has no such bound and is refused;
    so is a limit that cannot hold the prefill step and one chunk per request, or whose share cannot hold the
    method's least cache (the builder names ``kv_memory``)."""
    import mlx.core as mx

    from ..errors import ConfigError
    from ..integration.builder import model_kv_layout
    from ..integration.memory_budget import bytes_per_token

    args, policy = provider.cli_args, config.policy
    if policy.when == "prompt_end" and policy.hold is None:
        raise ConfigError(
            "--kv-memory: this method holds each prompt whole until its cut (when='prompt_end'), so no limit bounds "
            "it: give hold=k (the held prompt counts k x the budget) or when=stream in --method"
        )
    R, P, S = args.decode_concurrency + args.prompt_concurrency, args.prompt_concurrency, args.prefill_step_size
    k = policy.hold if policy.when == "prompt_end" else 1.0
    shapes, itemsize = model_kv_layout(model)
    if config.kv_dtype is not None:
        itemsize = getattr(mx, config.kv_dtype).size
    c = sum(bytes_per_token(shapes, itemsize, config.kv_bits, config.kv_group_size))  # the stored rows' bytes
    A = prefill_transient(model, P, S, R)
    Hq = int(getattr(getattr(model, "args", None), "num_attention_heads", 0) or 0)
    a = P * Hq * S * 4 * k
    M = provider.kv_memory - A
    kept = int(min(M / (R * k * c + a), (M - R * S * c) / (R * c + a)) * c) if M > 0 else 0
    if kept <= 0:
        raise ConfigError(
            f"--kv-memory: {provider.kv_memory} bytes cannot hold {R} requests in flight (--decode-concurrency "
            f"{args.decode_concurrency} + --prompt-concurrency {P}), one prefill chunk each ({S} tokens x {c} bytes), "
            f"beside the prefill step's own memory ({A} bytes measured for {P} prompts of {S} tokens: its logits and "
            "activations): give more memory, fewer requests in flight or a smaller --prefill-step-size"
        )
    return kept


def stored_caches_limit(rest: List[str], kv_memory: Optional[int]) -> List[str]:
    """mlx-lm's ``--prompt-cache-bytes`` (the caches it keeps for reuse, trimmed to what the active ones leave) set to
    the ``--kv-memory`` limit, unless given."""
    given = any(a == "--prompt-cache-bytes" or a.startswith("--prompt-cache-bytes=") for a in rest)
    return [] if kv_memory is None or given else ["--prompt-cache-bytes", str(kv_memory)]


def check_server_options(cli_args) -> None:
    """Every numeric mlx-lm server option in :data:`SERVER_OPTIONS` finite and within its bounds (options this
    mlx-lm does not have, and unset optional ones, pass); a StartupError naming the option otherwise."""
    import math

    for attr, (option, low, high) in SERVER_OPTIONS.items():
        value = getattr(cli_args, attr, None)
        if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if not math.isfinite(value) or value < low or (high is not None and value > high):
            within = f"in [{low}, {high}]" if high is not None else f">= {low}"
            raise StartupError(f"{option} must be a finite number {within} (got {value})")


def load_method(spec: str) -> Any:
    """``--method`` value -> a validated KVCacheConfig: a config string, JSON, or a .json/.toml file."""
    from ..config.parse import parse_config
    from ..errors import ConfigError

    if spec.lower().endswith((".json", ".toml")):
        from .textfile import read_text_file

        text = read_text_file(spec, "--method")
        if spec.lower().endswith(".toml"):
            import tomllib

            try:
                data = tomllib.loads(text)
            except tomllib.TOMLDecodeError as exc:
                raise ConfigError(f"--method {spec}: invalid TOML: {exc}") from None
        else:
            try:
                data = json.loads(text)
            except json.JSONDecodeError as exc:
                raise ConfigError(
                    f"--method {spec}: invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}"
                ) from None
        return parse_config(data)
    return parse_config(spec)


def cache_report(caches: List[Any]) -> dict:
    """One request's cache, summarised: tokens seen, tokens kept per layer, KV bytes kept/full."""
    from ..cache.policy_cache import PolicyCache

    kept, seen, kept_bytes, full_bytes = [], 0, 0, 0
    for c in caches:
        if isinstance(c, PolicyCache):
            kept.append(c.tokens_kept)
            seen = max(seen, c.tokens_seen)
            kept_bytes += c.kept_bytes
            full_bytes += c.full_seq_bytes
        else:  # a layer the method leaves to mlx-lm (layers="unbounded")
            kept.append(int(c.size()))
            kept_bytes += c.nbytes
            full_bytes += c.nbytes
    return {
        "tokens_seen": seen,
        "tokens_kept": round(sum(kept) / len(kept), 1) if kept else 0,  # per layer on average: the budget's unit
        "tokens_kept_per_layer": kept,
        "max_tokens_kept": max(kept, default=0),
        "kv_bytes_kept": kept_bytes,
        "kv_bytes_full": full_bytes,
        "compression_ratio": round(full_bytes / kept_bytes, 4) if kept_bytes else 1.0,
        "finished_at": time.time(),
    }


class ServerStats:
    """Thread-safe record of recent finished requests (the generation thread writes, HTTP reads)."""

    def __init__(self, config) -> None:
        self.config = config
        self.budget = None  #: the mean per-layer budget of the loaded model's caches (kv_memory picks it per model)
        self.model_path: Optional[str] = None
        self.batching = False
        self.peak_batch = 0  # most sequences decoded together in one step
        self._lock = threading.Lock()
        self._recent: deque = deque(maxlen=_RECENT)
        self._count = 0
        self.document: Optional[dict] = None  # --prompt-cache: the file, its length, requests that extend it or not
        self.last_step = time.monotonic()  # the generation loop's last sign of progress (see step)

    def step(self) -> None:
        """The generation loop made progress (a decode step, a token, a request taken): ``/health`` reads it."""
        self.last_step = time.monotonic()

    def serve_document(self, path: str, tokens: int) -> None:
        """Count the requests that extend the ``--prompt-cache`` document of ``tokens`` tokens, and those that
        do not."""
        self.document = {
            "path": str(path),
            "document_tokens": tokens,
            "requests_extending": 0,
            "requests_not_extending": 0,
            "last_not_extending": None,
        }

    def document_request(self, extends: bool, detail: Optional[dict] = None) -> None:
        with self._lock:
            if extends:
                self.document["requests_extending"] += 1
            else:
                self.document["requests_not_extending"] += 1
                self.document["last_not_extending"] = detail

    def decoded(self, rows: int) -> None:
        """One batched decode step over ``rows`` sequences (tracks the largest batch seen)."""
        if rows > self.peak_batch:
            self.peak_batch = rows

    def record(self, caches: List[Any]) -> None:
        report = cache_report(caches)
        with self._lock:
            self._count += 1
            report["request"] = self._count
            self._recent.append(report)

    def snapshot(self, prompt_cache=None) -> dict:
        with self._lock:
            recent = list(self._recent)
            count = self._count
        out = {
            "method": self.config.method,
            "config": self.config.to_dict(),
            "budget": self.budget if self.budget is not None else self.config.policy.budget,
            "model": self.model_path,
            "batching": self.batching,
            "peak_batch": self.peak_batch,
            "requests_finished": count,
            "recent": recent,
            "memory": process_memory(),
        }
        if prompt_cache is not None:
            out["prompt_cache"] = {"sequences": len(prompt_cache), "bytes": prompt_cache.nbytes}
        if self.document is not None:
            with self._lock:
                out["prompt_cache_file"] = dict(self.document)
        return out


def process_memory() -> dict:
    """What MLX's allocator holds now and at its peak, in bytes (measured, beside the caches' accounted bytes)."""
    import mlx.core as mx

    return {"active_bytes": int(mx.get_active_memory()), "peak_bytes": int(mx.get_peak_memory())}


@functools.lru_cache(maxsize=None)
def _server_classes():
    """The mlx-lm server classes extended for kvpolicy (built once, lazily: importing mlx_lm.server is slow)."""
    import mlx.core as mx
    from mlx_lm import server as mls
    from mlx_lm.generate import BatchGenerator
    from mlx_lm.models.cache import LRUPromptCache, can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache

    from ..integration.builder import attach

    class PolicyModelProvider(mls.ModelProvider):
        """mlx-lm's model provider; every model it loads gets the server's method attached."""

        def __init__(self, cli_args, config, stats: ServerStats, dtype: str = "auto", kv_memory=None) -> None:
            super().__init__(cli_args)
            self.kv_config = config
            self.stats = stats
            self.dtype = dtype
            self.kv_memory = kv_memory  #: bytes for the KV caches of every request in flight (--kv-memory), or None
            self.attached = None  #: the model the method is attached to

        def load(self, model_path, adapter_path=None, draft_model_path=None):
            """mlx-lm's public ``load``; a model it has just loaded gets the method attached (once per model)."""
            if self._names(model_path, adapter_path, draft_model_path)[2] is not None:
                raise ValueError(
                    "--draft-model: speculative decoding rewinds (trims) the cache, which a policy "
                    "cache cannot do after evictions; serve without a draft model"
                )
            loaded = super().load(model_path, adapter_path, draft_model_path)
            if self.model is not None and self.model is not self.attached:
                self._attach()
            return loaded

        def _names(self, model, adapter, draft):
            """(model, adapter, draft model) as mlx-lm's ``load`` resolves them: ``default_model`` names the
            command line's (from the public ``cli_args``, not mlx-lm's private maps)."""
            default = model == "default_model"
            return (
                self.cli_args.model if default else model,
                self.cli_args.adapter_path if default else adapter,
                self.cli_args.draft_model if draft == "default_model" else draft,
            )

        def _attach(self) -> None:
            if self.dtype == "auto" and sys.platform.startswith("linux"):
                self.model.set_dtype(mx.float32)
            elif self.dtype != "auto":
                self.model.set_dtype(getattr(mx, self.dtype))
            if self.cli_args.kv_bits is not None:  # the policy caches store their rows quantized: mlx-lm then batches
                self.kv_config = self.kv_config.replace(
                    kv_bits=int(self.cli_args.kv_bits), kv_group_size=int(self.cli_args.kv_group_size)
                )
                self.cli_args.kv_bits = None
                self.stats.config = self.kv_config
            if self.kv_memory is not None:  # the server's limit shared by the requests in flight (request_memory)
                self.kv_config = self.kv_config.replace(kv_memory=request_memory(self.model, self.kv_config, self))
                self.stats.config = self.kv_config
            attach(self.model, self.kv_config)
            caches = make_prompt_cache(self.model)
            self.is_batchable = all(hasattr(c, "merge") for c in caches)
            budgets = [c.budget for c in caches if hasattr(c, "budget")]
            self.stats.budget = round(sum(budgets) / len(budgets)) if budgets else None  # per layer, on average
            self.vocab_size = _vocab_size(self.model, self.tokenizer)
            self.stats.model_path = str(self.model_key[0])
            # mlx-lm batches only without its own --kv-bits (ResponseGenerator._is_batchable); ours is in the caches
            self.stats.batching = self.is_batchable and self.cli_args.kv_bits is None
            self.attached = self.model  # (last: a failed attach is tried again by the next load)

        def loaded_for(self, model, adapter, draft):
            """(tokenizer, vocab size) of the loaded model if a request for ``model`` gets it, else None.

            Resolves the names as ``load`` does; None when the request names another model (the
            generation thread loads it) or a name mlx-lm cannot look up.
            """
            tokenizer, vocab_size, loaded = self.tokenizer, getattr(self, "vocab_size", None), self.model_key
            key = self._names(model, adapter, draft)
            return (tokenizer, vocab_size) if tokenizer is not None and key == loaded else None

    class StatsPromptCache(LRUPromptCache):
        """mlx-lm's prompt cache; records the final cache of requests served one at a time.

        mlx-lm's sequential path stores a finished request's cache without a ``cache_type``;
        the batched path always names one (and also stores prompt segments), so batched
        requests are recorded by :class:`RecordingBatchGenerator` instead.
        """

        def __init__(self, stats: ServerStats, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.stats = stats
            self.pinned: List[tuple] = []  # (model key, document token ids, caches) of --prompt-cache files

        def pin(self, model, tokens: List[int], caches: List[Any]) -> None:
            """Serve every prompt that extends ``tokens`` from a copy of ``caches`` (never evicted, never changed)."""
            self.pinned.append((model, list(tokens), caches))

        def fetch_nearest_cache(self, model, tokens):
            """The stored cache that covers most of ``tokens``: a pinned document's copy, unless the LRU holds a
            longer prefix (:meth:`_fetch_stored`). A request that extends no pinned document is logged and counted
            (it is prefilled from scratch, or from whatever the LRU holds)."""
            cache, rest = self._fetch_stored(model, tokens)
            covered = len(tokens) - len(rest) if cache is not None else 0
            pinned = [(ids, caches) for key, ids, caches in self.pinned if key == model]
            for ids, caches in pinned:
                if len(ids) < len(tokens) and list(tokens[: len(ids)]) == ids:
                    self.stats.document_request(True)
                    if covered < len(ids):
                        return copy.deepcopy(caches), list(tokens[len(ids) :])
                    return cache, rest
            if pinned:
                self._not_extending(pinned[0][0], tokens, covered)
            return cache, rest

        def _not_extending(self, ids: List[int], tokens, covered: int) -> None:
            tokens = list(tokens)
            same = next((i for i, (a, b) in enumerate(zip(ids, tokens)) if a != b), min(len(ids), len(tokens)))
            why = (
                f"it differs from the document at token {same}"
                if same < min(len(ids), len(tokens))
                else f"it has {len(tokens)} tokens, not more than the document's {len(ids)}"
            )
            detail = {"prompt_tokens": len(tokens), "first_difference": same, "cached_tokens": covered}
            self.stats.document_request(False, detail)
            logging.warning(
                f"kvpolicy serve: a request of {len(tokens)} tokens does not extend the --prompt-cache document "
                f"({why}): it is prefilled without the document's compressed caches ({covered} tokens cached). "
                "Send the document's text exactly as cache-prompt read it, then the question"
            )

        def _fetch_stored(self, model, tokens):
            """mlx-lm's look-up, but never "all of the prompt is cached, nothing to feed".

            mlx-lm answers an exact match with the stored cache and no tokens left, and its batched
            path then fails ("empty prompt", killing the generation thread). With trimmable caches
            that rarely happens (mlx-lm drops a trimmable cache's stored prefixes); policy caches
            keep theirs (they cannot be trimmed exactly), e.g. the cache mlx-lm stores before a
            prompt's last token. So an exact match gives back its last token: trimmed off when the
            cache can be trimmed, else the look-up is repeated for the prompt without it.
            """
            cache, rest = super().fetch_nearest_cache(model, tokens)
            if cache is None or rest or not tokens:
                return cache, rest
            if can_trim_prompt_cache(cache):
                trim_prompt_cache(cache, 1)
                return cache, tokens[-1:]
            cache, rest = self._fetch_stored(model, tokens[:-1])
            return cache, list(rest) + tokens[-1:]

        def insert_cache(self, model, tokens, prompt_cache, *, cache_type: Optional[str] = None):
            if cache_type is None:
                self.stats.record(prompt_cache)
            return super().insert_cache(model, tokens, prompt_cache, cache_type=cache_type or "assistant")

    class RecordingBatchGenerator(BatchGenerator):
        """mlx-lm's BatchGenerator; records each finished sequence's cache for the stats."""

        stats: Optional[ServerStats] = None

        def next(self):
            prompt_responses, generation_responses = super().next()
            if self.stats is not None:
                self.stats.step()
                self.stats.decoded(len(generation_responses))
                for r in generation_responses:
                    if r.finish_reason is not None and r.prompt_cache is not None:
                        self.stats.record(r.prompt_cache)
            return prompt_responses, generation_responses

    class PolicyResponseGenerator(mls.ResponseGenerator):
        """mlx-lm's response generator; one request's failure never stops the generation thread.

        mlx-lm runs its whole generation loop (``_generate``) in one thread and lets it die on the
        first exception, after which every request is refused. Here the loop is restarted instead:
        the requests it had taken (in the batch, or waiting for it) get the error, requests still
        queued are served by the new loop. A loop that fails before taking any request (loading
        the model) stops the server as upstream, rather than failing in a circle.
        """

        def __init__(self, *args, **kwargs) -> None:
            self._taken: List[_TrackedQueue] = []  # before super() starts the thread
            self._requests_taken = 0
            super().__init__(*args, **kwargs)

        def _run_generate(self):
            while True:
                taken_before = self._requests_taken
                try:
                    self._generate()
                    return
                except Exception as exc:  # mlx-lm's loop runs the model on any request: whatever kills it, restart
                    logging.exception(
                        f"kvpolicy serve: the generation loop failed ({exc}); "
                        "its requests get the error, the loop restarts"
                    )
                    self._fail_taken(exc)
                    if self._stop or self._requests_taken == taken_before:
                        self._generation_failed = True
                        return

        @property
        def is_healthy(self):
            return self.stalled_for() is None and super().is_healthy

        def stalled_for(self) -> Optional[float]:
            """Seconds since the loop's last step while it holds unfinished requests, if more than
            :data:`STALL_SECONDS` (a loop that makes no progress: ``/health`` answers 503), else None."""
            idle = time.monotonic() - self.model_provider.stats.last_step
            busy = any(not q.finished for q in self._taken)
            return idle if busy and idle > STALL_SECONDS else None

        def _next_request(self, timeout=None):
            self.model_provider.stats.step()
            request = super()._next_request(timeout)
            if request is None:
                return None
            tracked = _TrackedQueue(request[0])
            self._taken = [q for q in self._taken if not q.finished]
            self._taken.append(tracked)
            self._requests_taken += 1
            return (tracked, *request[1:])

        def _fail_taken(self, exc: BaseException) -> None:
            # a fresh error, not exc: its traceback holds the failed loop's frames (batch, caches)
            error = GenerationFailed(f"generation failed: {type(exc).__name__}: {exc}")
            for q in self._taken:
                if not q.finished:
                    q.put(error)
            self._taken = []

        def pretokenize(self, tokenizer, request, chat_template_kwargs) -> None:
            """Tokenize ``request`` in the HTTP thread: BadRequest if it cannot be, or has no tokens.

            The generation thread then takes these tokens (same tokenizer) instead of tokenizing again.
            """
            args = types.SimpleNamespace(chat_template_kwargs=chat_template_kwargs)
            what = "prompt" if request.request_type == "text" else "messages"
            from jinja2 import TemplateError  # (mlx-lm's dependency: the chat templates)

            try:
                tokenized = mls.ResponseGenerator._tokenize(self, tokenizer, request, args)
            except (TemplateError, ValueError, TypeError, KeyError, IndexError, AttributeError) as exc:
                raise BadRequest(f"{what}: cannot be tokenized: {type(exc).__name__}: {exc}") from None
            if not tokenized[0]:
                raise BadRequest(EMPTY_PROMPT[request.request_type])
            check_token_ids(tokenized[0], getattr(self.model_provider, "vocab_size", None), what, BadRequest)
            request._kvpolicy_tokenized = (tokenizer, tokenized)

        def _tokenize(self, tokenizer, request, args):
            done = request.__dict__.pop("_kvpolicy_tokenized", None)
            if done is not None and done[0] is tokenizer:
                return done[1]
            tokenized = super()._tokenize(tokenizer, request, args)
            if not tokenized[0]:  # mlx-lm's batch would fail on it (a request for another model)
                raise ValueError(EMPTY_PROMPT[request.request_type])
            return tokenized

    class PolicyAPIHandler(mls.APIHandler):
        """mlx-lm's request handler plus ``GET /kvpolicy/stats``, checking each request first.

        Before mlx-lm sees a POST: its Content-Length and body are read and parsed here (a bad
        header, a short, non-UTF-8 or non-JSON body is a 400, not a dropped connection), a
        per-request method is refused, and fields mlx-lm would fail on in its generation thread
        are checked. Before generation: the prompt is tokenized (an empty one is a 400). A failure
        after the response started is answered (500, or an SSE error event) instead of dropped.
        """

        def do_GET(self):
            if self.path.split("?")[0].rstrip("/") == "/kvpolicy/stats":
                rg = self.response_generator
                body = rg.model_provider.stats.snapshot(getattr(rg, "prompt_cache", None))
                self._set_completion_headers(200)
                self.end_headers()
                self.wfile.write(json.dumps(body).encode())
                self.wfile.flush()
                return
            super().do_GET()

        def handle_health_check(self):
            """mlx-lm's ``/health``, plus 503 ``stalled`` for a generation loop that holds requests and makes no
            progress (:meth:`PolicyResponseGenerator.stalled_for`), e.g. one stuck in a step."""
            stalled = self.response_generator.stalled_for()
            if stalled is None:
                return super().handle_health_check()
            self._set_completion_headers(503)
            self.end_headers()
            self.wfile.write(json.dumps({"status": "stalled", "seconds_without_progress": round(stalled)}).encode())
            self.wfile.flush()

        def do_POST(self):
            length = self.headers.get("Content-Length")
            if length is not None:  # without one, mlx-lm answers 411
                try:
                    raw = read_body(self.rfile, content_length(length))
                    body = parse_body(raw)
                    if isinstance(body, dict):  # mlx-lm refuses any other JSON value
                        chat = self.path.rstrip("/").endswith("chat/completions")
                        check_fields(body, self.response_generator.model_provider.kv_config.method, chat)
                except BadRequest as exc:
                    self._send_error(400, str(exc))
                    return
                self.rfile = io.BytesIO(raw)
            super().do_POST()

        def validate_model_parameters(self) -> None:
            super().validate_model_parameters()  # mlx-lm's checks; logit_bias keys become ints
            fields = ("seed", "logit_bias", *FINITE_FIELDS)
            check_sampling({f: getattr(self, f, None) for f in fields})  # BadRequest is a ValueError: a 400
            loaded = self._loaded()
            if loaded is not None:
                check_logit_bias(self.logit_bias, loaded[1])

        def handle_completion(self, request, stop_words):
            try:
                check_prompt_shape(request)
                loaded = self._loaded()
                if loaded is not None and not _has_images(request.messages):
                    self.response_generator.pretokenize(loaded[0], request, self.chat_template_kwargs)
            except BadRequest as exc:
                self._send_error(400, str(exc))
                return
            try:
                super().handle_completion(request, stop_words)
            except OSError:
                raise  # the client went away: nothing to answer
            except Exception as exc:  # the request's boundary: any failure of its generation is its 500 reply
                self._send_failure(exc)

        def _loaded(self):
            return self.response_generator.model_provider.loaded_for(
                self.requested_model, self.adapter, self.requested_draft_model
            )

        def _send_error(self, status: int, message: str) -> None:
            self._set_completion_headers(status)
            self.end_headers()
            self.wfile.write(json.dumps({"error": message}).encode())
            self.wfile.flush()

        def _send_failure(self, exc: Exception) -> None:
            """A request that failed after its response started (mlx-lm would drop the connection)."""
            message = (
                str(exc) if isinstance(exc, GenerationFailed) else f"generation failed: {type(exc).__name__}: {exc}"
            )
            logging.error(f"kvpolicy serve: {message}")
            with contextlib.suppress(OSError):
                if self.stream:  # headers and maybe some events are out: end the stream with an error event
                    self.wfile.write(f"data: {json.dumps({'error': message})}\n\n".encode())
                    self.wfile.flush()
                else:  # the 200 status line is still buffered: replace it
                    self._headers_buffer = []
                    self._send_error(500, message)

    return types.SimpleNamespace(
        ModelProvider=PolicyModelProvider,
        PromptCache=StatsPromptCache,
        APIHandler=PolicyAPIHandler,
        BatchGenerator=RecordingBatchGenerator,
        ResponseGenerator=PolicyResponseGenerator,
    )


def run(host: str, port: int, model_provider, provider=None, **_upstream) -> None:
    """mlx-lm's ``server.run`` with the kvpolicy prompt cache, generator and handler (one process, rank 0).

    ``provider(cli_args)``, if given, makes the model provider from the command line mlx-lm parsed (``main``
    hands this function mlx-lm's own provider, whose ``cli_args`` it takes). The port is bound before the
    generation thread starts: a port in use (or a bad ``--host``) is :class:`StartupError`, with no thread left
    running to keep the process alive.
    """
    from http.server import ThreadingHTTPServer

    from mlx_lm import server as mls

    classes = _server_classes()
    if provider is not None:
        model_provider = provider(model_provider.cli_args)
    if not 0 <= port <= 65535:  # getaddrinfo would wrap it (70000 -> 4464)
        raise StartupError(f"--port {port}: not a port number (0 to 65535)")
    try:
        family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
        server_class = type("HTTPServer", (ThreadingHTTPServer,), {"address_family": family})
        httpd = server_class(address, None)  # the handler needs the generator, made next
    except (OSError, OverflowError) as exc:
        reason = getattr(exc, "strerror", None) or exc
        raise StartupError(f"--host {host} --port {port}: cannot listen there: {reason}") from None
    prompt_cache = classes.PromptCache(model_provider.stats, model_provider.cli_args.prompt_cache_size)
    if getattr(model_provider, "document", None):  # --prompt-cache: every question starts from a copy
        prompt_cache.pin(model_provider.model_key, *model_provider.document)
    response_generator = classes.ResponseGenerator(model_provider, prompt_cache)
    fingerprint = mls.get_system_fingerprint()
    httpd.RequestHandlerClass = lambda *args, **kwargs: classes.APIHandler(
        response_generator, *args, system_fingerprint=fingerprint, **kwargs
    )
    warnings.warn("mlx_lm.server is not recommended for production as it only implements basic security checks.")
    logging.info(f"Starting httpd at {host} on port {port}...")
    try:
        httpd.serve_forever()
    except KeyboardInterrupt:
        httpd.server_close()
        response_generator.stop_and_join()


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvpolicy serve",
        add_help=False,
        description="mlx-lm's OpenAI-compatible server with a kvpolicy method on every request's cache. "
        "Every other option is mlx-lm's (mlx_lm.server --help), passed through unchanged.",
    )
    p.add_argument(
        "--method",
        default=None,
        help='config string ("cam:budget=256"), JSON, or a .json/.toml file (default: cam, or the '
        "--prompt-cache file's)",
    )
    p.add_argument(
        "--prompt-cache",
        metavar="FILE.safetensors",
        help="a document compressed once by kvpolicy cache-prompt: every request whose prompt extends "
        "it starts from a copy of its caches (its model and method are the server's)",
    )
    p.add_argument("--model", help="local mlx-lm model directory (default: the embedded Gemma 3 270M)")
    p.add_argument(
        "--kv-memory",
        metavar="SIZE",
        help="KV memory for every request in flight together (512MB, 2GB, 1.5GiB): each request's budget is chosen "
        "so that its cache, prompt chunk included, stays within SIZE / (--decode-concurrency + --prompt-concurrency)",
    )
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "float16", "bfloat16"],
        help="model dtype (auto: float32 on Linux CPU)",
    )
    p.add_argument("-h", "--help", action="store_true")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    """Parse kvpolicy's options, validate everything that can fail, then run mlx-lm's server."""
    argv = list(sys.argv[1:] if argv is None else argv)
    ours, rest = _parser().parse_known_args(argv)
    if ours.help:
        _parser().print_help()
        print("\nmlx-lm server options (passed through):")
        with _patched_argv(["mlx_lm.server", "--help"]):
            with contextlib.suppress(SystemExit):
                from mlx_lm import server as mls

                mls.main()
        return 0
    from ..errors import ConfigError, KVPolicyError
    from ..model.default import ModelUnavailable, resolve_model_path

    try:
        config = load_method(ours.method or "cam")
        kv_memory = None
        if ours.kv_memory is not None:
            from ..config.cache_config import parse_bytes

            try:
                kv_memory = parse_bytes(ours.kv_memory)
            except ValueError as exc:
                raise ConfigError(f"--kv-memory {exc}") from None
            if not isinstance(kv_memory, int) or kv_memory < 1:
                raise ConfigError(f"--kv-memory must be a size in bytes (got {ours.kv_memory!r})")
        from ..config.policy import build_policy

        build_policy(config)  # every part of the method is installed and builds from this config
        document = None
        if ours.prompt_cache:
            config, model_path, ours.dtype, document = _prompt_file_settings(ours, config)
        else:
            model_path = resolve_model_path(ours.model)
    except (KVPolicyError, ModelUnavailable) as exc:
        print(f"kvpolicy serve: error: {exc}", file=sys.stderr)
        return 2
    from ..integration.mlx_lm_private import missing_message

    changed = missing_message(("mlx_lm.server.ResponseGenerator", "mlx_lm.server.APIHandler"))
    if changed is not None:  # the private mlx-lm names the server's subclasses override or call
        print(f"kvpolicy serve: error: {changed}", file=sys.stderr)
        return 2

    from mlx_lm import server as mls

    classes = _server_classes()
    stats = ServerStats(config)
    generator = type("BatchGenerator", (classes.BatchGenerator,), {"stats": stats})
    failed: List[BaseException] = []

    def provider(cli_args):
        try:
            check_server_options(cli_args)  # before the model loads
            mp = classes.ModelProvider(cli_args, config, stats, ours.dtype, kv_memory)
            mp.load_default()  # load and attach now: a model the method cannot serve fails at start-up
            if document is not None:  # (document token ids, caches), verified already; checked against the model
                from .prompt_file import check_caches

                caches, info = document
                check_caches(ours.prompt_cache, caches, mp.model, info, model_path)
                mp.document = (info["document_ids"], caches)
                stats.serve_document(ours.prompt_cache, len(info["document_ids"]))
        except (StartupError, KVPolicyError, ModelUnavailable, ValueError, OSError, ImportError) as exc:
            failed.append(exc)  # said as kvpolicy serve's error (exit 2); anything else is an unexpected one
            raise SystemExit(2)
        return mp

    def stream_generate(*args, **kwargs):  # mlx-lm's one-request path: each token is progress for /health
        for response in upstream_stream_generate(*args, **kwargs):
            stats.step()
            yield response

    upstream_stream_generate = mls.stream_generate
    with (
        _patched_argv(["kvpolicy serve", *rest, *stored_caches_limit(rest, kv_memory), "--model", str(model_path)]),
        _patched(
            mls,
            run=functools.partial(run, provider=provider),
            BatchGenerator=generator,
            stream_generate=stream_generate,
        ),
    ):
        try:
            mls.main()
        except StartupError as exc:
            print(f"kvpolicy serve: error: {exc}", file=sys.stderr)
            return 2
        except SystemExit as exc:
            if failed:
                print(f"kvpolicy serve: error: {failed[0]}", file=sys.stderr)
                return 2
            return int(exc.code or 0) if isinstance(exc.code, int) else 2
    # mlx-lm has stopped its HTTP server and joined its generation thread (Ctrl-C). Exit now:
    # tearing the interpreter down after MLX ran on that thread aborts in C++ ("terminate called").
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _prompt_file_settings(ours, config):
    """(config, model path, dtype, (caches, kvpolicy info)) for ``--prompt-cache``: the file's method and model,
    which ``--method`` and ``--model`` may repeat but not change, and its caches, verified (checksum, finite values,
    the model directory's fingerprint): a clear error before the model loads."""
    from ..config.parse import parse_config
    from ..errors import KVPolicyError
    from .prompt_file import check_model, file_metadata, load_prompt_file

    metadata, info = file_metadata(ours.prompt_cache)
    if info is None or "model" not in metadata:
        raise KVPolicyError(f"--prompt-cache {ours.prompt_cache}: not a file of kvpolicy cache-prompt")
    saved = parse_config(info["config"])
    if ours.method is not None and config != saved:
        raise KVPolicyError(
            f"--method {ours.method} is not the method of --prompt-cache {ours.prompt_cache} ({saved.to_string()})"
        )
    from ..model.default import resolve_model_path

    if ours.model is not None and resolve_model_path(ours.model).resolve() != Path(metadata["model"]).resolve():
        raise KVPolicyError(
            f"--model {ours.model} is not the model of --prompt-cache {ours.prompt_cache} ({metadata['model']})"
        )
    # the caches and metadata verified (a damaged file is named as such), then the weights at the model path
    caches, metadata, info = load_prompt_file(ours.prompt_cache)
    check_model(ours.prompt_cache, info, metadata["model"])
    dtype = info.get("dtype") if ours.dtype == "auto" and info.get("dtype") else ours.dtype
    return saved, Path(metadata["model"]), dtype, (caches, info)


@contextlib.contextmanager
def _patched_argv(argv: List[str]):
    saved = sys.argv
    sys.argv = argv
    try:
        yield
    finally:
        sys.argv = saved


@contextlib.contextmanager
def _patched(module, **names):
    saved = {k: getattr(module, k) for k in names}
    for k, v in names.items():
        setattr(module, k, v)
    try:
        yield
    finally:
        for k, v in saved.items():
            setattr(module, k, v)
