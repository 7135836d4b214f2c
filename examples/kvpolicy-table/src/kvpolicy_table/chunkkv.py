"""ChunkKV (Liu et al., 2025, arXiv:2502.00299): scores summed over contiguous chunks, whole chunks evicted.

Positions ``p`` fall in chunks ``c(p) = p // C`` (``C = chunk_size``). With H2O's rank ``r_j`` (its score, or
``+inf`` for a sink or a recent token), each slot ranks as its chunk::

    R_j = sum_{k : c(p_k) = c(p_j)} r_k

and an eviction of an overflow ``o`` removes ``ceil(o / C) * C`` slots (``evict_count``): whole chunks, so
phrases survive or go intact, and a chunk holding a protected token is protected whole. ``chunk_size=1`` is
``h2o`` bit for bit.
"""

import mlx.core as mx
from pydantic import Field

from kvpolicy_core import AttentionPolicyConfig, MethodSpec, hookimpl
from kvpolicy_core.parts.lowest_score import LowestScoreSelector
from kvpolicy_core.parts.traits import traits


class ChunkKVConfig(AttentionPolicyConfig):
    """``method="chunkkv"``: H2O's fields and the chunk size (ChunkKV's ~10 tokens)."""

    chunk_size: int = Field(10, ge=1, le=4096, description="Tokens per chunk, kept or evicted together.")


@traits(compile_decode=True)  # its own rank is pure MLX too (a subclass's rank does not inherit the trait)
class ChunkSelector(LowestScoreSelector):
    """H2O's ranks summed over chunks of positions; evictions of whole chunks."""

    def __init__(self, n_sink: int = 4, recent: int = 0, chunk_size: int = 10) -> None:
        super().__init__(n_sink, recent)
        self.chunk_size = chunk_size

    @classmethod
    def from_config(cls, config) -> "ChunkSelector":
        return cls(config.n_sink, config.recent_tokens, config.chunk_size)

    def evict_count(self, over: int, n: int) -> int:
        return min(-(-over // self.chunk_size) * self.chunk_size, n - 1)

    def rank(self, view):
        """float32 [B, H, L]: each slot ranked as its chunk, ``R_j`` above, with ties between chunks broken by
        position (the older chunk first): the chunks' places in the order of ``(R, chunk)``, so that the engine's
        ``E`` lowest are whole chunks but for the last one taken (its order among equal ranks is unspecified);
        a protected chunk (``R = +inf``) stays ``+inf``."""
        r = super().rank(view)
        if self.chunk_size == 1:
            return r
        order = mx.argsort(view.positions, axis=-1)  # slots by position: a chunk's slots are adjacent
        chunk = mx.take_along_axis(view.positions, order, axis=-1) // self.chunk_size
        starts = mx.concatenate([mx.ones_like(chunk[..., :1]), (chunk[..., 1:] != chunk[..., :-1])], axis=-1)
        seg = mx.cumsum(starts.astype(mx.int32), axis=-1) - 1  # dense chunk index [B, H, L], in position order
        sums = mx.zeros(r.shape, mx.float32)  # per-chunk sums: at most L chunks
        b, h = mx.arange(r.shape[0])[:, None, None], mx.arange(r.shape[1])[None, :, None]
        sums = sums.at[b, h, seg].add(mx.take_along_axis(r, order, axis=-1))
        places = _places(sums)  # chunk k's place in the order of (sum, k)
        ranked = mx.where(mx.isposinf(sums), mx.inf, places.astype(mx.float32))
        return mx.put_along_axis(mx.zeros_like(r), order, mx.take_along_axis(ranked, seg, axis=-1), axis=-1)


def _places(x: mx.array) -> mx.array:
    """int32 [..., N]: the place of each x_k in the order of the pairs (x_k, k) (ties by index, lower first), from one
    argsort of an int64 key: the float32 value's order-preserving bit pattern (NaN as 0), then the index."""
    bits = mx.nan_to_num(x, nan=0.0).view(mx.int32).astype(mx.int64)
    ordered = mx.where(bits < 0, -(bits & 0x7FFFFFFF) - 1, bits)  # monotone in the float's value (-0.0 before 0.0)
    n = x.shape[-1]
    key = ordered * n + mx.arange(n, dtype=mx.int64)
    sort = mx.argsort(key, axis=-1)
    return mx.put_along_axis(mx.zeros(x.shape, mx.int32), sort, mx.arange(n, dtype=mx.int32), axis=-1)


@hookimpl
def register_selectors(register):
    register("chunk_lowest", ChunkSelector)


@hookimpl
def register_methods(register):
    register(
        MethodSpec(
            "chunkkv",
            ChunkKVConfig,
            ChunkKVConfig.scorer_name.fget,
            "chunk_lowest",
            "drop",
            description="ChunkKV: H2O's score summed over contiguous chunks; whole chunks evicted.",
        )
    )
