"""Per-slot key norms kept by the cache for CaM's cosine search: always the norms of the keys."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from kvpolicy_cam.gated_merge import cosine_to_all
from kvpolicy_core import PolicyCache
from kvpolicy_core.parts.base import CacheView
from kvpolicy_core.testing.conformance import feed, random_kv


def _check(cache):
    view = cache._view(0)
    assert view.key_norms is not None
    want = np.linalg.norm(np.array(view.keys, dtype=np.float32), axis=-1)
    np.testing.assert_allclose(np.array(view.key_norms), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "method", ["cam:merge=mean,gate=false,keys=true", "cam:keys=true", "cam:merge=sim_weighted,signal=proxy"]
)
def test_kept_norms_follow_appends_decode_writes_compaction_and_key_merges(method):
    cache = PolicyCache(f"{method},budget=10,n_sink=2")
    K, V = random_kv(B=2, H=3, S=60, D=8, seed=1)
    t = 0
    for S in (7, 1, 1, 5, 1, 1, 1, 9, 1, 1, 3, 1, 1, 1, 1):
        feed(cache, K[:, :, t : t + S], V[:, :, t : t + S], (S,))
        t += S
        _check(cache)
    assert int(cache.stats()["merges"]) > 0


def test_norms_are_recomputed_after_a_state_load_and_after_keys_are_assigned():
    cache = PolicyCache("cam:budget=8,n_sink=1,keys=true")
    K, V = random_kv(B=1, H=2, S=30, D=8, seed=2)
    feed(cache, K[:, :, :20], V[:, :, :20], (12, 1, 1, 1, 1, 1, 1, 1, 1))
    loaded = PolicyCache.from_state(cache.state, cache.meta_state)
    _check(loaded)
    loaded.keys = loaded.keys * 3.0  # assigned from outside: the kept norms must not go stale
    _check(loaded)
    feed(loaded, K[:, :, 20:25], V[:, :, 20:25], (1, 1, 1, 1, 1))
    _check(loaded)


def test_cosine_from_kept_norms_equals_the_cosine_of_unit_keys():
    K = mx.random.normal((2, 3, 20, 16), key=mx.random.key(4))
    K = K.at[:, :, 5].multiply(0.0)  # a zero key: cosine 0 with anything
    pos = mx.broadcast_to(mx.arange(20, dtype=mx.int32), (2, 3, 20))
    rows = mx.array(np.tile([[[3, 5]]], (2, 3, 1)).astype(np.int32))
    view = CacheView(K, K, pos, mx.zeros((2, 3, 20)), 20, 0, None)
    with_norms = view._replace(key_norms=mx.sqrt((K * K).sum(-1)))
    k = np.array(K)
    unit = k / np.maximum(np.linalg.norm(k, axis=-1, keepdims=True), 1e-12)
    want = np.einsum("bhed,bhld->bhel", np.take_along_axis(unit, np.array(rows)[..., None], axis=2), unit)
    for v in (view, with_norms):
        np.testing.assert_allclose(np.array(cosine_to_all(v, rows)), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("E", [1, 3])
def test_cosine_dot_products_are_those_of_the_rows_times_the_transposed_keys_bit_for_bit(E):
    """CaM's merge targets (argmax of the cosine, its min_sim threshold) depend on every bit of the dot products:
    however the product is laid out for speed, it is ``rows @ keys^T`` exactly, at the decode shape of a
    Llama-3.2-1B layer (8 KV heads of dim 64)."""
    L = 1537
    K = mx.random.normal((1, 8, L, 64), key=mx.random.key(5))
    pos = mx.broadcast_to(mx.arange(L, dtype=mx.int32), (1, 8, L))
    norms = mx.sqrt((K * K).sum(-1))
    rows = mx.random.randint(0, L, (1, 8, E), key=mx.random.key(6)).astype(mx.int32)
    view = CacheView(K, K, pos, mx.zeros((1, 8, L)), L, 0, None)._replace(key_norms=norms)
    picked = mx.take_along_axis(K, rows[..., None], axis=2)
    want = (picked @ K.swapaxes(-1, -2)) / (mx.take_along_axis(norms, rows, axis=2)[..., None] * norms[:, :, None, :])
    assert mx.array_equal(cosine_to_all(view, rows), want).item()
