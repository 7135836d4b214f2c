"""Plugins written against kvpolicy 0.1.0 keep working in 0.2.0 (with a DeprecationWarning where a form changed)."""

import mlx.core as mx
import numpy as np
import pytest

from kvpolicy_core import MergeUpdate, MethodSpec, PolicyCache, PolicyConfig, hookimpl, pick_lowest
from kvpolicy_core.plugin.discovery import register_plugin, unregister_plugin
from kvpolicy_core.testing.conformance import feed, random_kv


class OldSelector:
    """0.1.0 form: select() only, and no look at view.dead: the cache still evicts dead slots first."""

    @classmethod
    def from_config(cls, config):
        return cls()

    def select(self, view, n_evict):
        return pick_lowest(-view.positions.astype(mx.float32), n_evict)  # newest first, ignores `dead`


class OldMerge:
    """0.1.0 form: MergeUpdate with positional draws/merges counters."""

    @classmethod
    def from_config(cls, config):
        return cls()

    def dispose(self, view, losers, key):
        zeros = mx.zeros((*losers.shape, view.values.shape[-1]), view.values.dtype)
        return MergeUpdate(losers * 0 + 1, None, zeros, None, mx.array(2), mx.array(1))


class OldPlugin:
    @hookimpl
    def register_selectors(self, register):
        register("old_newest", OldSelector)

    @hookimpl
    def register_dispositions(self, register):
        register("old_merge", OldMerge)

    @hookimpl
    def register_methods(self, register):
        register(MethodSpec("oldsel", PolicyConfig, "cumulative_attention", "old_newest", "drop"))
        register(MethodSpec("oldmerge", PolicyConfig, "cumulative_attention", "lowest_score", "old_merge"))


@pytest.fixture
def old_plugin():
    register_plugin(OldPlugin(), "old")
    yield
    unregister_plugin("old")


def test_old_merge_update_counters_still_count_with_a_deprecation_warning(old_plugin):
    keys, values = random_kv(B=1, H=2, S=30, D=4)
    cache = PolicyCache("oldmerge:budget=8,n_sink=1,recent=1")
    with pytest.warns(DeprecationWarning, match="stats="):
        feed(cache, keys, values, (1,) * 30)
    cache.settle()
    assert cache.stats() == {"gate_draws": 2 * 22, "merges": 22} and cache.merges == 22 and cache.gate_draws == 44


def test_old_selector_on_a_window_layer_gets_window_dead_slots_evicted_first(old_plugin):
    keys, values = random_kv(B=1, H=2, S=24, D=4)
    cache = PolicyCache("oldsel:budget=8,n_sink=0,recent=0", window=6)
    feed(cache, keys, values, (16,) + (1,) * 8)
    cache.settle()
    pos = np.array(cache.retained()[2])
    # with 24 seen and window 6, every slot at position <= 18 is dead: the cache evicts those first
    assert pos.shape[-1] == 8 and (pos[..., -5:] == np.arange(19, 24)).all()


def test_counters_and_config_fields_by_name():
    cache = PolicyCache("h2o:budget=8")
    assert cache.merges == 0 and cache.gate_draws == 0 and cache.stats() == {}  # 0.1.0 names read 0
    assert cache.budget == 8 and cache.n_sink == 4
    with pytest.raises(AttributeError, match="no attribute 'nonsense'"):
        cache.nonsense
