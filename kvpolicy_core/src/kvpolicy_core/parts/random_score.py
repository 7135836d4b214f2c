"""Random eviction (the quality floor): every token gets a fixed pseudo-random score."""

from __future__ import annotations

import mlx.core as mx

from .base import CacheView, Needs, Scorer


def hash01(positions: mx.array, salt: int, head_offset: int = 0) -> mx.array:
    """A fixed pseudo-random number in [0, 1) per (global head, position): murmur3's finaliser on uint32.

    positions [B, H, L] int32 -> [B, H, L] float32; independent of batch row. Head h of
    the array is global head ``head_offset + h`` (tensor-parallel ranks hold a slice of heads),
    so the number is the same whichever rank holds the head.
    """
    u = lambda c: mx.array(c, dtype=mx.uint32)  # noqa: E731
    head = mx.arange(head_offset, head_offset + positions.shape[1], dtype=mx.uint32)[None, :, None]
    x = positions.astype(mx.uint32) * u(2654435761) + head * u(0x9E3779B9) + u(salt & 0xFFFFFFFF)
    x = x ^ (x >> 16)
    x = x * u(0x85EBCA6B)
    x = x ^ (x >> 13)
    x = x * u(0xC2B2AE35)
    x = x ^ (x >> 16)
    return (x >> 8).astype(mx.float32) / float(1 << 24)


class RandomScorer(Scorer):
    """``s_j = hash(pos_j, global head, salt)`` in [0, 1), fixed when the token arrives; never updated."""

    # a token's score is its own: dropping the newest tokens leaves the others exact
    needs = Needs(batch_rows=True, trim_exact=True)

    def __init__(self, salt: int = 0) -> None:
        self.salt = salt

    @classmethod
    def from_config(cls, config) -> "RandomScorer":
        return cls(salt=getattr(config, "salt", 0))

    def on_append(self, view: CacheView, new_keys: mx.array, new_positions: mx.array) -> mx.array:
        new = view.positions >= new_positions[..., :1]  # new_positions [S] or [B, 1, S]
        return mx.where(new, hash01(view.positions, self.salt, view.head_offset), view.scores)
