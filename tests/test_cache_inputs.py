"""The cache refuses keys and values it cannot hold (and a window it cannot keep) with an error naming what it
accepts, and is left as it was."""

import mlx.core as mx
import numpy as np
import pytest

from kvpolicy_core import PolicyCache


def test_a_window_below_one_is_rejected():
    for bad in (-3, 0, True, 2.5):
        with pytest.raises(ValueError, match="window"):
            PolicyCache("h2o:budget=8", window=bad)


def test_zero_new_tokens_is_a_clear_error_not_a_part_failure():
    for method in ("h2o:budget=8", "random:budget=8"):
        cache = PolicyCache(method)
        with pytest.raises(ValueError, match="S=0"):
            cache.update_and_fetch(mx.zeros((1, 2, 0, 8)), mx.zeros((1, 2, 0, 8)))
        assert cache.offset == 0 and cache.keys is None


def test_update_and_fetch_accepts_only_floating_mx_arrays():
    cache = PolicyCache("h2o:budget=8")
    k = np.zeros((1, 2, 3, 8), np.float32)
    with pytest.raises(TypeError, match=r"keys must be an mlx.core.array \(got numpy.ndarray\)"):
        cache.update_and_fetch(k, k)
    with pytest.raises(TypeError, match=r"keys must have a floating dtype .*got int32"):
        cache.update_and_fetch(mx.zeros((1, 2, 3, 8), mx.int32), mx.zeros((1, 2, 3, 8)))
    with pytest.raises(TypeError, match=r"values must have a floating dtype"):
        cache.update_and_fetch(mx.zeros((1, 2, 3, 8)), mx.zeros((1, 2, 3, 8), mx.bool_))
    assert cache.offset == 0 and cache.keys is None
    cache.update_and_fetch(mx.array(k), mx.array(k))
    assert cache.offset == 3


@pytest.mark.parametrize("method", ["h2o:budget=8,signal=proxy", "cam:budget=8,signal=proxy", "random"])
@pytest.mark.parametrize("dims", [(0, 4), (4, 0), (0, 0)])
def test_a_zero_head_dim_is_refused_when_the_cache_sees_the_keys(method, dims):
    cache = PolicyCache(method)
    with pytest.raises(ValueError, match=r"^layer 0: .*head dim of at least 1.*\(1, 2, 3, 0\)"):
        cache.update_and_fetch(mx.zeros((1, 2, 3, dims[0])), mx.zeros((1, 2, 3, dims[1])))
    assert cache.offset == 0
