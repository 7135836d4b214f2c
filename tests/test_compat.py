"""Forms of 0.1 and 0.2 removed in 0.3: a plugin that still uses one gets one clear error naming the form and its
replacement (CHANGELOG), never a silent change."""

import re

import mlx.core as mx
import pytest
from helpers import random_kv

from kvpolicy_core import MergeUpdate, MethodSpec, PluginError, PolicyCache, PolicyConfig, hookimpl, pick_lowest
from kvpolicy_core.config.policy import build_policy
from kvpolicy_core.parts.base import Disposition, Scorer, Selector
from kvpolicy_core.plugin.discovery import register_plugin, unregister_plugin
from kvpolicy_core.testing.conformance import feed


class OldSelector:
    """0.1 form: select() only."""

    @classmethod
    def from_config(cls, config):
        return cls()

    def select(self, view, n_evict):
        return pick_lowest(-view.positions.astype(mx.float32), n_evict)


class OldMerge:
    """0.1 form: MergeUpdate with positional draws/merges counters (now the 5th field is ``stats``)."""

    @classmethod
    def from_config(cls, config):
        return cls()

    def dispose(self, view, losers, key):
        zeros = mx.zeros((*losers.shape, view.values.shape[-1]), view.values.dtype)
        return MergeUpdate(losers * 0 + 1, None, zeros, None, mx.array(2))


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


def test_a_selector_with_the_removed_select_form_is_refused_naming_rank(old_plugin):
    with pytest.raises(PluginError, match=r"old_newest.*select\(view, n_evict\).*removed in 0.3.*rank\(view\)"):
        PolicyCache("oldsel:budget=8,n_sink=1,recent=1")


def test_merge_update_counters_in_the_removed_fields_are_refused_naming_stats(old_plugin):
    keys, values = random_kv(B=1, H=2, S=30, D=4)
    cache = PolicyCache("oldmerge:budget=8,n_sink=1,recent=1")
    with pytest.raises(PluginError, match=r"old_merge.*0.1 form: draws/merges were removed in 0.3.*stats="):
        feed(cache, keys, values, (1,) * 30)


class SixFields(Disposition):
    """The whole 0.1 call: ``MergeUpdate(t, dk, dv, ds, draws, merges)``, positional or with keywords (after reading
    ``view.offset``, whose hint must not be what the error says)."""

    keywords = False

    def dispose(self, view, losers, key):
        zeros = mx.zeros((*losers.shape, view.values.shape[-1]))
        t = mx.minimum(losers * 0 + 1 + view.offset * 0, 1)
        if SixFields.keywords:
            return MergeUpdate(t, None, zeros, None, draws=mx.array(2), merges=mx.array(1))
        return MergeUpdate(t, None, zeros, None, mx.array(2), mx.array(1))


@pytest.mark.parametrize("keywords", [False, True])
def test_the_six_field_0_1_merge_update_is_refused_naming_the_removed_form(keywords):
    class Six:
        @hookimpl
        def register_dispositions(self, register):
            register("six_fields", SixFields)

        @hookimpl
        def register_methods(self, register):
            register(MethodSpec("sixfields", PolicyConfig, "cumulative_attention", "lowest_score", "six_fields"))

    register_plugin(Six(), "six")
    SixFields.keywords = keywords
    try:
        cache = PolicyCache("sixfields:budget=8,n_sink=1,recent=1,when=stream")
        keys, values = random_kv(B=1, H=2, S=12, D=4)
        with pytest.raises(PluginError) as err:
            feed(cache, keys, values, (10, 1))
        message = str(err.value)
        assert "disposition 'six_fields' of plugin 'six'" in message
        assert "MergeUpdate(targets, d_keys, d_values, d_scores, draws, merges) is the 0.1 form" in message
        assert "stats={'gate_draws'" in message and "view.offset" not in message and "of shape" not in message
    finally:
        unregister_plugin("six")


@pytest.mark.parametrize(
    "kind, flag, field",
    [
        ("scorer", "needs_attention", "Needs(attention=True)"),
        ("scorer", "trim_exact", "Needs(trim_exact=True)"),
        ("disposition", "uses_log_weights", "Needs(log_weights=True)"),
        ("selector", "batch_rows", "Needs(batch_rows=True)"),
        ("disposition", "compile_decode", "traits(compile_decode=True)"),
        ("disposition", "uses_key_norms", "traits(key_norms=True)"),
    ],
)
def test_a_removed_class_flag_is_refused_naming_its_replacement(kind, flag, field):
    base = {"scorer": Scorer, "selector": Selector, "disposition": Disposition}[kind]
    old = type(f"Old{kind.title()}", (base,), {flag: True, "rank": lambda self, view: view.scores})
    policy = build_policy("h2o:budget=8,signal=proxy")
    with pytest.raises(PluginError, match=rf"Old{kind.title()} sets .{flag}..*removed in 0.3.*{re.escape(field)}"):
        PolicyCache(policy._replace(**{kind: old()}))


def test_counters_and_config_fields_by_name():
    cache = PolicyCache("h2o:budget=8")
    assert cache.merges == 0 and cache.gate_draws == 0 and cache.stats() == {}
    assert cache.budget == 8 and cache.n_sink == 4
    with pytest.raises(AttributeError, match="no attribute 'nonsense'"):
        cache.nonsense
