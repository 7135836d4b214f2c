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
"""

from __future__ import annotations

from typing import Callable, List, Optional, Sequence

import mlx.core as mx
from mlx_lm.models.cache import create_attention_mask

from ..attention import hook as attention
from ..attention.weights import attention_with_weights


class ReconstructionCache:
    """One layer's cache during the reconstruction pass: the full context (kept as is) plus the chunk being fed.

    ``update_and_fetch(k, v)`` returns ``[context ++ k]`` and stores nothing; the attention hook routes the
    layer's attention here (:meth:`attend`), which computes it with its weights and keeps the running maximum
    over query heads and query positions of the weights each context key receives (``score`` [B, H, L] float32;
    with ``own``, the one chunk fed scores its own keys too: [B, H, L + S]).
    """

    kvpolicy_attention = "single"  #: the attention hook calls :meth:`attend` for this cache
    rows = 256  #: query rows whose attention weights are computed at once

    def __init__(self, keys: mx.array, values: mx.array, n_sink: int = 0, own: bool = False) -> None:
        self.context_keys, self.context_values = keys, values  # [B, H, L, D], [B, H, L, Dv]
        self.offset = keys.shape[2]  # L: the reconstruction tokens' positions start after the context
        self.score = mx.zeros(keys.shape[:3], dtype=mx.float32)
        self.n_sink = n_sink
        self.span = None  #: (a, b): the context span of the chunk being fed (kvpress's normalisation), or None
        self.whole = None  #: with a span, the whole-context score alongside when set to zeros [B, H, L] (compare)
        #: the score also covers the fed chunk's own keys ([B, H, L + S]; one chunk fed: :func:`window_scores`)
        self.own = own

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        """keys [B, H, S, D] of the chunk -> the context's and the chunk's keys and values [B, H, L + S, D]."""
        return (
            mx.concatenate([self.context_keys, keys], axis=2),
            mx.concatenate([self.context_values, values], axis=2),
        )

    def make_mask(self, N: int, window_size: Optional[int] = None, return_array: bool = False):
        """The mask of N chunk queries over ``L + N`` keys, as mlx-lm's ``KVCache`` makes it."""
        return create_attention_mask(N, self.offset, return_array, window_size)

    def attend(self, queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask, fused):
        """queries [B, Hq, S, D] -> the attention output [B, Hq, S, Dv]; the score takes the max of the weights.

        Computed ``rows`` query rows at a time and evaluated per block (a host sync: this pass is one-shot, not
        a decode step), so a layer's [B, H, G, S, L + S] weights never exist at once (peak memory: one block)."""
        S, T = queries.shape[2], keys.shape[2]
        outs = []
        for r0 in range(0, S, self.rows):
            r1 = min(S, r0 + self.rows)
            out, weights = attention_with_weights(queries[:, :, r0:r1], keys, values, scale, _rows(mask, r0, r1, S, T))
            weights = weights.astype(mx.float32)
            if self.own:
                seen = weights.max(axis=(2, 3))  # [B, H, L + S]
                if self.score.shape[-1] < T:
                    pad = mx.zeros((*self.score.shape[:2], T - self.score.shape[-1]), dtype=mx.float32)
                    self.score = mx.concatenate([self.score, pad], axis=-1)
                self.score = mx.maximum(self.score, seen)
            elif self.span is None or self.whole is not None:
                seen = weights[..., : self.offset].max(axis=(2, 3))  # [B, H, L]
                if self.span is None:
                    self.score = mx.maximum(self.score, seen)
                else:
                    self.whole = mx.maximum(self.whole, seen)
            if self.span is not None:
                a, b = self.span
                sink = min(self.n_sink, a)
                total = weights[..., :sink].sum(-1) + weights[..., a:b].sum(-1) + weights[..., self.offset :].sum(-1)
                seen = (weights[..., a:b] / total[..., None]).max(axis=(2, 3))  # [B, H, b - a]
                self.score[..., a:b] = mx.maximum(self.score[..., a:b], seen)
            mx.eval(self.score, out, *(() if self.whole is None else (self.whole,)))
            outs.append(out)
        return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=2)

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
    contexts: Sequence[tuple],
    chunks: Sequence[Sequence[int]],
    spans=None,
    n_sink: int = 0,
    whole=None,
    progress: Optional[Callable[[int, int], None]] = None,
) -> List[mx.array]:
    """``score^{(l)}`` [B, H, L] float32 per layer (module docstring) for the context K/V ``contexts``
    (one ``(keys, values)`` per layer, [B, H, L, D]) and the reconstruction inputs ``chunks``; ``spans`` (one
    ``(a, b)`` per chunk) selects kvpress's per-chunk normalisation with ``n_sink`` sinks, and then a list given as
    ``whole`` receives the whole-context scores of the same pass (to compare the two). ``progress(i, n)`` is
    called before the first chunk and after each (``i`` of the ``n`` chunks done)."""
    caches = [ReconstructionCache(k, v, n_sink) for k, v in contexts]
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


def window_scores(model, contexts: Sequence[tuple], ids: Sequence[int], W: int) -> List[mx.array]:
    """The attention the context's last ``W`` queries pay to every context token (SnapKV's observation window;
    with a question at the end of the prompt these are the queries that ask it), per layer [B, H, L] float32::

        win^{(l)}[h, j] = max_g max_{t >= L - W} softmax_j(scale * q_{h,g,t} . k_{h,j} + mask[t, j])     j < L

    (0 where ``j > t`` for every window query). Computed exactly as the prefill computed those queries: the
    window's tokens ``ids[L - W:]`` are fed again at their own positions over the context's first ``L - W`` keys
    and values from ``contexts`` (one ``(keys, values)`` per layer, [B, H, L, D]), with the layer's own mask."""
    L = len(ids)
    if not 1 <= W < L:
        raise ValueError(f"window_scores needs 1 <= W < L (got W={W}, L={L})")
    caches = [ReconstructionCache(k[..., : L - W, :], v[..., : L - W, :], own=True) for k, v in contexts]
    hook = attention.install(model)
    try:
        model(mx.array(list(ids[L - W :]), dtype=mx.uint32)[None], cache=caches)
        mx.eval([c.score for c in caches])
    finally:
        hook.remove()
    return [c.score for c in caches]
