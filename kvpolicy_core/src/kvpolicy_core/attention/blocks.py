"""A prompt chunk's attention over quantized or held rows by blocks of query rows: the same output, a bounded
transient.

mlx-lm's quantized attention (``quantized_matmul``, softmax, ``quantized_matmul``) materialises a chunk's logits and
weights, [B, Hq, S, L] each, on every device: S x L floats per query head,
beside the rows the cache holds; through a long prompt in quantized rows (``kv_bits``, a held prompt's
``hold_bits``) that transient, not the cache, is most of the peak. Query rows are independent::

    out[..., i, :] = softmax(scale * q_i K^T + mask_i) V

depends on query ``i`` and the mask's row ``i`` only, so blocks of ``b`` rows computed one after another (each
evaluated before the next is built, else MLX schedules them together) give the output bit for bit
(tests/test_attention_blocks.py) with ``b / S`` of the transient. Only prompt chunks (``S > b``) whose weights no
scorer reads take it, where mlx-lm evaluates every chunk anyway: never a decode step, so no host sync per token (a
chunk's last layer, whose output mlx-lm never reads, is computed too). A held prompt (``hold_bits``) attends its
rows decoded through mlx-lm's fused kernel by the same blocks: on CPU that kernel forms [S, L] logits too, and its
rows agree across block sizes within float rounding, not bit for bit. Other full-precision rows keep mlx-lm's fused
kernel whole.

A block's logits are bounded by :data:`BLOCK_BYTES` and by the bytes the layer holds (``query_block(held=)``: its
stored keys and values before decoding), so a layer's attention transient stays within what the layer keeps.
"""

from __future__ import annotations

from typing import Optional

from ..parts.attention_scorer import by_query_blocks, rows_of  # noqa: F401  (re-exported: the cache's name)

#: the most bytes one block's logits may take ([B, Hq, b, L] in float32)
BLOCK_BYTES = 32 * 2**20
#: the least byte cap of a block over a held prompt's decoded rows (``hold_bits``): blocks capped at a small layer's
#: held bytes were a few dozen query rows, each its own evaluation of mlx-lm's kernel, and slowed the prefill
#: against ``hold_bits=none`` (docs/memory.md has the measurement); the floor trades a larger block for fewer calls
HELD_BLOCK_FLOOR = 16 * 2**20


def query_block(S: int, L: int, Hq: int, B: int = 1, held: Optional[int] = None) -> Optional[int]:
    """Rows per block for S queries over L keys (``Hq`` query heads, batch B), or None when one block holds them.

    ``held``: the bytes of the rows the layer holds (its stored keys and values, before any decoding); a block's
    logits then take at most that many bytes too (and at most :data:`BLOCK_BYTES`), so the transient of a layer's
    attention stays within what the layer itself holds. Never fewer than 16 rows a block."""
    cap = BLOCK_BYTES if held is None else min(BLOCK_BYTES, held)
    b = max(16, cap // max(1, B * Hq * L * 4))
    return b if S > b else None
