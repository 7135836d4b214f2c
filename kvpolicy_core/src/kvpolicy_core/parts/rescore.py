"""When the query-agnostic scorers rescore every slot, and what a new token gets in between.

Both :mod:`~kvpolicy_core.parts.keydiff` and :mod:`~kvpolicy_core.parts.expected_attention` recompute the scores
of all L slots from scratch. Prompt chunks always do; a decode step (one new token at position ``offset - 1``)
does when ``every > 0`` and ``offset % every == 0``; at the other decode steps the scores stay and the new
token enters with its row's highest score (shapes [B, H, L])::

    s_j = max_j' s_j'   for the new token j (pos_j = offset - 1);   s_j unchanged otherwise

so a token is never evicted on a score it has not been given, and it gets its own at the next rescoring.
"""

from __future__ import annotations

import mlx.core as mx


def held(scores: mx.array, positions: mx.array, offset) -> mx.array:
    """scores [B, H, L] with the new token (position ``offset - 1``; offset an int or [B, 1, 1]) at its row max."""
    return mx.where(positions == offset - 1, scores.max(axis=-1, keepdims=True), scores)


def at_decode(fresh, scores: mx.array, positions: mx.array, offset, every: int) -> mx.array:
    """A decode step's scores: ``fresh()`` (all slots rescored) where ``offset % every == 0``, else :func:`held`.

    ``offset`` an int (a single sequence: decided here, no host sync) or an int32 array [B, 1, 1] (stacked rows:
    both computed, chosen per row, so row b's result is the one it gets alone)."""
    if every <= 0:
        return held(scores, positions, offset)
    if isinstance(offset, int):
        return fresh() if offset % every == 0 else held(scores, positions, offset)
    return mx.where(offset % every == 0, fresh(), held(scores, positions, offset))
