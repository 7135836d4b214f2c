"""Per-slot attention log-weights folded into the mask that the attention hook hands to mlx-lm.

A slot j with log-weight ``lw_j`` is attended with the logit ``q . k_j * scale + lw_j``: it draws
``exp(lw_j)`` times the attention of a plain copy of itself (ToMe's proportional attention,
KeepKV's votes). mlx-lm's ``scaled_dot_product_attention`` takes one mask, boolean or additive,
so the bias and the step's mask become one additive mask.
"""

from __future__ import annotations

import math

import mlx.core as mx

from ..parts.attention_scorer import causal_allowed


def with_log_weights(mask, log_weights: mx.array, queries: mx.array) -> mx.array:
    """The additive mask [B, Hq, S|1, L] (queries' dtype) of ``mask`` plus the slots' log-weights.

    ``log_weights`` [B, H, L] (KV heads; repeated over the Hq/H query heads of each), queries
    [B, Hq, S, D]; ``mask`` None, "causal", a bool array (True = attend) or an additive array,
    broadcastable to [B, Hq, S, L]::

        bias[b, g, i, j] = lw[b, g // (Hq/H), j]   where mask allows (i, j), -inf elsewhere

    With all log-weights 0 the attention is the one of ``mask`` bit for bit (x + 0 == x; a
    masked logit is -inf either way).
    """
    B, Hq, S, _ = queries.shape
    H, L = log_weights.shape[1], log_weights.shape[2]
    bias = log_weights if Hq == H else mx.repeat(log_weights, Hq // H, axis=1)
    bias = bias.astype(queries.dtype)[:, :, None, :]  # [B, Hq, 1, L]
    if mask is None:
        return bias
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"attention mask must be None, 'causal' or an array (got {mask!r})")
        mask = causal_allowed(S, L)
    if mask.dtype == mx.bool_:
        return mx.where(mask, bias, mx.array(-math.inf, dtype=queries.dtype))
    return mask.astype(queries.dtype) + bias
