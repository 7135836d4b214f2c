"""Attention computed once, with its weights: the model's output and the observed signal from one pass.

A policy with the observed signal needs the model's attention weights. Calling mlx-lm's fused
``scaled_dot_product_attention`` and then recomputing ``softmax(q k^T)`` for the scorer costs two
passes over the keys; :func:`attention_with_weights` computes the weights once and returns both
the output and the weights. On CPU, MLX's fused attention is itself this composition (its fallback),
and the output here is bit-identical to it for float32, float16 and bfloat16 (tests/test_attention_once.py);
the kernel is kept when no policy needs the weights. A decode step of a cache that has evicted takes the
``grouped`` product instead (:func:`attention_with_weights`): the same equation as one matrix product per KV
head instead of one per query head (faster on CPU), equal to the kernel up to float rounding.

Shapes: queries [B, Hq, S, D], keys [B, H, L, D], values [B, H, L, Dv], ``G = Hq / H`` query heads per
KV head; mask None, ``"causal"``, a bool array (True = attend) or an additive array, broadcastable to
[B, Hq, S, L] (what mlx-lm passes).
"""

from __future__ import annotations

import math
from typing import Tuple

import mlx.core as mx

from ..parts.attention_scorer import causal_allowed


def attend_once(n_queries: int) -> bool:
    """Whether one composed pass (output and weights) beats the fused kernel plus the scorer's own pass.

    On CPU always, for decode and prefill chunks alike, since MLX's CPU kernel is the same composition
    (docs/results/benchmarks-speed.md, "Attention once"). On a GPU the fused kernel never materialises the [S, L]
    weights, so only decode steps (one query row) take the composed pass there.
    """
    return n_queries == 1 or mx.default_device() == mx.cpu


def grouped_mask(mask: mx.array, H: int, G: int) -> mx.array:
    """A mask broadcastable to [B, Hq, S, L] as one broadcastable to [B, H, G, S, L] (query heads grouped)."""
    if mask.ndim < 4:
        return mask  # [S, L] or [1|Hq?, S, L]: the leading axes broadcast against [B, H, G]
    if mask.shape[1] == H * G and G > 1:
        return mask.reshape(mask.shape[0], H, G, mask.shape[2], mask.shape[3])
    return mask[:, :, None]  # [B, 1|H, 1, S, L]


def attention_with_weights(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    scale: float,
    mask,
    compiled: bool = False,
    grouped: bool = False,
) -> Tuple[mx.array, mx.array]:
    """The attention output [B, Hq, S, Dv] and its weights [B, H, G, S, L] (queries' dtype)::

        w = softmax(scale * q k^T + mask)      (precise softmax; a bool mask gives -inf where False)
        out = w v

    exactly MLX's fused attention on CPU (``grouped``: up to rounding), including what a non-finite key does (a
    NaN or +inf logit makes its query row NaN, as in the model's own attention).

    ``compiled``: a decode step (S = 1, mask None or an array) runs as one compiled graph (the same ops:
    bit for bit the eager ones, tests/test_attention_once.py; one call instead of one dispatch per op). MLX
    traces it once per shape, so only for shapes that repeat: a policy cache's full
    buffer (its steady state), not a cache that still grows by one slot per step.

    ``grouped`` (decode steps, S = 1): a KV head's G query heads are the G rows of one product with its keys,
    ``[B, H, G, D] @ [B, H, D, L]``, and its weights one product with its values, instead of G products of one
    row each (the broadcast ``[B, H, G, 1, D] @ [B, H, 1, D, L]`` of the fused kernel). The same equation and
    the same dot products, summed by another BLAS kernel: equal to the kernel's output up to float rounding,
    not bit for bit at every shape; faster on CPU, where G rows make one well-shaped product instead of G
    matrix-vector products (docs/results/speed.md). A policy cache takes it once it has evicted
    (:meth:`~kvpolicy_core.cache.policy_cache.PolicyCache.attend`), so that until then its logits are mlx-lm's
    own bit for bit.
    """
    grouped = grouped and queries.shape[2] == 1
    if compiled and queries.shape[2] == 1 and (mask is None or isinstance(mask, mx.array)):
        if mask is None:
            return (_decode_grouped_no_mask if grouped else _decode_no_mask)(queries, keys, values, scale)
        return (_decode_grouped_masked if grouped else _decode_masked)(queries, keys, values, scale, mask)
    return _attention(queries, keys, values, scale, mask, grouped)


def quantized_attention_with_weights(queries, q_keys, q_values, scale: float, mask, group_size: int, bits: int):
    """:func:`attention_with_weights` over quantized rows (``q_keys``, ``q_values``: ``mx.quantize`` triples
    [B, H, L, *]): the output [B, Hq, S, Dv] and the weights [B, H, G, S, L] of mlx-lm's
    ``quantized_scaled_dot_product_attention``, op for op (its output bit for bit)::

        w = softmax(quantized_matmul(scale * q, K^T) + mask)   (a bool mask: the dtype's lowest where False)
        out = quantized_matmul(w, V)
    """
    B, Hq, S, D = queries.shape
    H = q_keys[0].shape[-3]
    G = Hq // H
    queries = queries * scale
    if G > 1:
        queries = mx.reshape(queries, (B, H, G, S, D))
        q_keys = tuple(mx.expand_dims(x, axis=-3) for x in q_keys)
        q_values = tuple(mx.expand_dims(x, axis=-3) for x in q_values)
    logits = mx.quantized_matmul(queries, *q_keys, transpose=True, group_size=group_size, bits=bits)
    if mask is not None:
        if isinstance(mask, str):
            if mask != "causal":
                raise ValueError(f"attention mask must be None, 'causal' or an array (got {mask!r})")
            qL, kL = logits.shape[-2:]
            mask = mx.arange(kL - qL, kL)[:, None] >= mx.arange(kL)[None]
        if G > 1 and mask.ndim > 3:
            mask = grouped_mask(mask, H, G)
        if mask.dtype == mx.bool_:
            logits = mx.where(mask, logits, mx.finfo(logits.dtype).min)
        else:
            logits = logits + mask
    weights = mx.softmax(logits, axis=-1, precise=True)
    out = mx.quantized_matmul(weights, *q_values, transpose=False, group_size=group_size, bits=bits)
    if G > 1:
        out = mx.reshape(out, (B, Hq, S, -1))
    else:
        weights = weights[:, :, None]
    return out, weights


def _attention(queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask, grouped: bool = False):
    B, Hq, S, D = queries.shape
    H, L = keys.shape[1], keys.shape[2]
    G = Hq // H
    if grouped:  # G * S query rows per KV head in one product: the keys read once, not once per query head
        logits = ((queries * scale).reshape(B, H, G * S, D) @ keys.swapaxes(-1, -2)).reshape(B, H, G, S, L)
    else:
        q = (queries * scale).reshape(B, H, G, S, D)
        logits = q @ keys[:, :, None].swapaxes(-1, -2)  # [B, H, G, S, L]
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"attention mask must be None, 'causal' or an array (got {mask!r})")
        mask = causal_allowed(S, L)
    if mask is not None:
        mask = grouped_mask(mask, H, G)
        if mask.dtype == mx.bool_:
            logits = mx.where(mask, logits, mx.array(-math.inf, dtype=logits.dtype))
        else:
            logits = logits + mask.astype(logits.dtype)
    weights = mx.softmax(logits, axis=-1, precise=True)
    out = weights.reshape(B, H, G * S, L) @ values if grouped else weights @ values[:, :, None]
    return out.reshape(B, Hq, S, values.shape[-1]), weights


_decode_no_mask = mx.compile(lambda q, k, v, scale: _attention(q, k, v, scale, None))
_decode_masked = mx.compile(lambda q, k, v, scale, mask: _attention(q, k, v, scale, mask))
_decode_grouped_no_mask = mx.compile(lambda q, k, v, scale: _attention(q, k, v, scale, None, True))
_decode_grouped_masked = mx.compile(lambda q, k, v, scale, mask: _attention(q, k, v, scale, mask, True))
