"""NaN, inf and degenerate tensors: non-finite tokens never contaminate finite ones, +inf scores never evict
sinks, all-zero keys and scores give a defined, deterministic cache."""

import math

import mlx.core as mx
import numpy as np
import pytest
from helpers import SHIPPED_METHODS, random_kv, with_fields

from kvpolicy_core import MethodSpec, PolicyCache, PolicyConfig, hookimpl
from kvpolicy_core.parts.base import Scorer
from kvpolicy_core.plugin.discovery import register_plugin, unregister_plugin
from kvpolicy_core.testing.conformance import feed

MERGING = [with_fields(m, "budget=8,n_sink=2") for m in SHIPPED_METHODS]


@pytest.mark.parametrize("method", MERGING)
@pytest.mark.parametrize("poison", [math.nan, math.inf])
def test_non_finite_tokens_never_contaminate_finite_retained_tokens(method, poison):
    keys, values = random_kv(B=2, H=2, S=40, D=8, seed=4)
    k, v = np.array(keys), np.array(values)
    k[:, :, [5, 17, 30]] = poison
    v[:, :, [9, 17, 33]] = poison
    cache = PolicyCache(method)
    feed(cache, mx.array(k), mx.array(v), (12,) + (1,) * 28)
    rk, rv, pos, scores = (np.array(x) for x in cache.retained())
    bad = np.isin(pos, [5, 9, 17, 30, 33])
    assert np.isfinite(rk[~bad]).all() and np.isfinite(rv[~bad]).all()
    assert not np.isnan(scores).any() and cache.tokens_kept == 8


@pytest.mark.parametrize("method", MERGING)
def test_all_zero_keys_and_all_zero_scores_are_defined(method):
    zeros = mx.zeros((1, 2, 30, 8))
    values = random_kv(B=1, H=2, S=30, D=8)[1]
    cache = PolicyCache(method)
    feed(cache, zeros, values, (10,) + (1,) * 20)
    rk, rv, pos, scores = (np.array(x) for x in cache.retained())
    assert np.isfinite(rv).all() and np.isfinite(scores).all() and pos.shape[-1] == 8
    again = PolicyCache(method)
    feed(again, zeros, values, (10,) + (1,) * 20)
    np.testing.assert_array_equal(np.array(again.retained()[2]), pos)  # deterministic tie-breaking


def test_one_non_finite_key_does_not_zero_the_other_tokens_scores():
    keys, values = random_kv(B=1, H=2, S=12, D=8, seed=5)
    k = np.array(keys)
    k[:, :, 3] = np.nan
    cache = PolicyCache("h2o:budget=32")
    feed(cache, mx.array(k), values, (12,))
    scores = np.array(cache.scores)
    finite = [j for j in range(12) if j != 3]
    # proxy scores: every earlier finite token receives mass from each later finite key
    assert (scores[..., [0, 1, 2, 4, 5]] > 0).all(), scores
    clean = PolicyCache("h2o:budget=32")
    feed(clean, keys, values, (12,))
    assert np.isfinite(scores[..., finite]).all()


class InfScorer(Scorer):
    def on_append(self, view, new_keys, new_positions):
        return mx.full(view.scores.shape, math.inf)


class InfPlugin:
    @hookimpl
    def register_scorers(self, register):
        register("all_inf", InfScorer)

    @hookimpl
    def register_methods(self, register):
        register(MethodSpec("allinf", PolicyConfig, "all_inf", "lowest_score", "drop"))


def test_infinite_scores_never_evict_sinks():
    register_plugin(InfPlugin(), "inf")
    try:
        cache = PolicyCache("allinf:budget=8,n_sink=2,recent=1")
        feed(cache, *random_kv(S=30), (10,) + (1,) * 20)
        pos = np.array(cache.retained()[2])
        assert (pos[..., :2] == [0, 1]).all() and (pos[..., -1] == 29).all()
    finally:
        unregister_plugin("inf")
