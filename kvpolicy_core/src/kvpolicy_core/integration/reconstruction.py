"""KVzip's context-reconstruction score: how much each context key is attended while the model repeats the context.

After the context (``L`` tokens) is prefilled into full caches, the model is fed, chunk by chunk, a repeat
prompt followed by the context chunk again. Chunk ``c`` is the token sequence ``r_c = prompt_c ++ suffix ++
x[a_c:b_c]`` (``R_c`` tokens, positions ``L .. L + R_c - 1``); its queries attend causally over the whole
context plus ``r_c`` so far (nothing of an earlier chunk: the reconstruction tokens are never kept). With
``w^{(l,c)}`` the model's own attention weights of layer ``l`` in chunk ``c``::

    w^{(l,c)}[h, g, t, j] = softmax_j(scale * q_{h,g,t} . k_{h,j} + mask[t, j])     [H, G, R_c, L + R_c]
    score^{(l)}[h, j]     = max_c max_g max_t w^{(l,c)}[h, g, t, j],   j < L          [H, L]

With the chunk's context span ``[a_c, b_c)`` given (kvpress's normalisation, ``spans``), each chunk scores only
its own span, and its weights are renormalised over the sinks, that span and the repeat tokens::

    K_c                      = [0, min(n_sink, a_c)) ∪ [a_c, b_c) ∪ [L, L + R_c)
    wbar^{(l,c)}[h, g, t, j] = w[h, g, t, j] / sum_{j' in K_c} w[h, g, t, j']
    score^{(l)}[h, j]        = max_g max_t wbar^{(l,c)}[h, g, t, j]              for a_c <= j < b_c

(``H`` KV heads, ``G`` query heads per KV head). The mask is the layer's own: causal for global layers, causal
within the sliding window for window layers (the model asks the cache for it, as during the prefill). The
softmax runs over every key the query really attends (the full context and the repeat tokens so far), which is
the model's attention; kvpress's implementation normalises over the sinks, the chunk's own context span and the
repeat tokens only.

A sliding-window layer (window ``w``) attends only its last ``w - 1`` positions: its reconstruction queries (at
``L`` and after) give every earlier key weight 0, so its :class:`Context` holds the last keys alone
(:class:`WindowPrefillCache`) and the pass attends those, as mlx-lm's ``RotatingKVCache`` would: the weights are
the same, at a fraction of the cost (Gemma 3: 15 of 18 layers).
"""

from __future__ import annotations

import os
from typing import Callable, List, NamedTuple, Optional, Sequence

import mlx.core as mx
from mlx_lm.models.cache import KVCache, create_attention_mask

from ..attention import hook as attention
from ..attention.weights import attention_with_weights


class Context(NamedTuple):
    """One layer's prefilled context: the keys and values of positions ``start .. L - 1`` (``L`` the context's
    length). A global layer holds the whole context (``start = 0``); a sliding-window layer holds only the last
    keys its later queries can see (:class:`WindowPrefillCache`), so the passes below attend those alone."""

    keys: mx.array  #: [B, H, L - start, D]
    values: mx.array  #: [B, H, L - start, Dv]
    start: int = 0
    window: Optional[int] = None  #: a sliding-window layer's window (its queries see the last ``window`` positions)

    @property
    def length(self) -> int:
        """``L``: the context's length (the absolute position after its last token)."""
        return self.start + self.keys.shape[2]


def blocked_attention(queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask, fused, window=None):
    """The model's attention of S queries (the last S of T positions) over T keys [B, H, T, D] -> [B, Hq, S, Dv],
    by the model's own kernel ``fused`` (mlx-lm's ``scaled_dot_product_attention``) on blocks of :data:`ROWS`
    query rows, each over the keys it can see only: up to its last row (causal) and, in a sliding-window layer,
    from ``window - 1`` before its first row. The keys left out have weight 0 under the mask, so this is the one
    call's attention up to float rounding, at the cost of the unmasked part alone (a prefill chunk over its own
    keys: about half; MLX's CPU kernel computes every masked logit)."""
    S, T = queries.shape[2], keys.shape[2]
    if mask is None or S <= ROWS:
        return fused(queries, keys, values, None, scale, mask)
    outs = []
    streams = row_streams()
    for i, r0 in enumerate(range(0, S, ROWS)):
        r1 = min(S, r0 + ROWS)
        lo, hi = 0 if window is None else max(0, T - S + r0 - window + 1), T - S + r1
        with mx.stream(streams[i % len(streams)]):
            m = _rows(mask, r0, r1, S, T)[..., lo:hi]
            outs.append(fused(queries[:, :, r0:r1], keys[..., lo:hi, :], values[..., lo:hi, :], None, scale, m))
    return mx.concatenate(outs, axis=2)


#: query rows per block of :func:`blocked_attention` (and of the reconstruction's weights)
ROWS = 256
#: at most this many CPU streams for row blocks (:func:`row_streams`)
MAX_STREAMS = 4
_streams: dict = {}


def row_streams() -> list:
    """The streams that independent row blocks alternate over: on the CPU one per core this process may use (at most
    :data:`MAX_STREAMS`), since MLX's CPU backend runs each stream's ops in order on one thread and its element-wise
    ops (the softmax's ``exp``: most of a block's time at these shapes) on that thread alone, so blocks on two
    streams take two cores (measured: ``benchmarks/compress_once_cost.py``, docs/methods/compress-once.md). On a GPU,
    the default stream alone (one device queue). The results are the same on every stream: only where they run
    changes."""
    device = mx.default_device()
    if device not in _streams:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        n = min(MAX_STREAMS, cores) if device == mx.cpu else 1
        _streams[device] = [mx.default_stream(device)] + [mx.new_stream(device) for _ in range(n - 1)]
    return _streams[device]


class PrefillCache(KVCache):
    """A global layer's cache for a one-shot prefill: mlx-lm's ``KVCache``, its chunks' attention computed by
    :func:`blocked_attention` (routed here by kvpolicy's attention hook)."""

    kvpolicy_attention = "single"

    def attend(self, queries, keys, values, scale, mask, fused):
        return blocked_attention(queries, keys, values, scale, mask, fused)

    def before_attention(self, queries, scale, mask):  # the hook's batch route (not taken: "single")
        return mask

    def context(self) -> Context:
        return Context(self.keys[..., : self.offset, :], self.values[..., : self.offset, :])


class WindowPrefillCache:
    """A sliding-window layer's cache for a one-shot prefill: it attends as mlx-lm's ``RotatingKVCache`` does
    (the held keys plus the chunk, under the model's window mask; by :func:`blocked_attention`) and keeps the last
    ``keep`` keys and values in temporal order (positions ``offset - held .. offset - 1``), which :meth:`context`
    hands on. ``offset`` is the absolute position (mlx-lm rotates queries by it)."""

    kvpolicy_attention = "single"

    def __init__(self, window: int, keep: int) -> None:
        self.window, self.keep = window, keep
        self.keys = self.values = None  # [B, H, held, D], [B, H, held, Dv]
        self.offset = 0

    @property
    def held(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        """keys [B, H, S, D] -> the held keys and the chunk's [B, H, held + S, D]; then only the last ``keep`` stay."""
        self.offset += keys.shape[2]
        if self.keys is not None:
            keys, values = mx.concatenate([self.keys, keys], axis=2), mx.concatenate([self.values, values], axis=2)
        self.keys, self.values = keys[..., -self.keep :, :], values[..., -self.keep :, :]
        return keys, values

    def make_mask(self, N: int, window_size: Optional[int] = None, return_array: bool = False):
        """The mask of N queries over the ``held + N`` keys (relative positions are what the window masks)."""
        return create_attention_mask(N, self.held, return_array, window_size)

    @property
    def state(self):
        return self.keys, self.values

    def attend(self, queries, keys, values, scale, mask, fused):
        return blocked_attention(queries, keys, values, scale, mask, fused, self.window)

    def before_attention(self, queries, scale, mask):  # the hook's batch route (not taken: "single")
        return mask

    def context(self) -> Context:
        return Context(self.keys, self.values, self.offset - self.held, self.window)


class ReconstructionCache:
    """One layer's cache during the reconstruction pass: the prefilled context (kept as is) plus the chunk being fed.

    ``update_and_fetch(k, v)`` returns ``[context ++ k]`` and stores nothing; the attention hook routes the
    layer's attention here (:meth:`attend`), which computes it with its weights and keeps the running maximum
    over query heads and query positions of the weights each context key receives (``score`` [B, H, L] float32,
    0 before the context's ``start``; with ``own``, the one chunk fed scores its own keys too: [B, H, L + S]).
    Only the held keys are attended: a sliding-window layer's context holds the last keys its window can see.
    """

    kvpolicy_attention = "single"  #: the attention hook calls :meth:`attend` for this cache
    rows = ROWS  #: query rows whose attention weights are computed at once

    def __init__(self, context: Context, n_sink: int = 0, own: bool = False) -> None:
        self.context_keys, self.context_values, self.start, self.window = context  # [B, H, n, D], [B, H, n, Dv]
        self.held = self.context_keys.shape[2]  # n = L - start
        self.offset = context.length  # L: the reconstruction tokens' positions start after the context
        self.score = mx.zeros((*self.context_keys.shape[:2], self.offset), dtype=mx.float32)
        self.n_sink = n_sink
        self.span = None  #: (a, b): the context span of the chunk being fed (kvpress's normalisation), or None
        self.whole = None  #: with a span, the whole-context score alongside when set to zeros [B, H, L] (compare)
        #: the score also covers the fed chunk's own keys ([B, H, L + S]; one chunk fed: :func:`window_scores`)
        self.own = own

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        """keys [B, H, S, D] of the chunk -> the held context's and the chunk's keys and values [B, H, n + S, D]."""
        return (
            mx.concatenate([self.context_keys, keys], axis=2),
            mx.concatenate([self.context_values, values], axis=2),
        )

    def make_mask(self, N: int, window_size: Optional[int] = None, return_array: bool = False):
        """The mask of N chunk queries over the ``n + N`` held keys, as mlx-lm's ``KVCache`` makes it."""
        return create_attention_mask(N, self.held, return_array, window_size)

    def _local(self, a: int, b: int):
        """The held keys' slice of absolute positions ``[a, b)`` (empty where the window dropped them)."""
        return slice(min(self.held, max(0, a - self.start)), min(self.held, max(0, b - self.start)))

    def attend(self, queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask, fused):
        """queries [B, Hq, S, D] -> the attention output [B, Hq, S, Dv]; the score takes the max of the weights.

        Computed ``rows`` query rows at a time, one block per stream of :func:`row_streams` (so one per core on the
        CPU) and evaluated per round of blocks (a host sync: this pass is one-shot, not a decode step), so a layer's
        [B, H, G, S, n + S] weights never exist at once (peak memory: one block per stream).
        In a sliding-window layer (window ``w``) only the chunk's first ``w - 1`` rows (positions ``L .. L + w - 2``)
        see a context key; the other rows take the model's own kernel over the chunk's keys alone (their weights
        on the context are 0, so the scores are unchanged)."""
        S, T = queries.shape[2], keys.shape[2]
        n = self.held
        seeing = S if self.own or self.window is None else min(S, self.window - 1)
        outs = []
        streams = row_streams()
        for i, r0 in enumerate(range(0, seeing, self.rows)):
            r1 = min(seeing, r0 + self.rows)
            hi = T if mask is None else n + r1  # the keys up to the block's last row (the rest are masked)
            with mx.stream(streams[i % len(streams)]):  # a block per core; the folds into the score keep their order
                m = _rows(mask, r0, r1, S, T)
                q, k, v = queries[:, :, r0:r1], keys[..., :hi, :], values[..., :hi, :]
                out, weights = attention_with_weights(q, k, v, scale, None if m is None else m[..., :hi])
                self._take(weights.astype(mx.float32), hi)
            outs.append(out)
            if (i + 1) % len(streams) == 0 or r1 == seeing:  # one block per stream in memory at once
                mx.eval(self.score, *outs[-len(streams) :], *(() if self.whole is None else (self.whole,)))
        if seeing < S:  # rows that see no context key: the chunk's own keys under the layer's mask
            rest = _rows(mask, seeing, S, S, T)[..., n:]
            q, k, v = queries[:, :, seeing:], keys[..., n:, :], values[..., n:, :]
            outs.append(blocked_attention(q, k, v, scale, rest, fused, self.window))
        return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=2)

    def _take(self, weights: mx.array, T: int) -> None:
        """Fold one block's weights [B, H, G, rows, T] (float32) into the running maxima (the class docstring)."""
        n, o = self.held, self.start
        if self.own:
            seen = weights.max(axis=(2, 3))  # [B, H, n + S]: positions o .. o + n + S - 1
            if self.score.shape[-1] < o + T:
                pad = mx.zeros((*self.score.shape[:2], o + T - self.score.shape[-1]), dtype=mx.float32)
                self.score = mx.concatenate([self.score, pad], axis=-1)
            self.score[..., o : o + T] = mx.maximum(self.score[..., o : o + T], seen)
        elif self.span is None or self.whole is not None:
            seen = weights[..., :n].max(axis=(2, 3))  # [B, H, n]: positions o .. L - 1
            if self.span is None:
                self.score[..., o:] = mx.maximum(self.score[..., o:], seen)
            else:
                self.whole[..., o:] = mx.maximum(self.whole[..., o:], seen)
        if self.span is not None:
            a, b = self.span
            sink, span = self._local(0, min(self.n_sink, a)), self._local(a, b)
            if span.stop > span.start:  # else the window no longer sees the span: its weights are all 0
                total = weights[..., sink].sum(-1) + weights[..., span].sum(-1) + weights[..., n:].sum(-1)
                seen = (weights[..., span] / total[..., None]).max(axis=(2, 3))  # [B, H, |span|]
                at = slice(o + span.start, o + span.stop)
                self.score[..., at] = mx.maximum(self.score[..., at], seen)

    def before_attention(self, queries, scale, mask):  # the hook's batch route (not taken: "single")
        return mask


def _rows(mask, r0: int, r1: int, S: int, T: int):
    """Query rows ``r0:r1`` of the mask of S queries (the last S of T positions) over T keys."""
    if mask is None:
        return None
    if isinstance(mask, str):  # "causal": query row i (position T - S + i) sees keys j <= T - S + i
        q = mx.arange(T - S + r0, T - S + r1)[:, None]
        return mx.arange(T)[None] <= q
    return mask[..., r0:r1, :] if mask.shape[-2] == S else mask


def repeat_chunks(
    context_ids: Sequence[int], first: Sequence[int], later: Sequence[int], suffix: Sequence[int], chunk: int, tail: int
) -> List[List[int]]:
    """The reconstruction inputs: ``first ++ suffix ++ x[0:chunk]``, then for each next chunk
    ``later ++ (the previous chunk's last tail tokens) ++ suffix ++ x[a:a + chunk]`` (KVzip's prompts)."""
    ids = list(context_ids)
    out = []
    for a in range(0, len(ids), chunk):
        prompt = list(first) if a == 0 else list(later) + ids[max(0, a - tail) : a]
        out.append(prompt + list(suffix) + ids[a : a + chunk])
    return out


def reconstruction_scores(
    model,
    contexts: Sequence[Context],
    chunks: Sequence[Sequence[int]],
    spans=None,
    n_sink: int = 0,
    whole=None,
    progress: Optional[Callable[[int, int], None]] = None,
) -> List[mx.array]:
    """``score^{(l)}`` [B, H, L] float32 per layer (module docstring) for the prefilled ``contexts`` (one
    :class:`Context` per layer; 0 before a window layer's ``start``, where no reconstruction query looks) and the
    reconstruction inputs ``chunks``; ``spans`` (one ``(a, b)`` per chunk) selects kvpress's per-chunk
    normalisation with ``n_sink`` sinks, and then a list given as ``whole`` receives the whole-context scores of
    the same pass (to compare the two). ``progress(i, n)`` is called before the first chunk and after each
    (``i`` of the ``n`` chunks done)."""
    caches = [ReconstructionCache(c, n_sink) for c in contexts]
    if whole is not None and spans is not None:
        for c in caches:
            c.whole = mx.zeros_like(c.score)
    progress = progress or (lambda *_: None)
    hook = attention.install(model)
    try:
        progress(0, len(chunks))
        for i, ids in enumerate(chunks):
            for c in caches:
                c.span = None if spans is None else spans[i]
            model(mx.array(list(ids), dtype=mx.uint32)[None], cache=caches)
            mx.eval([c.score for c in caches])
            progress(i + 1, len(chunks))
    finally:
        hook.remove()
    if whole is not None and spans is not None:
        whole.extend(c.whole for c in caches)
    return [c.score for c in caches]


def window_scores(model, contexts: Sequence[Context], ids: Sequence[int], W: int) -> List[mx.array]:
    """The attention the context's last ``W`` queries pay to every context token (SnapKV's observation window;
    with a question at the end of the prompt these are the queries that ask it), per layer [B, H, L] float32::

        win^{(l)}[h, j] = max_g max_{t >= L - W} softmax_j(scale * q_{h,g,t} . k_{h,j} + mask[t, j])     j < L

    (0 where ``j > t`` for every window query). Computed exactly as the prefill computed those queries: the
    window's tokens ``ids[L - W:]`` are fed again at their own positions over the context's first ``L - W`` keys
    and values from ``contexts`` (one :class:`Context` per layer, holding at least the window and what its
    queries see), with the layer's own mask."""
    L = len(ids)
    if not 1 <= W < L:
        raise ValueError(f"window_scores needs 1 <= W < L (got W={W}, L={L})")
    for c in contexts:  # the window's queries and every key they see (a window layer: w - 1 before each)
        if c.length != L or c.start > max(0, L - W - (c.window or L) + 1):
            raise ValueError(
                f"window_scores: a context of {c.keys.shape[2]} keys from position {c.start} (window {c.window}) "
                f"does not hold the {W} window queries of {L} tokens and the keys they see"
            )
    caches = [
        ReconstructionCache(Context(c.keys[..., :-W, :], c.values[..., :-W, :], c.start), own=True) for c in contexts
    ]
    hook = attention.install(model)
    try:
        model(mx.array(list(ids[L - W :]), dtype=mx.uint32)[None], cache=caches)
        mx.eval([c.score for c in caches])
    finally:
        hook.remove()
    return [c.score for c in caches]
