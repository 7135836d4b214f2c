"""Cumulative attention mass scorer (H2O's heavy-hitter score), shared by H2O and CaM."""

from __future__ import annotations

import math

import mlx.core as mx

from .base import CacheView, Scorer


def masked_softmax(logits: mx.array, allowed: mx.array) -> mx.array:
    """Softmax over the last axis restricted to ``allowed``; rows with nothing allowed give 0."""
    neg = mx.array(-math.inf, dtype=logits.dtype)
    probs = mx.softmax(mx.where(allowed, logits, neg), axis=-1, precise=True)
    return mx.where(allowed, probs, mx.zeros_like(probs))


def causal_allowed(n_queries: int, n_keys: int) -> mx.array:
    """mlx-lm's "causal" mask for S queries at the end of L keys: bool [S, L]."""
    q = mx.arange(n_keys - n_queries, n_keys)[:, None]
    return q >= mx.arange(n_keys)[None]


def observed_weights(queries: mx.array, keys: mx.array, scale: float, mask) -> mx.array:
    """The model's attention weights grouped by KV head.

    queries [B, Hq, S, D], keys [B, H, L, D] -> weights [B, H, Hq/H, S, L] float32,
    softmax(scale * q k^T + mask) exactly as the model computes it (mask: None,
    "causal", a bool array or an additive array broadcastable to [B, Hq, S, L]).
    """
    B, Hq, S, D = queries.shape
    H, L = keys.shape[1], keys.shape[2]
    rep = Hq // H
    q = queries.astype(mx.float32).reshape(B, H, rep, S, D)
    k = keys.astype(mx.float32)[:, :, None]
    logits = (q * scale) @ k.swapaxes(-1, -2)  # [B, H, rep, S, L]
    if mask is None:
        return mx.softmax(logits, axis=-1, precise=True)
    if isinstance(mask, str):
        return masked_softmax(logits, causal_allowed(S, L))
    m = mask
    if m.ndim == 4:
        m = m.reshape(m.shape[0], H, rep, S, L) if m.shape[1] == Hq and Hq > 1 else m[:, :, None]
        if m.shape[1] == 1 and H > 1:
            m = mx.broadcast_to(m, (m.shape[0], H) + m.shape[2:])
    if m.dtype == mx.bool_:
        return masked_softmax(logits, m)
    return mx.softmax(logits + m.astype(mx.float32), axis=-1, precise=True)


class CumulativeAttentionScorer(Scorer):
    """Cumulative attention mass per retained token, per layer, batch row and KV head.

    ``signal="proxy"`` (the specification's H2O-adapted): every incoming key k_t is
    used as a query over the keys retained before it (positions < pos_t, including
    earlier tokens of the same chunk)::

        s_j += softmax_j( k_j . k_t / sqrt(D) )      for every j with pos_j < pos_t

    and the new token enters with s_t = 0 (it receives mass only from later tokens).

    ``signal="observed"`` (the H2O paper): the real attention weights of the step,
    summed over the step's query rows i and the G query heads sharing KV head h::

        s_{h,j} += sum_{g in group(h)} sum_i softmax_j( q_{g,i} . k_j * scale + mask_ij )

    The new tokens enter with 0 and receive their own step's mass (self included).
    """

    def __init__(self, signal: str = "proxy") -> None:
        if signal not in ("proxy", "observed"):
            raise ValueError(f"signal must be 'proxy' or 'observed' (got {signal!r})")
        self.signal = signal
        self.needs_attention = signal == "observed"

    @classmethod
    def from_config(cls, config) -> "CumulativeAttentionScorer":
        return cls(signal=config.signal)

    def on_append(self, view: CacheView, new_keys: mx.array, new_positions: mx.array) -> mx.array:
        if self.signal != "proxy":
            return view.scores
        D = new_keys.shape[-1]
        q = new_keys.astype(mx.float32)
        k = view.keys.astype(mx.float32)
        logits = (q @ k.swapaxes(-1, -2)) * (1.0 / math.sqrt(D))  # [B, H, S, L]
        allowed = view.positions[:, :, None, :] < new_positions[None, None, :, None]
        return view.scores + masked_softmax(logits, allowed).sum(axis=2)

    def on_attention(self, view: CacheView, queries: mx.array, scale: float, mask) -> mx.array:
        if self.signal != "observed":
            return view.scores
        weights = observed_weights(queries, view.keys, scale, mask)
        return view.scores + weights.sum(axis=(2, 3))
