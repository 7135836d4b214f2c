"""ChunkKV evicts whole chunks even where chunks tie (a pooled plateau, equal scores): ties between chunks break
by position, so the engine's E lowest ranks are whole chunks whatever the slots' order in the cache."""

import mlx.core as mx
import numpy as np
import pytest

from kvpolicy_core import PolicyCache
from kvpolicy_core.cache.step import choose
from kvpolicy_core.parts.base import CacheView
from kvpolicy_core.testing.conformance import feed, random_kv
from kvpolicy_table.chunkkv import ChunkSelector, _places


@pytest.mark.parametrize("trial", range(20))
def test_tied_chunks_are_evicted_whole_whatever_the_slot_order(trial):
    """60 slots in a random order (as after in-place decode writes), every score equal: 20 losers are two whole
    chunks, the two oldest (the tie-break)."""
    L = 60
    positions = mx.array(np.random.default_rng(trial).permutation(L).reshape(1, 1, L).astype(np.int32))
    keys = mx.zeros((1, 1, L, 4))
    view = CacheView(keys, keys, positions, mx.ones((1, 1, L)), L, 0, None)
    losers = choose(ChunkSelector(n_sink=0, recent=0, chunk_size=10).rank(view), positions, 0, None, 20)
    lost = np.array(mx.take_along_axis(positions, losers, axis=-1)).ravel()
    assert sorted(lost.tolist()) == list(range(20))


def test_distinct_chunk_sums_keep_their_order_and_protection():
    """Ranks are the chunks' places: the lowest sum first; a protected chunk (+inf) stays protected."""
    L = 30
    positions = mx.arange(L, dtype=mx.int32).reshape(1, 1, L)
    scores = mx.array(np.repeat([5.0, 1.0, 3.0], 10).reshape(1, 1, L).astype(np.float32))
    keys = mx.zeros((1, 1, L, 4))
    view = CacheView(keys, keys, positions, scores, L, 0, None)
    ranked = ChunkSelector(n_sink=2, recent=0, chunk_size=10).rank(view)
    r = np.array(ranked).ravel()
    assert np.isinf(r[:10]).all() and (r[10:20] < r[20:]).all() and len(set(r[10:20])) == 1


def test_places_order_floats_with_ties_by_index():
    x = mx.array([[3.0, -1.0, 3.0, float("inf"), -0.0, 0.0, -5e30, 1e-40, float("-inf")]])
    assert _places(x).tolist() == [[6, 2, 7, 8, 3, 4, 1, 5, 0]]


def test_chunkkv_on_tied_scores_in_a_cache_keeps_whole_chunks():
    K, V = random_kv(B=1, H=2, S=221, seed=3)
    cache = PolicyCache("chunkkv:budget=80,n_sink=4,chunk_size=10,signal=proxy,when=stream")
    feed(cache, mx.ones_like(K), V, (200,) + (1,) * 21)  # identical keys: every score ties
    cache.settle()
    for row in np.array(cache.retained()[2]).reshape(-1, cache.n):
        _, counts = np.unique(row[row < 210] // 10, return_counts=True)
        assert (counts == 10).all()
