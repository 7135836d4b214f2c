"""Merges on float16 caches whose values sit near the dtype's largest finite value: no merge raises on such legal
input, and none writes a non-finite value into the buffers (deltas are added in float32 and each sum saturates at
the dtype's finite range)."""

import math

import mlx.core as mx
import numpy as np
import pytest
from helpers import random_kv

from kvpolicy_core import PolicyCache
from kvpolicy_core.cache.slots import SlotStore
from kvpolicy_core.parts.base import MergeUpdate
from kvpolicy_core.testing.conformance import feed

#: each dtype's largest finite value
FINITE_MAX = {mx.float16: 65504.0, mx.bfloat16: 3.3895313892515355e38, mx.float32: 3.4028234663852886e38}


def near_max(dtype=mx.float16, S=40, seed=0):
    """Random keys, and values of +-65000 (float16's max is 65504) with random signs."""
    keys, _ = random_kv(B=1, H=2, S=S, D=8, seed=seed, dtype=dtype)
    signs = np.sign(np.random.default_rng(seed).standard_normal((1, 2, S, 8)))
    return keys, mx.array((signs * 65000).astype(np.float32)).astype(dtype)


@pytest.mark.parametrize(
    "method",
    [
        "cam:merge=mass_blend,after=1",
        "cam:merge=mass,after=1",
        "cam:merge=paper,gate=false",
        "cam:merge=paper",
        "cam:merge=sim_weighted,gate=false",
        "cam:merge=mean,gate=false,merge_keys=true",
    ],
)
@pytest.mark.parametrize("when", ["prompt_end", "stream"])
def test_merges_near_float16s_maximum_neither_raise_nor_write_non_finite_values(method, when):
    """The end-of-prompt cut (a prompt chunk's eviction, value-checked), the checked decode evictions and the
    unchecked ones after them: every value of the cache stays finite."""
    keys, values = near_max()
    cache = PolicyCache(f"{method},budget=16,n_sink=2,signal=proxy,when={when}")
    feed(cache, keys, values, (30,) + (1,) * 10, queries=keys)
    assert cache.offset == 40 and (cache.merges > 0 or "merge=mass," in method)  # mass: rates of 0 merge nothing
    for x in (cache.keys[..., : cache.n, :], cache.values[..., : cache.n, :]):
        assert mx.all(mx.isfinite(x)).item()


def test_a_merged_sum_past_float16s_range_saturates_at_its_largest_finite_value():
    """SlotStore.add: deltas finite in float32 whose sum with the element leaves float16's range store +-65504;
    repeated targets sum in float32 (60000 + 10000 - 10000 is 60000, not inf); other elements add as usual."""
    store = SlotStore()
    keys = mx.zeros((1, 1, 3, 2), mx.float16)
    values = mx.array([[[[60000.0, 1.0], [-60000.0, 2.0], [3.0, 4.0]]]]).astype(mx.float16)
    store.append(keys, values, 0, steady=8)
    one = MergeUpdate(mx.array([[[0]]], dtype=mx.int32), d_values=mx.array([[[[10000.0, 0.5]]]]))
    store.add(one)  # one target per row: the decode path
    assert store.values[0, 0, 0].tolist() == [FINITE_MAX[mx.float16], 1.5]
    t = mx.array([[[1, 1, 2, 2]]], dtype=mx.int32)  # repeated targets: the prompt-chunk path
    d = mx.array([[[[-10000.0, 0.0], [10000.0, 0.0], [-1e6, 0.5], [0.0, 0.5]]]])
    store.add(MergeUpdate(t, d_values=d))
    assert store.values[0, 0, 1].tolist() == [-60000.0, 2.0]  # summed in float32 first: no overflow on the way
    assert store.values[0, 0, 2].tolist() == [-FINITE_MAX[mx.float16], 5.0]
    assert mx.all(mx.isfinite(store.values)).item()


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_sums_saturate_in_every_dtype(dtype):
    store = SlotStore()
    big = FINITE_MAX[dtype]
    store.append(mx.zeros((1, 1, 1, 1), dtype), mx.full((1, 1, 1, 1), big, dtype), 0, steady=4)
    store.add(MergeUpdate(mx.array([[[0]]], dtype=mx.int32), d_values=mx.full((1, 1, 1, 1), big)))
    assert store.values.dtype == dtype and math.isfinite(store.values[0, 0, 0, 0].item())
