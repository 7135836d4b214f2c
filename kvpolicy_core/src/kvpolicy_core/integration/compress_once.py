"""Compress once: a whole context prefilled, scored by reconstruction (KVzip), cut to the method's budget at once.

Streaming methods evict after every prefill chunk, before later text exists. Here the context ``x`` (``L``
tokens) is first prefilled into full caches (mlx-lm's ``KVCache``, chunked as ``generate_step`` chunks a
prompt), every context token is scored per (layer, KV head) by :mod:`.reconstruction` (KVzip, arXiv 2505.23416),
and each layer's policy cache is loaded with the kept tokens::

    key^{(l)}[h, j] = +inf for j < n_sink (sinks), -inf for j outside a window layer's next window, else
                      pool_P(score^{(l)}[h])_j
    keep^{(l)}[h]   = the b_l positions j < L of largest key^{(l)}[h, j] (ties: earlier first)

``pool_P`` is the max over the ``P`` nearest positions (:func:`~kvpolicy_core.parts.pooling.pool_by_position`;
``P`` the method's ``pool`` where given, else 3: :func:`cut_pool`), so a span is kept or lost as a whole. The layer
budgets ``b_l``: ``kvzip`` ranks every layer's keys together (KVzip's rule, :func:`model_budgets`): the model
keeps about ``n_layers · budget`` tokens per head in all, and a layer whose tokens rank high keeps more (a
sliding-window layer never more than its live window: :func:`live_budgets`); ``kvzip-layerwise`` keeps
``b_l = budget`` in every layer.

Each head of layer l holds ``min(b_l, live_l)`` tokens (``b_l`` its cache's budget; ``live_l`` the positions
its next query can see: the whole context in a global layer, the window less one in a sliding-window layer, whose
earlier positions are not loaded; keys, values, absolute positions ``keep`` in
temporal order, scores ``score[keep]`` float32) and ``offset = L``, so the next token continues at position ``L``
exactly as after a full prefill (mlx-lm rotates queries by ``cache.offset``). From then on the cache runs its
method as usual: the scorer adds to the kept tokens' scores and the disposition handles later evictions. The one-
shot cut drops the losers (KVzip's rule) for every method; CaM merges from its next eviction on. The spec's
``recent`` window is not protected at the cut (it protects the newest tokens of later evictions).

Cost: one prefill as mlx-lm's own (a sliding-window layer holds and attends its window only) plus the
reconstruction, which attends the whole context in global layers and the window in the others; both by blocks of
rows, one block per CPU core (:func:`~.reconstruction.row_streams`). ``benchmarks/compress_once_cost.py`` measures
the total against mlx-lm's plain prefill side by side (docs/methods/compress-once.md). Memory: the
global layers' full context K/V are held until the cut, unlike a streaming method, which never holds more than
budget + one chunk.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, List, Sequence, Tuple

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import RotatingKVCache

from ..attention import hook as attention
from ..cache.policy_cache import PolicyCache
from ..config.parse import parse_config
from ..errors import ConfigError
from ..parts.pooling import pool_by_position
from ..runtime.progress import reporter
from .builder import KVCacheBuilder, native_caches
from .reconstruction import (
    Context,
    PrefillCache,
    WindowPrefillCache,
    reconstruction_scores,
    repeat_chunks,
    window_scores,
)
from .token_ids import check_model_token_ids

#: the compress-once scorers: ``kvzip`` shares the kept tokens out over the layers by one ranking (KVzip's rule),
#: ``kvzip-layerwise`` keeps ``budget`` per layer (kvpress's ``layerwise=True``)
SCORERS = ("kvzip", "kvzip-layerwise")
#: how the reconstruction weights are normalised (:mod:`.reconstruction`): over every key ("context") or over
#: the sinks, the chunk's own span and the repeat tokens ("chunk", kvpress's)
NORMALISATIONS = ("context", "chunk")
#: KVzip's repeat prompts (kvpress's wording)
FIRST_PROMPT = "\n\nRepeat the previous context exactly."
LATER_PROMPT = "\n\nRepeat the part of the previous context exactly, starting with"


@dataclass(frozen=True)
class RepeatPrompt:
    """Token ids of the reconstruction prompts: ``first`` before chunk 0, ``later`` (then the previous chunk's
    last ``tail`` tokens) before each later chunk, ``suffix`` (the assistant turn's opening) before the chunk."""

    first: Tuple[int, ...] = ()
    later: Tuple[int, ...] = ()
    suffix: Tuple[int, ...] = ()
    tail: int = 8


def repeat_prompt(tokenizer) -> RepeatPrompt:
    """KVzip's repeat prompts tokenized for ``tokenizer``; with a chat template, the user turn that holds the
    context is closed and an assistant turn opened before the repeated text (as kvpress does)."""
    suffix = "\n"
    if getattr(tokenizer, "has_chat_template", False):
        marker = "<kvpolicy-repeat>"
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": marker}], add_generation_prompt=True, tokenize=False
        )
        suffix = text[text.index(marker) + len(marker) :]

    def enc(s: str) -> Tuple[int, ...]:
        return tuple(tokenizer.encode(s, add_special_tokens=False))

    return RepeatPrompt(first=enc(FIRST_PROMPT), later=enc(LATER_PROMPT), suffix=enc(suffix))


@dataclass
class Compressed:
    """What :func:`compress_context` made: the caches, and the scores and kept positions per layer (host copies)."""

    caches: List[Any]
    scores: List[np.ndarray] = field(default_factory=list)  # [B, H, L] float32 per layer (pooled as cut)
    kept: List[np.ndarray] = field(default_factory=list)  # [B, H, budget] int32 per layer


def prefill_full(model, ids: Sequence[int], prefill_step: int, extra: int = 0) -> List[Context]:
    """``ids`` (L tokens) through the model's own caches, chunked as ``generate_step`` does (chunks of
    ``prefill_step`` over all but the last token, then the last token alone): one :class:`~.reconstruction.Context`
    per layer. A global layer holds all L keys (mlx-lm's ``KVCache``: :class:`~.reconstruction.PrefillCache`);
    a sliding-window layer (the model makes it a
    ``RotatingKVCache(w)``) attends as that cache does and holds the last ``w + extra`` keys
    (:class:`~.reconstruction.WindowPrefillCache`): what the cut can keep (positions above ``L - w``) and what
    ``extra`` more queries at the end need (the observation window's). Each chunk's attention is computed by blocks
    of rows over the keys each block sees (:func:`~.reconstruction.blocked_attention`), so this prefill costs less
    than mlx-lm's, whose CPU kernel computes every masked logit."""
    windows = [n.max_size if type(n) is RotatingKVCache else None for n in native_caches(model)]
    caches = [PrefillCache() if w is None else WindowPrefillCache(w, w + extra) for w in windows]
    ids = list(ids)
    done = 0
    progress = reporter("prefill")
    progress(0, len(ids))
    hook = attention.install(model)  # the caches compute their chunks' attention by blocks (blocked_attention)
    try:
        while len(ids) - done > 1:
            n = min(prefill_step, len(ids) - done - 1)
            model(mx.array(ids[done : done + n], dtype=mx.uint32)[None], cache=caches)
            mx.eval([c.state for c in caches])
            done += n
            progress(done, len(ids))
        model(mx.array(ids[done:], dtype=mx.uint32)[None], cache=caches)
        mx.eval([c.state for c in caches])
    finally:
        hook.remove()
    progress(len(ids), len(ids))
    return [c.context() for c in caches]


def selection_keys(score: np.ndarray, n_sink: int, window, start: int = 0) -> np.ndarray:
    """The ranking of the module docstring: ``score`` [B, H, L] with sinks +inf, window-dead positions -inf (and
    positions before ``start``, which the layer's prefilled context no longer holds)."""
    key = score.astype(np.float64).copy()
    L = score.shape[-1]
    key[..., : min(n_sink, L)] = np.inf
    if window is not None:
        key[..., : max(0, L - window + 1)] = -np.inf  # the query at L sees positions > L - window
    key[..., :start] = -np.inf
    return key


#: the cut's pool width when the method's ``pool`` is not given: narrower than the streaming scorer's 15, since
#: each kept token brings its pool's neighbours and a small budget then holds too few spans
#: (``benchmarks/compress_once_cuts.py``)
CUT_POOL = 3


def cut_pool(config) -> int:
    """The pool width of the cut: the method's ``pool`` where given, else :data:`CUT_POOL`."""
    pool = getattr(config.policy, "pool", None)
    return CUT_POOL if pool is None else int(pool)


def pooled_scores(score: np.ndarray, P: int) -> np.ndarray:
    """``score`` [B, H, L] (positions 0 .. L - 1) max-pooled over the ``P`` nearest positions."""
    if P <= 1:
        return score
    positions = mx.broadcast_to(mx.arange(score.shape[-1], dtype=mx.int32), score.shape)
    return np.array(pool_by_position(mx.array(score), positions, P))


def cut_window(config, L: int) -> int:
    """The observation window of the cut: the method's ``obs_window`` where given (at most ``L - 1`` queries), else
    0, none. Raises :class:`ConfigError` for ``obs_window=0`` (every query: a streaming setting only)."""
    W = getattr(config.policy, "obs_window", None)
    if W is None:
        return 0
    if W == 0:
        raise ConfigError(
            "obs_window: a compress-once cut adds the attention of the context's last obs_window queries; "
            "obs_window=0 (every query) applies to streaming methods only: give obs_window >= 1 or leave it unset"
        )
    return min(int(W), L - 1)


def min_budget(config) -> int:
    """The smallest budget ``config``'s method accepts: its sinks, its recent window when given, one more."""
    return config.policy.n_sink + (config.policy.recent or 0) + 1


def model_budgets(keys: Sequence[np.ndarray], budget: int, floor: int, L: int, share: float = 0.0) -> List[int]:
    """Per-layer budgets from one ranking over every layer's keys ``[B, H, L]`` (KVzip's allocation)::

        f_l    = min(round(share · budget), live_l)       (live_l: a head's positions above -inf; L if global)
        key'_l = +inf on each head's f_l largest keys of layer l, else key_l
        T      = the n_layers · B · H · budget largest key' over all layers, heads and positions (ties: earlier
                 layer, head, position first)
        b_l    = max( floor, min(round(#(T in layer l) / (B · H_l)), live_l) )

    so a layer whose tokens rank high (a global layer; a window layer's dead positions rank -inf) keeps more, and
    the model keeps about ``n_layers · budget`` tokens per head in total, a sliding-window layer never more than its
    live window (:func:`live_budgets`; the floor, the method's smallest budget, wins over it). ``share = 0`` is
    KVzip's rule; ``share`` in (0, 1] first guarantees every layer ``share · budget`` of its own best tokens (its
    live window at most) and ranks the rest."""
    if share:
        guarded = []
        for k in keys:
            f = min(round(share * budget), int((k > -np.inf).sum(-1).min()))
            top = np.argsort(-k, axis=-1, kind="stable")[..., :f]
            g = k.copy()
            np.put_along_axis(g, top, np.inf, axis=-1)
            guarded.append(g)
        keys = guarded
    flat = np.concatenate([k.reshape(-1) for k in keys])
    total = min(flat.size, sum(budget * k.shape[0] * k.shape[1] for k in keys))
    top = np.argsort(-flat, kind="stable")[:total]
    starts = np.cumsum([0] + [k.size for k in keys])
    counts = np.bincount(np.searchsorted(starts, top, side="right") - 1, minlength=len(keys))
    return live_budgets([round(int(n) / (k.shape[0] * k.shape[1])) for n, k in zip(counts, keys)], keys, floor)


def live_budgets(budgets: Sequence[int], keys: Sequence[np.ndarray], floor: int) -> List[int]:
    """Each layer's budget capped at its live positions (a head's keys above -inf, the fewest over heads: a window
    layer's window less one, the next token's own slot; a global layer's whole context), but never below ``floor``
    (the method's smallest budget): a cut keeps no token its layer's next query cannot see."""
    return [int(max(floor, min(b, live_count(k)))) for b, k in zip(budgets, keys)]


def live_count(key: np.ndarray) -> int:
    """The positions every head of a layer can still use: keys above -inf (the fewest over heads)."""
    return int((key > -np.inf).sum(-1).min())


def kept_positions(key: np.ndarray, budget: int) -> np.ndarray:
    """int32 [B, H, budget]: per head the ``budget`` largest keys (ties: earlier position), in temporal order."""
    order = np.argsort(-key, axis=-1, kind="stable")[..., :budget]
    return np.sort(order, axis=-1).astype(np.int32)


def load_kept(cache: PolicyCache, context: Context, positions: np.ndarray, scores: np.ndarray):
    """Load the kept tokens (absolute ``positions`` [B, H, b], all held by ``context``) into an empty policy cache
    through its public ``state`` (checked on restore), at ``offset = L``."""
    if positions.size and int(positions.min()) < context.start:
        raise ValueError(f"load_kept: position {int(positions.min())} is before the context's start {context.start}")
    idx = mx.array(positions)
    at = mx.array(positions - context.start)[..., None]
    meta = json.loads(cache.meta_state[0])
    meta["offset"] = int(context.length)
    rows = cache.storage  # the kept rows stored as the cache stores them (quantized with kv_bits)
    cache.state = (
        rows.encode(mx.take_along_axis(context.keys, at, axis=2)),
        rows.encode(mx.take_along_axis(context.values, at, axis=2)),
        idx,
        mx.array(np.take_along_axis(scores, positions, axis=-1).astype(np.float32)),
        json.dumps(meta),
    )


def compress_context(
    model,
    context_ids: Sequence[int],
    spec: Any,
    *,
    scorer: str = "kvzip",
    prefill_step: int = 2048,
    repeat: RepeatPrompt = RepeatPrompt(),
    chunk: int = 2048,
    normalise: str = "context",
) -> Compressed:
    """Prefill ``context_ids`` (L tokens), score them by reconstruction, and build ``spec``'s policy caches
    holding ``budget`` tokens per head with ``offset = L`` (module docstring). ``repeat``: the reconstruction
    prompts (:func:`repeat_prompt` for a tokenizer; by default none: the chunk is replayed as it is).

    Raises :class:`~kvpolicy_core.errors.ConfigError` for an unknown scorer, a budget not below the context
    length, a bad ``prefill_step``/``chunk``, or a model whose caches would not all be policy caches."""
    if scorer not in SCORERS:
        raise ConfigError(f"compress-once scorer must be one of {', '.join(SCORERS)} (got {scorer!r})")
    if normalise not in NORMALISATIONS:
        raise ConfigError(
            f"compress-once normalise must be one of {', '.join(map(repr, NORMALISATIONS))} (got {normalise!r})"
        )
    for name, v in (("prefill_step", prefill_step), ("chunk", chunk)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(f"compress-once {name} must be an int >= 1 (got {v!r})")
    config = parse_config(spec)
    budget, n_sink = config.policy.budget, config.policy.n_sink
    ids = [int(t) for t in context_ids]
    check_model_token_ids(model, ids, "compress_context: context_ids")  # an id past the embedding: out-of-bounds read
    L = len(ids)
    if budget >= L:
        raise ConfigError(
            f"budget: compress-once keeps budget tokens of the context, so budget must be below the context "
            f"length (got budget={budget} for {L} tokens); use the full cache for a context this short"
        )
    caches = KVCacheBuilder.for_model(model, config)
    natives = [i for i, c in enumerate(caches) if not isinstance(c, PolicyCache)]
    if natives:
        raise ConfigError(
            f"layers: compress-once builds a policy cache for every layer, but layers={config.layers!r} leaves "
            f"layer(s) {natives[:4]} native; use layers=all"
        )
    contexts, scores = score_context(
        model,
        ids,
        n_sink,
        prefill_step=prefill_step,
        repeat=repeat,
        chunk=chunk,
        normalise=normalise,
        window=cut_window(config, L),
    )
    out = cut(model, config, contexts, scores, L, layerwise=scorer == "kvzip-layerwise")
    del contexts
    mx.eval([c.state for c in out.caches])
    return out


def score_context(
    model,
    ids: Sequence[int],
    n_sink: int,
    *,
    prefill_step: int,
    repeat: RepeatPrompt,
    chunk: int,
    normalise: str,
    window: int = 0,
) -> Tuple[List[Tuple[mx.array, mx.array]], List[np.ndarray]]:
    """The budget-free half of :func:`compress_context` (arguments checked there): the full prefill's K/V
    ``[B, H, L, D]`` per layer and the scores ``[B, H, L]`` per layer, so that one scoring can be :func:`cut` to
    several budgets. With ``window = W >= 1`` a score is ``max(score, win)``, ``win`` the attention of the context's
    last W queries (:func:`~.reconstruction.window_scores`)."""
    L = len(ids)
    contexts = prefill_full(model, ids, prefill_step, extra=window)
    chunks = repeat_chunks(ids, repeat.first, repeat.later, repeat.suffix, chunk, repeat.tail)
    spans = [(a, min(a + chunk, L)) for a in range(0, L, chunk)] if normalise == "chunk" else None
    progress = reporter("reconstruction")
    scores = reconstruction_scores(
        model, contexts, chunks, spans, n_sink, progress=lambda i, _: progress(min(L, i * chunk), L)
    )
    if window:
        scores = [mx.maximum(s, w) for s, w in zip(scores, window_scores(model, contexts, ids, window))]
    return contexts, [np.array(s) for s in scores]


def cut(
    model, config, contexts, scores: Sequence[np.ndarray], L: int, layerwise: bool = False, share: float = 0.0
) -> Compressed:
    """``config``'s policy caches for ``model`` loaded with the cut of the reconstruction ``scores`` [B, H, L] per
    layer (module docstring): pooled, ranked, layer budgets from one ranking with each layer's best ``share ·
    budget`` first (:func:`model_budgets`; ``layerwise``: ``budget`` each)."""
    budget, n_sink = config.policy.budget, config.policy.n_sink
    P = cut_pool(config)
    scores = [pooled_scores(s, P) for s in scores]
    keys = [selection_keys(s, n_sink, x.window, x.start) for s, x in zip(scores, contexts)]
    budgets = [budget] * len(keys) if layerwise else model_budgets(keys, budget, min_budget(config), L, share)
    out = Compressed(KVCacheBuilder.for_model(model, config, budgets=budgets))  # the cut's budgets, not allocation's
    for cache, context, s, key, b in zip(out.caches, contexts, scores, keys, budgets):
        kept = kept_positions(key, min(b, live_count(key)))  # a window layer's dead positions are not loaded
        load_kept(cache, context, kept, s)
        out.scores.append(s)
        out.kept.append(kept)
    hold_hook(model, out.caches)  # layers holding different numbers of tokens (a window layer its window) need it
    return out


def hold_hook(model, caches: Sequence[Any]) -> None:
    """Let ``caches`` hold kvpolicy's attention hook when their layers keep different numbers of tokens.

    mlx-lm builds one attention mask per step from the first layer's cache and hands it to every layer. A single
    sequence's policy cache gives a ``"causal"`` mask, right for any number of keys; a batch of them gives the first
    layer's padded mask, which another layer's rows (another budget: a compress-once cut) do not fit. The hook lets
    each layer's batch build its own (:meth:`~kvpolicy_core.cache.batch.BatchPolicyCache.before_attention`), so
    caches with per-layer budgets hold the hook, and with them every copy made for a request (as the caches that
    need the hook for their own method do). Idempotent; a layer that already holds the hook keeps it."""
    policy = [c for c in caches if isinstance(c, PolicyCache)]
    if len({(c.budget, c.tokens_kept) for c in policy}) <= 1:
        return
    held = next((c.attention_hook for c in policy if c.attention_hook is not None and c.attention_hook.active), None)
    hook = held or attention.install(model)
    for c in policy:
        if c.attention_hook is None or not c.attention_hook.active:
            c.attention_hook = hook


@dataclass(frozen=True)
class CompressOnceSpec:
    """A method run compress-once: ``scorer`` (``"kvzip"``) cuts the context to ``config``'s budget at once."""

    scorer: str
    config: Any  # a KVCacheConfig

    def to_string(self) -> str:
        return f"{self.scorer}+{self.config.to_string()}"


def split_spec(spec: Any):
    """``"kvzip+h2o:budget=1024"`` (or a :class:`CompressOnceSpec`) -> ``CompressOnceSpec("kvzip", config)``;
    any other spec -> None.

    Raises :class:`ConfigError` for an unknown scorer before the ``+`` or a bad method after it."""
    if isinstance(spec, CompressOnceSpec):
        return spec
    if not isinstance(spec, str) or "+" not in spec.partition(":")[0]:
        return None
    scorer, _, rest = spec.strip().partition("+")
    if scorer not in SCORERS:
        raise ConfigError(
            f"compress-once scorer must be one of {', '.join(SCORERS)} (got {scorer!r} in {spec!r}; "
            "a compress-once method is written SCORER+METHOD, e.g. kvzip+h2o:budget=1024)"
        )
    return CompressOnceSpec(scorer, parse_config(rest))
