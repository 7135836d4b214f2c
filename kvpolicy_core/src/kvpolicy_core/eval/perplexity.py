"""Perplexity with a bounded cache (the StreamingLLM recipe) and the baseline caches to compare.

A *cache spec* is a kvpolicy config (``"cam:budget=128"``), ``"full"`` (mlx-lm's
``KVCache`` on every layer), ``"rotating:budget=N"`` (mlx-lm's
``RotatingKVCache(N, keep=4)`` on every layer: StreamingLLM's sinks + window) or a compress-once
method ``"kvzip+h2o:budget=N"`` (:mod:`kvpolicy_core.integration.compress_once`: the whole context is
scored before it is cut, so it has no streaming caches; the long-context suite runs it).
"""

from __future__ import annotations

import math
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache, RotatingKVCache

from ..cache.policy_cache import PolicyCache
from ..config.cache_config import KVCacheConfig
from ..config.parse import parse_config, parse_config_string
from ..errors import ConfigError
from ..integration.builder import KVCacheBuilder
from ..integration.compress_once import split_spec


def parse_spec(spec: Any):
    """A cache spec -> ("full", None) | ("rotating", budget) | ("policy", KVCacheConfig)
    | ("compress-once", CompressOnceSpec)."""
    if isinstance(spec, KVCacheConfig):
        return "policy", spec
    once = split_spec(spec)
    if once is not None:
        return "compress-once", once
    if isinstance(spec, str):
        head = spec.strip().partition(":")[0].strip()
        if head == "full":
            if spec.strip() != "full":
                raise ConfigError(f"'full' takes no options (got {spec!r})")
            return "full", None
        if head == "rotating":
            fields = parse_config_string(spec)
            budget = fields.pop("budget", 512)
            fields.pop("method")
            if fields:
                raise ConfigError(f"rotating: unknown field(s) {', '.join(fields)}; accepted: budget")
            if not isinstance(budget, int) or budget <= 4:
                raise ConfigError(f"rotating_budget: must be an integer > 4 (keep=4 sinks) (got {budget!r})")
            return "rotating", budget
    return "policy", parse_config(spec)


def spec_label(spec: Any) -> str:
    kind, value = parse_spec(spec)
    if kind == "full":
        return "full"
    if kind == "rotating":
        return f"rotating:budget={value}"
    return value.to_string()  # a KVCacheConfig or a CompressOnceSpec


def make_caches(model, spec: Any) -> List[Any]:
    """Fresh caches for one run of ``model`` under ``spec``."""
    kind, value = parse_spec(spec)
    if kind == "full":
        return [KVCache() for _ in model.layers]
    if kind == "rotating":
        return [RotatingKVCache(max_size=value, keep=4) for _ in model.layers]
    if kind == "compress-once":
        raise ConfigError(
            f"{value.to_string()}: a compress-once method scores a whole context before it keeps anything, so it "
            "has no streaming caches; run it with the long-context suite (--task ruler) or kvpolicy cache-prompt"
        )
    return KVCacheBuilder.for_model(model, value)


def _per_token_bytes(keys: mx.array, values: mx.array) -> int:
    B, H, _, D = keys.shape
    return B * H * (D * keys.itemsize + values.shape[-1] * values.itemsize)


def kv_bytes(caches: Sequence[Any]) -> Tuple[int, int]:
    """(bytes of K/V tokens kept, bytes a full cache would hold) summed over layers, true dtypes."""
    kept = full = 0
    for c in caches:
        if isinstance(c, PolicyCache):
            kept += c.kept_bytes
            full += c.full_seq_bytes
        elif getattr(c, "keys", None) is not None:
            per = _per_token_bytes(c.keys, c.values)
            n = min(c.offset, c.max_size) if isinstance(c, RotatingKVCache) else c.offset
            kept += n * per
            full += c.offset * per
    return kept, full


def perplexity(
    model, ids: Sequence[int], spec: Any, chunk: int = 1, progress: bool = True, desc: Optional[str] = None
) -> Dict[str, Any]:
    """Feed ``ids`` ``chunk`` tokens at a time through fresh caches; NLL of every next token.

    Each token's NLL is read from the logits of the step that fed its predecessor, i.e.
    before the cache is reduced for the next step. ``chunk=1`` is the StreamingLLM
    recipe; larger chunks are faster (prefill-style) and reported separately. With ``chunk > 1`` every chunk
    is a short prompt: each policy cache is settled after it (:meth:`~kvpolicy_core.cache.policy_cache.PolicyCache.
    settle`), so a method that cuts at the prompt's end (``when="prompt_end"``) cuts every chunk to its budget with
    that chunk's last queries in view, and the next chunk attends to what the cut kept.
    """
    caches = make_caches(model, spec)
    tokens = mx.array(list(ids), dtype=mx.int32)
    T = tokens.shape[0]
    if T < 2:
        raise ValueError("perplexity needs at least 2 tokens")
    nll = np.zeros(T - 1, dtype=np.float64)
    bar = None
    if progress:
        from tqdm.auto import tqdm

        # disable=None: no bar where stderr is not a terminal (a log gets no bar flood)
        bar = tqdm(total=T - 1, desc=desc or spec_label(spec), unit="tok", leave=False, disable=None)
    mx.reset_peak_memory()
    start = time.perf_counter()
    for i in range(0, T - 1, chunk):
        j = min(i + chunk, T - 1)
        logits = model(tokens[None, i:j], cache=caches)[0].astype(mx.float32)
        logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        step = -mx.take_along_axis(logp, tokens[i + 1 : j + 1, None], axis=-1)[:, 0]
        nll[i:j] = np.array(step)
        if chunk > 1:
            for c in caches:
                if isinstance(c, PolicyCache):
                    c.settle()
        if bar is not None:
            bar.update(j - i)
    seconds = time.perf_counter() - start
    if bar is not None:
        bar.close()
    kept, full = kv_bytes(caches)
    mean = float(nll.mean())
    merged = merges_per_eviction(caches)
    return {
        "spec": spec_label(spec),
        "tokens": T,
        "chunk": chunk,
        "nll": nll,
        "perplexity": math.exp(mean),
        "mean_nll": mean,
        "seconds": seconds,
        "tokens_per_s": (T - 1) / seconds,
        "kv_bytes_kept": kept,
        "kv_bytes_full": full,
        "peak_memory": int(mx.get_peak_memory()),  # MLX's allocator, model included, this run's
        "active_memory": int(mx.get_active_memory()),  # resident after the run: the model and the caches held
        "nan": bool(np.isnan(nll).any()),
        **({} if merged is None else {"merges_per_eviction": merged}),
    }


def merges_per_eviction(caches: Sequence[Any]) -> Optional[float]:
    """Merged losers over evicted (token, KV head) pairs, summed over the layers whose caches count merges
    (CaM's), or None where none does or nothing was evicted."""
    merged = evicted = 0
    for c in caches:
        if isinstance(c, PolicyCache) and "merges" in c.stats():
            merged += int(c.merges)
            B, H = c._slots.shape()[:2]  # the rows' batch and KV heads (quantized rows are tuples)
            evicted += max(c.offset - c.n, 0) * B * H  # a pending eviction: not yet
    return merged / evicted if evicted else None


def paired_ratio(
    nll_a: Sequence[float],
    nll_b: Sequence[float],
    block: int = 32,
    n_boot: int = 2000,
    seed: int = 0,
    level: float = 0.95,
) -> Dict[str, float]:
    """Perplexity ratio of method A to method B on the same tokens, with a paired block-bootstrap interval.

    ``nll_a``, ``nll_b``: [T] per-token NLLs of the same T tokens. With ``d_t = nll_a[t] - nll_b[t]``::

        ratio = ppl_A / ppl_B = exp(mean_t d_t)

    The interval resamples ``ceil(T / block)`` contiguous blocks of ``d`` (circular, with replacement: NLLs
    of neighbouring tokens are correlated, so tokens are not independent samples) ``n_boot`` times and
    takes the ``(1 - level) / 2`` and ``(1 + level) / 2`` quantiles of ``exp(mean d*)``. Both methods see
    the same text, so what the text makes hard cancels; the interval is the noise of this comparison on
    this text (another text is another sample, not covered by it: see :func:`pooled_ratio`). Returns
    ratio, low, high, and ``p_worse``: the share of resamples with ratio > 1 (A worse than B).

    Needs finite NLLs and at least two blocks per text (ValueError otherwise). The interval is approximate,
    not exact: its coverage falls short of ``level`` with few blocks or with correlations that outlast a block.
    """
    return pooled_ratio([(nll_a, nll_b)], block, n_boot, seed, level)


def pooled_ratio(
    pairs: Sequence[Tuple[Sequence[float], Sequence[float]]],
    block: int = 32,
    n_boot: int = 2000,
    seed: int = 0,
    level: float = 0.95,
) -> Dict[str, float]:
    """:func:`paired_ratio` over several texts (or models) at once: ``pairs`` = [(nll_a, nll_b)] of K
    sequences of T_k tokens each, ``d_k = nll_a - nll_b``::

        ratio = exp(sum_k sum_t d_k[t] / sum_k T_k)

    (the token-weighted geometric mean of the K ratios). Each resample draws ``ceil(T_k / block)`` circular
    blocks within each sequence (a stratified block bootstrap: blocks never straddle two texts).
    """
    if int(block) < 1 or int(n_boot) < 1:
        raise ValueError(f"block and n_boot must be >= 1 (got block={block}, n_boot={n_boot})")
    ds = []
    for a, b in pairs:
        a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
        if a.ndim != 1 or a.shape != b.shape or a.size == 0:
            raise ValueError(f"paired_ratio needs two equal-length 1-D NLL sequences (got {a.shape}, {b.shape})")
        if not (np.isfinite(a).all() and np.isfinite(b).all()):
            raise ValueError(
                "paired_ratio needs finite NLLs (a NaN or inf would make the ratio and its interval "
                "meaningless); drop or fix the run that produced them"
            )
        if a.size < 2 * int(block):
            raise ValueError(
                f"paired_ratio needs at least two blocks of tokens per text ({a.size} tokens, block "
                f"{int(block)}): with one block every resample is the same, and the interval would be "
                "a point"
            )
        ds.append(a - b)
    if not ds:
        raise ValueError("pooled_ratio needs at least one (nll_a, nll_b) pair")
    rng = np.random.default_rng(seed)
    total, sums, bl, n_all = sum(d.size for d in ds), np.zeros(n_boot), int(block), 0
    for d in ds:
        T = d.size
        n_blocks = -(-T // bl)
        n_all += n_blocks
        starts = rng.integers(0, T, size=(n_boot, n_blocks))
        idx = (starts[..., None] + np.arange(bl)) % T  # [n_boot, n_blocks, bl] circular blocks
        sums += d[idx].reshape(n_boot, -1)[:, :T].sum(axis=1)
    means = sums / total
    lo, hi = np.quantile(np.exp(means), [(1 - level) / 2, (1 + level) / 2])
    mean = sum(d.sum() for d in ds) / total
    return {
        "ratio": float(np.exp(mean)),
        "low": float(lo),
        "high": float(hi),
        "p_worse": float((means > 0).mean()),
        "tokens": int(total),
        "block": bl,
        "blocks": n_all,
        "texts": len(ds),
    }
