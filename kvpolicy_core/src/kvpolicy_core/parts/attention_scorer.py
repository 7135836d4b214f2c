"""The shared base of scorers built from attention weights (proxy or observed signal).

Shapes: ``B`` batch, ``H`` KV heads, ``G`` query heads per KV head, ``S`` query rows,
``L`` slots. Both signals produce weights ``[B, H, G, S, L]`` (``G = 1`` for the proxy),
and a subclass only says how weights update the running scores (:meth:`AttentionScorer.combine`).
"""

from __future__ import annotations

import math

import mlx.core as mx

from .base import CacheView, Needs, Scorer

SIGNALS = ("proxy", "observed")


def masked_softmax(logits: mx.array, allowed: mx.array) -> mx.array:
    """Softmax over the last axis restricted to ``allowed`` and to finite logits; rows with nothing
    allowed give 0. A non-finite key (NaN/Inf logits) so gets no weight and takes none from the others."""
    allowed = allowed & mx.isfinite(logits)
    neg = mx.array(-math.inf, dtype=logits.dtype)
    probs = mx.softmax(mx.where(allowed, logits, neg), axis=-1, precise=True)
    return mx.where(allowed, probs, mx.zeros_like(probs))


def finite_weights(weights: mx.array) -> mx.array:
    """The model's attention weights as float32 with NaN as 0: a row that a non-finite key poisoned in the
    model's own attention adds nothing, instead of wiping every score of the layer."""
    return mx.nan_to_num(weights.astype(mx.float32), nan=0.0)


def causal_allowed(n_queries: int, n_keys: int) -> mx.array:
    """mlx-lm's "causal" mask for S queries at the end of L keys: bool [S, L]."""
    q = mx.arange(n_keys - n_queries, n_keys)[:, None]
    return q >= mx.arange(n_keys)[None]


def rows_of(mask, lo: int, hi: int, S: int, L: int):
    """The mask of query rows ``lo .. hi - 1`` of S over L keys: None, a causal bool array [hi - lo, L] for
    ``"causal"`` (query ``i`` sees keys ``j <= L - S + i``), or the array's rows (a row axis of 1 broadcasts)."""
    if mask is None:
        return None
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"attention mask must be None, 'causal' or an array (got {mask!r})")
        return mx.arange(L - S + lo, L - S + hi)[:, None] >= mx.arange(L)[None]
    return mask if mask.ndim < 2 or mask.shape[-2] == 1 else mask[..., lo:hi, :]


def by_query_blocks(attend, queries: mx.array, mask, L: int, block: int, axis: int = 2) -> mx.array:
    """``attend(queries_block, mask_block)`` over blocks of ``block`` query rows of queries [B, Hq, S, D], each
    evaluated before the next (else MLX schedules them together); the outputs concatenated on ``axis``, their
    query-row axis (2 for an attention output [B, Hq, b, Dv])."""
    S = queries.shape[2]
    outs = []
    for lo in range(0, S, block):
        hi = min(S, lo + block)
        out = attend(queries[:, :, lo:hi], rows_of(mask, lo, hi, S, L))
        mx.eval(out)
        outs.append(out)
    return mx.concatenate(outs, axis=axis)


def last_row(mask):
    """The mask of the last query row (None or "causal" -> None: the last row sees everything)."""
    if mask is None or isinstance(mask, str):
        return None
    return mask[..., -1:, :]


#: keys decoded per block by :func:`observed_weights` when it is given ``key_rows``
KEY_BLOCK = 1024


def observed_weights(queries: mx.array, keys: mx.array, scale: float, mask, key_rows=None) -> mx.array:
    """The model's attention weights grouped by KV head.

    queries [B, Hq, S, D], keys [B, H, L, D] -> weights [B, H, Hq/H, S, L] float32,
    softmax(scale * q k^T + mask) exactly as the model computes it (mask: None,
    "causal", a bool array or an additive array broadcastable to [B, Hq, S, L]), except that
    non-finite logits (from a NaN/Inf key or query) are excluded rather than poisoning the row.

    ``key_rows(lo, hi)``: the keys of slots ``lo .. hi - 1`` decoded (engine use: quantized rows). A prompt chunk's
    pass (S > 1) then forms the logits by blocks of :data:`KEY_BLOCK` slots, each evaluated before the next block
    is decoded, so ``keys`` (read for its shape only) is never decoded whole; a decode step (S = 1) reads ``keys``
    and never syncs.
    """
    B, Hq, S, D = queries.shape
    H, L = keys.shape[1], keys.shape[2]
    rep = Hq // H
    q = queries.astype(mx.float32).reshape(B, H, rep, S, D) * scale
    if key_rows is None or L <= KEY_BLOCK or S == 1:
        logits = q @ keys.astype(mx.float32)[:, :, None].swapaxes(-1, -2)  # [B, H, rep, S, L]
    else:  # a prompt chunk's pass: each block's logits evaluated before the next block is decoded
        pieces = []
        for lo in range(0, L, KEY_BLOCK):
            k = key_rows(lo, min(L, lo + KEY_BLOCK)).astype(mx.float32)
            pieces.append(q @ k[:, :, None].swapaxes(-1, -2))
            mx.eval(pieces[-1])
        logits = mx.concatenate(pieces, axis=-1)
    if mask is None:
        return masked_softmax(logits, mx.array(True))
    if isinstance(mask, str):
        return masked_softmax(logits, causal_allowed(S, L))
    m = mask
    if m.ndim == 4:
        m = m.reshape(m.shape[0], H, rep, S, L) if m.shape[1] == Hq and Hq > 1 else m[:, :, None]
        if m.shape[1] == 1 and H > 1:
            m = mx.broadcast_to(m, (m.shape[0], H) + m.shape[2:])
    if m.dtype == mx.bool_:
        return masked_softmax(logits, m)
    return masked_softmax(logits + m.astype(mx.float32), mx.array(True))  # -inf in the mask: excluded


#: the most bytes one block of :func:`observed_rows` may take ([B, Hq, b, L] float32 logits)
ROWS_BLOCK_BYTES = 2 * 2**20


def observed_rows(queries: mx.array, keys: mx.array, scale: float, mask, key_rows=None) -> mx.array:
    """:func:`observed_weights` summed over each KV head's query heads, [B, H, 1, S, L] float32::

        rows[b, h, 0, i, j] = sum_g softmax(scale * q_{h,g,i} k_h^T + mask_i)_j

    computed by blocks of query rows when the logits of all S rows would take more than
    :data:`ROWS_BLOCK_BYTES` (each block evaluated before the next is built). A row's softmax reads only that row
    and the sum over ``g`` adds the same terms, so the result is the unblocked one up to float rounding (a BLAS may
    round a block's matrix product differently; tests/test_attention_blocks.py); the transient is one block's logits
    instead of the [B, Hq, S, L] logits and weights of all rows, which on a long held prompt (an observation window
    over every held key of a layer) was larger than the layer's rows.
    ``key_rows``: as for :func:`observed_weights` (each block decodes the keys again, a block at a time)."""
    B, Hq, S, D = queries.shape
    L = keys.shape[2]
    b = max(1, ROWS_BLOCK_BYTES // max(1, B * Hq * L * 4))

    def rows(q, m):
        return observed_weights(q, keys, scale, m, key_rows).sum(axis=2, keepdims=True)

    return rows(queries, mask) if S <= b else by_query_blocks(rows, queries, mask, L, b, axis=3)


def proxy_weights(keys: mx.array, positions: mx.array, new_keys: mx.array, new_positions: mx.array) -> mx.array:
    """Each new key used as a query over the slots before it: [B, H, 1, S, L] float32::

    w_{t,j} = softmax_j( k_t . k_j / sqrt(D) )   over j with pos_j < pos_t (0 elsewhere)
    """
    D = new_keys.shape[-1]
    q = new_keys.astype(mx.float32)
    k = keys.astype(mx.float32)
    logits = (q @ k.swapaxes(-1, -2)) * (1.0 / math.sqrt(D))  # [B, H, S, L]
    allowed = positions[:, :, None, :] < new_positions[..., :, None]  # new_positions [S] or [B, 1, S]
    return masked_softmax(logits, allowed)[:, :, None]


class AttentionScorer(Scorer):
    """Scores from attention weights; a subclass implements :meth:`combine`.

    ``signal="proxy"``: each appended key is the query (no hook needed); ``"observed"``: the
    model's real queries, from the attention hook. ``last_query_only`` restricts both to the
    newest query row.
    """

    last_query_only = False
    default_signal = "proxy"
    needs = Needs(batch_rows=True)  # per-row offsets/positions broadcast (see parts.base.BATCH_ROWS)

    def __init__(self, signal: str = None) -> None:
        signal = self.default_signal if signal is None else signal
        if signal not in SIGNALS:
            raise ValueError(f"signal must be 'proxy' or 'observed' (got {signal!r})")
        self.signal = signal
        self.needs = Needs(attention=signal == "observed", batch_rows=True)

    @classmethod
    def from_config(cls, config) -> "AttentionScorer":
        return cls(signal=config.signal)

    def combine(self, scores: mx.array, weights: mx.array) -> mx.array:
        """scores [B, H, L], weights [B, H, G, S, L] -> new scores [B, H, L]."""
        raise NotImplementedError

    def on_append(self, view: CacheView, new_keys: mx.array, new_positions: mx.array) -> mx.array:
        if self.signal != "proxy":
            return view.scores
        if self.last_query_only:
            new_keys, new_positions = new_keys[:, :, -1:], new_positions[..., -1:]
        return self.combine(view.scores, proxy_weights(view.keys, view.positions, new_keys, new_positions))

    def on_attention(self, view: CacheView, queries: mx.array, scale: float, mask) -> mx.array:
        if self.signal != "observed":
            return view.scores
        if self.last_query_only:
            queries, mask = queries[:, :, -1:], last_row(mask)
        return self.combine(view.scores, observed_weights(queries, view.keys, scale, mask))

    def on_attention_weights(self, view: CacheView, weights: mx.array) -> mx.array:
        """The same update from the weights the model's attention computed (the hook's one pass).

        ``weights`` [B, H, G, S, L]: softmax(scale * q k^T + mask) of this step's S queries, any float
        dtype (:func:`kvpolicy_core.attention.weights.attention_with_weights`). For finite logits in float32
        this is bit for bit :meth:`on_attention` of the same queries and mask; a query row the model's
        attention made NaN (a NaN or +inf logit) adds nothing (:meth:`on_attention` drops the key instead).
        """
        if self.signal != "observed":
            return view.scores
        if self.last_query_only:
            weights = weights[..., -1:, :]
        return self.combine(view.scores, finite_weights(weights))
