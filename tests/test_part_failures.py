"""A part that raises, or whose lazy graph fails only when MLX evaluates it, is a PluginError naming the part
and its plugin; the cache is rolled back, never corrupted, and keeps working."""

import mlx.core as mx
import numpy as np
import pytest
from helpers import VOCAB, random_kv, run_chunks, tiny_llama

from kvpolicy_core import KVCacheBuilder, MethodSpec, PluginError, PolicyCache, PolicyConfig, hookimpl
from kvpolicy_core.parts.base import Scorer
from kvpolicy_core.parts.cumulative_attention import CumulativeAttentionScorer
from kvpolicy_core.plugin.discovery import register_plugin, unregister_plugin
from kvpolicy_core.testing.conformance import feed


class Boom(Exception):
    pass


class FlakyScorer(CumulativeAttentionScorer):
    calls = 0
    fail_at = 10**9

    @classmethod
    def from_config(cls, config):
        return cls("proxy")

    def on_append(self, view, new_keys, new_positions):
        FlakyScorer.calls += 1
        if FlakyScorer.calls == FlakyScorer.fail_at:
            raise Boom("scorer exploded")
        return super().on_append(view, new_keys, new_positions)


class FlakyDisposition:
    @classmethod
    def from_config(cls, config):
        return cls()

    def dispose(self, view, losers, key):
        raise Boom("disposition exploded")


class FaultyPlugin:
    @hookimpl
    def register_scorers(self, register):
        register("flaky", FlakyScorer)

    @hookimpl
    def register_dispositions(self, register):
        register("flaky_drop", FlakyDisposition)

    @hookimpl
    def register_methods(self, register):
        register(MethodSpec("flaky", PolicyConfig, "flaky", "lowest_score", "drop"))
        register(MethodSpec("flakydisp", PolicyConfig, "cumulative_attention", "lowest_score", "flaky_drop"))


@pytest.fixture
def faulty():
    register_plugin(FaultyPlugin(), "faulty")
    yield
    unregister_plugin("faulty")


def snapshot(cache):
    return [
        np.array(x)
        for x in (
            cache.keys[..., : cache.n, :],
            cache.values[..., : cache.n, :],
            cache.positions[..., : cache.n],
            cache.scores,
        )
    ] + [cache.n, cache.offset]


def same(a, b):
    return all(np.array_equal(x, y) for x, y in zip(a, b))


def test_a_scorer_failure_names_the_plugin_and_leaves_the_cache_untouched(faulty):
    model = tiny_llama(seed=2)
    caches = KVCacheBuilder.for_model(model, "flaky:budget=8,n_sink=2")
    toks = mx.random.randint(0, VOCAB, (1, 30), key=mx.random.key(3))
    run_chunks(model, caches, toks, [12] + [1] * 5)
    before = [snapshot(c) for c in caches]
    FlakyScorer.calls, FlakyScorer.fail_at = 0, 1
    with pytest.raises(PluginError) as e:
        model(toks[:, 17:18], cache=caches)
    assert "scorer 'flaky' of plugin 'faulty'" in str(e.value) and "scorer exploded" in str(e.value)
    assert same(snapshot(caches[0]), before[0])  # the failing layer rolled back
    FlakyScorer.fail_at = 10**9
    for c, b in zip(caches, before):  # restore the layer that did update, then continue cleanly
        if not same(snapshot(c), b):
            c.keys, c.values = mx.array(b[0]), mx.array(b[1])
            c.positions, c.scores, c.n, c.offset = mx.array(b[2]), mx.array(b[3]), b[4], b[5]
    out = run_chunks(model, caches, toks[:, 17:], [1] * 13)
    assert not mx.isnan(out).any().item() and all(c.tokens_kept == 8 for c in caches)


def test_a_disposition_failure_names_the_plugin_and_never_corrupts(faulty):
    cache = PolicyCache("flakydisp:budget=8,n_sink=2")
    keys, values = random_kv(S=20)
    feed(cache, keys, values, (8,))
    before = snapshot(cache)
    feed(cache, keys[:, :, 8:], values[:, :, 8:], (1,))  # reaches budget + 1: no eviction yet
    mid = snapshot(cache)
    with pytest.raises(PluginError, match="disposition 'flaky_drop' of plugin 'faulty'.*disposition exploded"):
        cache.update_and_fetch(keys[:, :, 9:10], values[:, :, 9:10])
    assert same(snapshot(cache), mid) and not same(mid, before)
    with pytest.raises(PluginError):
        cache.settle()
    assert same(snapshot(cache), mid)


class LazyFailScorer(Scorer):
    """Scores of the right shape whose graph fails only when MLX evaluates it (a float-index gather)."""

    def on_append(self, view, new_keys, new_positions):
        idx = mx.zeros(view.scores.shape, mx.float32)
        return mx.take_along_axis(view.scores, idx, axis=2)


class LazyPlugin:
    @hookimpl
    def register_scorers(self, register):
        register("lazy_fail", LazyFailScorer)

    @hookimpl
    def register_methods(self, register):
        register(MethodSpec("lazyfail", PolicyConfig, "lazy_fail", "lowest_score", "drop"))


def test_a_lazy_error_in_a_part_is_caught_in_the_transaction_and_does_not_poison_the_cache():
    register_plugin(LazyPlugin(), "lazy")
    try:
        cache = PolicyCache("lazyfail:budget=8,n_sink=1,recent=1")
        keys, values = random_kv(S=4)
        with pytest.raises(PluginError, match="scorer 'lazy_fail' .* cannot evaluate"):
            cache.update_and_fetch(keys, values)
        assert cache.offset == 0 and cache.keys is None  # rolled back, nothing lazy kept
        good = PolicyCache("h2o:budget=8")
        feed(good, keys, values, (4,))
        mx.eval(good.scores)
    finally:
        unregister_plugin("lazy")
