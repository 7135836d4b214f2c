"""The example plugin passes kvpolicy's conformance suite (one line per method), and its merge
disposition, written with additive deltas, equals the same merge written as new target values."""

import mlx.core as mx
import numpy as np

from kvpolicy_core import CacheView
from kvpolicy_core.testing.conformance import PolicyConformance, random_kv
from kvpolicy_streaming.neighbour_merge import NeighbourMergeDisposition


class TestStreamingLLM(PolicyConformance):
    method = "streamingllm:budget=16,n_sink=2"


class TestStreamingMerge(PolicyConformance):
    method = "streamingmerge:budget=16,n_sink=2"


class TestTova(PolicyConformance):
    method = "tova:budget=16,n_sink=2"


class TestTovaProxy(PolicyConformance):
    method = "tova:budget=16,n_sink=2,signal=proxy,recent=1"


def new_values_way(keys, values, positions, losers, n_sink):
    """The same disposition written as "return the new value of every target" (numpy, one head)."""
    keys, values = keys.copy(), values.copy()
    groups = {}
    for l in losers:
        later = [
            j
            for j in range(len(positions))
            if positions[j] > positions[l] and j not in losers and positions[j] >= n_sink
        ]
        if later:
            groups.setdefault(min(later, key=lambda j: positions[j]), []).append(l)
    for t, ls in groups.items():  # plain average of the target and its losers
        keys[t] = (keys[t] + keys[ls].sum(0)) / (1 + len(ls))
        values[t] = (values[t] + values[ls].sum(0)) / (1 + len(ls))
    return keys, values, sum(len(ls) for ls in groups.values())


def test_delta_form_equals_the_new_values_form():
    K, V = random_kv(B=1, H=1, S=12, D=4, seed=3)
    positions = mx.array([[[0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]], mx.int32)
    view = CacheView(K, V, positions, mx.ones((1, 1, 12)), 12, 0, None)
    losers = mx.array([[[2, 3, 5, 11]]], mx.int32)  # 2 and 3 share target 4; 11 has no later survivor
    u = NeighbourMergeDisposition(n_sink=2).dispose(view, losers, None)
    t = np.array(u.targets[0, 0])
    got_k, got_v = np.array(K[0, 0]), np.array(V[0, 0])
    np.add.at(got_k, t, np.array(u.d_keys[0, 0]))
    np.add.at(got_v, t, np.array(u.d_values[0, 0]))
    want_k, want_v, merges = new_values_way(np.array(K[0, 0]), np.array(V[0, 0]), list(range(12)), [2, 3, 5, 11], 2)
    np.testing.assert_allclose(got_k, want_k, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(got_v, want_v, rtol=1e-6, atol=1e-6)
    assert u.stats["merges"].item() == merges == 3
