"""``kvpolicy serve``: mlx-lm's own OpenAI-compatible server, with policy caches on every request.

Nothing here serves HTTP by itself: :func:`main` runs ``mlx_lm.server.main`` (so every mlx-lm
server option parses and behaves as upstream) with these pieces swapped in:

- :class:`PolicyModelProvider` attaches the method to the model it loads (every cache the
  server makes, batched or not, is a policy cache) and recomputes whether it can batch;
- ``RecordingBatchGenerator`` (mlx-lm's ``BatchGenerator``) and :class:`StatsPromptCache`
  (mlx-lm's ``LRUPromptCache``) record each finished request's cache: tokens seen and kept
  per layer, KV bytes;
- :class:`PolicyAPIHandler`, mlx-lm's handler plus ``GET /kvpolicy/stats``.

One method per server. mlx-lm builds caches in its generation thread from the model alone
(``make_prompt_cache(model)``) and keys reusable prompt caches by model, so a per-request
method cannot be honoured without replacing that loop; a request that asks for one (a
``kvpolicy`` field) is refused with HTTP 400 instead of being silently ignored.

Prompt-cache reuse is mlx-lm's own: a stored cache is handed out as a deep copy; mlx-lm trims
a longer one to serve a shorter prompt only if ``is_trimmable()``, which a policy cache answers
truthfully (:meth:`PolicyCache.is_trimmable`: only while nothing was evicted and its scores
are per token, so never for H2O/CaM, whose scores carry the attention of the tokens a trim
would drop). Otherwise a stored cache is reused only as an exact prefix of the new prompt.
``--prompt-cache FILE`` (:mod:`kvpolicy_core.prompt_file`) pins a compressed document: every request
whose prompt extends it starts from a copy of its caches, with the file's model and method.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import json
import os
import sys
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any, List, Optional

_RECENT = 64  # finished requests kept for /kvpolicy/stats


def load_method(spec: str) -> Any:
    """``--method`` value -> a validated KVCacheConfig: a config string, JSON, or a .json/.toml file."""
    from .config import parse_config
    from .errors import ConfigError

    path = Path(spec)
    if spec.lower().endswith((".json", ".toml")):
        if not path.is_file():
            raise ConfigError(f"--method {spec}: no such file")
        text = path.read_text()
        if path.suffix.lower() == ".toml":
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
    from .cache import PolicyCache

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
        self.model_path: Optional[str] = None
        self.batching = False
        self.peak_batch = 0  # most sequences decoded together in one step
        self._lock = threading.Lock()
        self._recent: deque = deque(maxlen=_RECENT)
        self._count = 0

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
            "budget": self.config.policy.budget,
            "model": self.model_path,
            "batching": self.batching,
            "peak_batch": self.peak_batch,
            "requests_finished": count,
            "recent": recent,
        }
        if prompt_cache is not None:
            out["prompt_cache"] = {"sequences": len(prompt_cache), "bytes": prompt_cache.nbytes}
        return out


@functools.lru_cache(maxsize=None)
def _server_classes():
    """The mlx-lm server classes extended for kvpolicy (built once, lazily: importing mlx_lm.server is slow)."""
    import mlx.core as mx
    from mlx_lm import server as mls
    from mlx_lm.generate import BatchGenerator
    from mlx_lm.models.cache import LRUPromptCache, can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache

    from .builder import attach

    class PolicyModelProvider(mls.ModelProvider):
        """mlx-lm's model provider; every model it loads gets the server's method attached."""

        def __init__(self, cli_args, config, stats: ServerStats, dtype: str = "auto") -> None:
            super().__init__(cli_args)
            self.kv_config = config
            self.stats = stats
            self.dtype = dtype

        def _load(self, model_path, adapter_path=None, draft_model_path=None):
            if draft_model_path is not None:
                raise ValueError(
                    "--draft-model: speculative decoding rewinds (trims) the cache, which a policy "
                    "cache cannot do after evictions; serve without a draft model"
                )
            super()._load(model_path, adapter_path, draft_model_path)
            if self.dtype == "auto" and sys.platform.startswith("linux"):
                self.model.set_dtype(mx.float32)
            elif self.dtype != "auto":
                self.model.set_dtype(getattr(mx, self.dtype))
            attach(self.model, self.kv_config)
            self.is_batchable = all(hasattr(c, "merge") for c in make_prompt_cache(self.model))
            self.stats.model_path = str(model_path)
            self.stats.batching = self.is_batchable

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
            longer prefix (:meth:`_fetch_stored`)."""
            cache, rest = self._fetch_stored(model, tokens)
            covered = len(tokens) - len(rest) if cache is not None else 0
            for key, ids, caches in self.pinned:
                if key == model and covered < len(ids) < len(tokens) and list(tokens[: len(ids)]) == ids:
                    return copy.deepcopy(caches), list(tokens[len(ids):])
            return cache, rest

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
                self.stats.decoded(len(generation_responses))
                for r in generation_responses:
                    if r.finish_reason is not None and r.prompt_cache is not None:
                        self.stats.record(r.prompt_cache)
            return prompt_responses, generation_responses

    class PolicyAPIHandler(mls.APIHandler):
        """mlx-lm's request handler plus ``GET /kvpolicy/stats``."""

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

        def do_POST(self):
            # Refuse a per-request method instead of silently ignoring it (see the module docstring).
            length = self.headers.get("Content-Length")
            if length is not None and length.isdigit():
                import io

                raw = self.rfile.read(int(length))
                self.rfile = io.BytesIO(raw)
                try:
                    body = json.loads(raw.decode())
                except (ValueError, UnicodeDecodeError):
                    body = None  # mlx-lm answers malformed bodies itself
                if isinstance(body, dict) and "kvpolicy" in body:
                    method = self.response_generator.model_provider.kv_config.method
                    self._set_completion_headers(400)
                    self.end_headers()
                    self.wfile.write(json.dumps({"error": (
                        "kvpolicy: a per-request method is not supported; this server applies "
                        f"its --method ({method}) to every request. Start another server for another method."
                    )}).encode())
                    return
            super().do_POST()

    return PolicyModelProvider, StatsPromptCache, PolicyAPIHandler, RecordingBatchGenerator


def run(host: str, port: int, model_provider) -> None:
    """mlx-lm's ``server.run`` with the kvpolicy prompt cache and handler (one process, rank 0)."""
    from mlx_lm import server as mls

    _, StatsPromptCache, PolicyAPIHandler, _ = _server_classes()
    prompt_cache = StatsPromptCache(model_provider.stats, model_provider.cli_args.prompt_cache_size)
    if getattr(model_provider, "document", None):  # --prompt-cache: every question starts from a copy
        prompt_cache.pin(model_provider.model_key, *model_provider.document)
    response_generator = mls.ResponseGenerator(model_provider, prompt_cache)
    mls._run_http_server(host, port, response_generator, handler_class=PolicyAPIHandler)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvpolicy serve", add_help=False,
        description="mlx-lm's OpenAI-compatible server with a kvpolicy method on every request's cache. "
                    "Every other option is mlx-lm's (mlx_lm.server --help), passed through unchanged.",
    )
    p.add_argument("--method", default=None,
                   help='config string ("cam:budget=256"), JSON, or a .json/.toml file (default: cam, or the '
                        "--prompt-cache file's)")
    p.add_argument("--prompt-cache", metavar="FILE.safetensors",
                   help="a document compressed once by kvpolicy cache-prompt: every request whose prompt extends "
                        "it starts from a copy of its caches (its model and method are the server's)")
    p.add_argument("--model", help="local mlx-lm model directory (default: the embedded Gemma 3 270M)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"],
                   help="model dtype (auto: float32 on Linux CPU)")
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
    from .errors import KVPolicyError
    from .model.default import ModelUnavailable, resolve_model_path

    try:
        config = load_method(ours.method or "cam")
        from .policy import build_policy

        build_policy(config)  # every part of the method is installed and builds from this config
        if ours.prompt_cache:
            config, model_path, ours.dtype = _prompt_file_settings(ours, config)
        else:
            model_path = resolve_model_path(ours.model)
    except (KVPolicyError, ModelUnavailable) as exc:
        print(f"kvpolicy serve: error: {exc}", file=sys.stderr)
        return 2

    from mlx_lm import server as mls

    PolicyModelProvider, _, _, RecordingBatchGenerator = _server_classes()
    stats = ServerStats(config)
    generator = type("BatchGenerator", (RecordingBatchGenerator,), {"stats": stats})
    failed: List[BaseException] = []

    def provider(cli_args):
        mp = PolicyModelProvider(cli_args, config, stats, ours.dtype)
        try:
            mp.load_default()  # load and attach now: a model the method cannot serve fails at start-up
            if ours.prompt_cache:  # (document token ids, caches), loaded and checked against the model now
                from .prompt_file import load_prompt_file

                caches, _, info = load_prompt_file(ours.prompt_cache, mp.model)
                mp.document = (info["document_ids"], caches)
        except Exception as exc:
            failed.append(exc)
            raise SystemExit(2)
        return mp

    with _patched_argv(["kvpolicy serve", *rest, "--model", str(model_path)]), \
            _patched(mls, ModelProvider=provider, run=run, BatchGenerator=generator):
        try:
            mls.main()
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
    """(config, model path, dtype) for ``--prompt-cache``: the file's method and model, which ``--method`` and
    ``--model`` may repeat but not change (a clear error before anything loads)."""
    from .config import parse_config
    from .errors import KVPolicyError
    from .prompt_file import file_metadata

    metadata, info = file_metadata(ours.prompt_cache)
    if info is None or "model" not in metadata:
        raise KVPolicyError(f"--prompt-cache {ours.prompt_cache}: not a file of kvpolicy cache-prompt")
    saved = parse_config(info["config"])
    if ours.method is not None and config != saved:
        raise KVPolicyError(f"--method {ours.method} is not the method of --prompt-cache {ours.prompt_cache} "
                            f"({saved.to_string()})")
    from .model.default import resolve_model_path

    if ours.model is not None and resolve_model_path(ours.model).resolve() != Path(metadata["model"]).resolve():
        raise KVPolicyError(f"--model {ours.model} is not the model of --prompt-cache {ours.prompt_cache} "
                            f"({metadata['model']})")
    dtype = info.get("dtype") if ours.dtype == "auto" and info.get("dtype") else ours.dtype
    return saved, Path(metadata["model"]), dtype


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
