"""A plugin part's output is checked before it reaches the cache: loser indices outside the cache, repeated or
of the wrong dtype or shape, a sink chosen, merge targets outside the cache, deltas of the wrong shape or
dtype, non-finite in the cache's dtype, outputs that are not mx.array: each is a PluginError saying what is
wrong, the call is rolled back and the next one works."""

import math

import mlx.core as mx
import numpy as np
import pytest
from helpers import random_kv

from kvpolicy_core import MergeUpdate, MethodSpec, PluginError, PolicyCache, PolicyConfig, hookimpl
from kvpolicy_core.parts.base import Scorer, Selector
from kvpolicy_core.parts.lowest_score import LowestScoreSelector
from kvpolicy_core.plugin.discovery import register_plugin, unregister_plugin
from kvpolicy_core.testing.conformance import feed


# ----------------------------------------------------------------------------- loser indices and merge updates
class BadSelector(Selector):
    mode = "big"

    def select(self, view, n_evict):
        B, H, L = view.scores.shape
        base = mx.broadcast_to(mx.arange(n_evict, dtype=mx.int32), (B, H, n_evict))
        return {
            "big": base + 10**6,
            "neg": base - 1,
            "dup": base * 0 + 2,
            "float": base.astype(mx.float32) + 2,
            "list": [[[0]]],
        }[BadSelector.mode]


class BadMerge:
    mode = "big"

    @classmethod
    def from_config(cls, config):
        return cls()

    def dispose(self, view, losers, key):
        B, H, E = losers.shape
        t = mx.full((B, H, E), view.scores.shape[-1] + 3 if BadMerge.mode == "big" else 0, mx.int32)
        dv = mx.zeros((B, H, E, view.values.shape[-1] + (1 if BadMerge.mode == "shape" else 0)))
        return {"dict": {"targets": t}}.get(BadMerge.mode, MergeUpdate(t, None, dv, None))


class SinkEatingSelector(LowestScoreSelector):
    """A plugin's subclass of core's selector that ranks sinks lowest: it inherits ``valid_by_construction``
    from core's class but is a plugin part, so its output is checked like any plugin's."""

    def rank(self, view):
        return mx.where(view.positions < self.n_sink, -math.inf, super().rank(view))


class BadPlugin:
    @hookimpl
    def register_selectors(self, register):
        register("bad_sel", BadSelector)
        register("bad_lowest", SinkEatingSelector)

    @hookimpl
    def register_dispositions(self, register):
        register("bad_merge", BadMerge)

    @hookimpl
    def register_methods(self, register):
        register(MethodSpec("badsel", PolicyConfig, "cumulative_attention", "bad_sel", "drop"))
        register(MethodSpec("badmerge", PolicyConfig, "cumulative_attention", "lowest_score", "bad_merge"))
        register(MethodSpec("badlowest", PolicyConfig, "cumulative_attention", "bad_lowest", "drop"))


@pytest.fixture
def bad_plugin():
    register_plugin(BadPlugin(), "bad")
    yield
    unregister_plugin("bad")


@pytest.mark.parametrize(
    "mode, needle",
    [
        ("big", "outside the cache"),
        ("neg", "outside the cache"),
        ("dup", "distinct"),
        ("float", "dtype float32"),
        ("list", "shape"),
    ],
)
@pytest.mark.parametrize("chunks", [(12, 1), (12, 6)])  # the decode write and the chunked compaction
def test_bad_loser_indices_are_a_plugin_error_and_the_cache_stays_usable(bad_plugin, mode, needle, chunks):
    BadSelector.mode = mode
    keys, values = random_kv(S=20)
    cache = PolicyCache("badsel:budget=8,n_sink=1,recent=1")
    feed(cache, keys[:, :, :12], values[:, :, :12], chunks[:1])
    with pytest.raises(PluginError, match=needle):
        feed(cache, keys[:, :, 12:], values[:, :, 12:], chunks[1:])
    assert cache.offset == 12 and cache.n == 12  # rolled back: nothing half-applied, nothing corrupted
    assert mx.array_equal(cache.keys[..., :12, :], keys[:, :, :12]) and cache.scores.shape[-1] == 12


def test_a_plugin_subclass_of_cores_selector_is_still_checked(bad_plugin):
    """Core's own selector skips its decode checks (valid by construction); a plugin's subclass does not."""
    keys, values = random_kv(S=20)
    cache = PolicyCache("badlowest:budget=8,n_sink=1,recent=1")
    feed(cache, keys[:, :, :8], values[:, :, :8], (8,))
    with pytest.raises(PluginError, match="sink"):
        feed(cache, keys[:, :, 8:12], values[:, :, 8:12], (1, 1, 1, 1))


@pytest.mark.parametrize(
    "mode, needle",
    [("big", "merge targets outside"), ("shape", "d_values of shape"), ("dict", "expected a MergeUpdate")],
)
def test_bad_merge_updates_are_a_plugin_error(bad_plugin, mode, needle):
    BadMerge.mode = mode
    keys, values = random_kv(S=20)
    cache = PolicyCache("badmerge:budget=8,n_sink=1,recent=1")
    feed(cache, keys[:, :, :12], values[:, :, :12], (12,))
    with pytest.raises(PluginError, match=needle):
        feed(cache, keys[:, :, 12:13], values[:, :, 12:13], (1,))
    assert cache.offset == 12


# ----------------------------------------------------------------------------- the update checks
def test_an_updates_check_code_says_broken_changed_or_nothing():
    """update_checks: one code per update (4: a target outside [0, L); 2: a non-finite delta; 1: a nonzero delta;
    0: the update changes nothing), and nonfinite_flags decides a non-finite delta exactly, per target row."""
    from kvpolicy_core.cache.checks import nonfinite_flags, scalar, update_checks

    base = mx.array([[[[1.0, 2.0], [math.nan, math.inf], [3.0, 4.0]]]])  # [1, 1, 3, 2]: row 1 non-finite
    t = mx.array([[[2]]], dtype=mx.int32)
    zero, one, nan = mx.zeros((1, 1, 1, 2)), mx.ones((1, 1, 1, 2)), mx.full((1, 1, 1, 2), math.nan)

    def code(targets, d, lw=None):
        c, _ = update_checks(targets, scalar(2), [(d, base)], lw)
        return c.item()

    assert code(t, zero) == 0 and code(t, one) == 1 and code(t, nan) == 2
    assert code(mx.array([[[3]]], dtype=mx.int32), zero) == 4 and code(mx.array([[[-1]]], dtype=mx.int32), nan) == 6
    assert code(t, zero.astype(mx.int32)) == 0 and code(t, one.astype(mx.int32)) == 1  # integer deltas
    assert code(t, zero, mx.array([[[math.nan]]])) == 0  # a NaN log-weight delta is made 0: nothing changes
    assert code(t, zero, mx.array([[[0.5]]])) == 1
    assert nonfinite_flags(t, 2, [(nan, base)]) == [True]  # a finite row would get NaN: broken
    half = base.astype(mx.float16)  # checked as added: 1e6 is inf in float16
    assert update_checks(t, scalar(2), [(one * 1e6, half)], None)[0].item() == 2
    assert nonfinite_flags(t, 2, [(one * 1e6, half)]) == [True]
    assert nonfinite_flags(mx.array([[[1]]], dtype=mx.int32), 2, [(nan, base)]) == [False]  # already non-finite


# ----------------------------------------------------------------------------- deltas, targets and sinks
class OddMerge:
    """A disposition that misbehaves once (``mode``), then merges properly."""

    mode = None

    @classmethod
    def from_config(cls, config):
        return cls()

    def dispose(self, view, losers, key):
        B, H, E = losers.shape
        t = mx.zeros((B, H, E), mx.int32) + 1
        dv = mx.ones((B, H, E, view.values.shape[-1]))
        mode, OddMerge.mode = OddMerge.mode, None
        if mode == "nan":
            dv = dv * math.nan
        elif mode == "big":
            dv = dv * 1e6
        elif mode in ("wide_target", "wide_negative"):
            t = mx.zeros((B, H, E), mx.int64) + (2**32 + 1 if mode == "wide_target" else -(2**32) + 1)
        elif mode == "inf_scores":
            return MergeUpdate(t, None, dv, mx.full((B, H, E), math.inf))
        elif mode in ("bool", "complex"):
            dv = dv.astype(mx.bool_ if mode == "bool" else mx.complex64)
        elif mode == "draws_str":
            return MergeUpdate(t, None, dv, None, draws="three")
        elif mode == "stats_float_list":
            return MergeUpdate(t, None, dv, None, stats={"merges": [1.5]})
        return MergeUpdate(t, None, dv, None)


class SinkSelector(Selector):
    def select(self, view, n_evict):
        B, H, L = view.scores.shape
        return mx.broadcast_to(mx.arange(n_evict, dtype=mx.int32), (B, H, n_evict))  # slot 0: position 0, a sink


class OddPlugin:
    @hookimpl
    def register_selectors(self, register):
        register("sink_sel", SinkSelector)

    @hookimpl
    def register_dispositions(self, register):
        register("odd_merge", OddMerge)

    @hookimpl
    def register_methods(self, register):
        register(MethodSpec("oddmerge", PolicyConfig, "cumulative_attention", "lowest_score", "odd_merge"))
        register(MethodSpec("sinksel", PolicyConfig, "cumulative_attention", "sink_sel", "drop"))


@pytest.fixture
def odd_plugin():
    register_plugin(OddPlugin(), "odd")
    yield
    unregister_plugin("odd")


@pytest.mark.parametrize(
    "mode, needle",
    [
        ("nan", "d_values with non-finite values"),
        ("inf_scores", "d_scores with non-finite values"),
        ("bool", "d_values of dtype"),
        ("complex", "d_values of dtype"),
        ("draws_str", "counter 'gate_draws'"),
        ("stats_float_list", "counter 'merges'"),
    ],
)
@pytest.mark.parametrize("chunks", [(1,), (3,)])  # the decode write and the chunked compaction
def test_a_bad_merge_is_a_plugin_error_rolled_back_and_the_next_call_works(odd_plugin, mode, needle, chunks):
    keys, values = random_kv(S=20)
    cache = PolicyCache("oddmerge:budget=8,n_sink=1,recent=1")
    feed(cache, keys[:, :, :12], values[:, :, :12], (12,))
    before = [mx.array(x) for x in (cache.keys, cache.values, cache.scores)]
    OddMerge.mode = mode
    with pytest.raises(PluginError, match=needle):
        feed(cache, keys[:, :, 12 : 12 + chunks[0]], values[:, :, 12 : 12 + chunks[0]], chunks)
    assert cache.offset == 12 and all(
        mx.array_equal(a, b) for a, b in zip(before, (cache.keys, cache.values, cache.scores))
    )
    feed(cache, keys[:, :, 12:], values[:, :, 12:], (1,) * 8)  # the next calls work: nothing lazy was left behind
    mx.eval(cache.keys, cache.values, cache.scores, cache.stats())
    assert cache.offset == 20 and mx.all(mx.isfinite(cache.values[..., : cache.n, :])).item()


def test_a_selector_evicting_a_sink_is_a_plugin_error(odd_plugin):
    keys, values = random_kv(S=20)
    cache = PolicyCache("sinksel:budget=8,n_sink=2,recent=1")
    feed(cache, keys[:, :, :12], values[:, :, :12], (12,))
    with pytest.raises(PluginError, match="sink"):
        feed(cache, keys[:, :, 12:13], values[:, :, 12:13], (1,))
    assert cache.offset == 12 and cache.n == 12
    ok = PolicyCache("sinksel:budget=8,n_sink=0,recent=1")  # without sinks, slot 0 is a fair choice
    feed(ok, keys, values, (12,) + (1,) * 8)
    assert ok.offset == 20


def test_targets_past_int32_are_out_of_range_not_wrapped_into_the_cache(odd_plugin):
    """An int64 target of 2**32 + 1 is outside the cache (a cast to int32 would have made it slot 1)."""
    keys, values = random_kv(S=20)
    cache = PolicyCache("oddmerge:budget=8,n_sink=1,recent=1")
    feed(cache, keys[:, :, :12], values[:, :, :12], (12,))
    for mode in ("wide_target", "wide_negative"):
        OddMerge.mode = mode
        with pytest.raises(PluginError, match="merge targets outside the cache"):
            feed(cache, keys[:, :, 12:13], values[:, :, 12:13], (1,))
        assert cache.offset == 12


def test_a_delta_that_is_inf_in_the_caches_dtype_is_refused(odd_plugin):
    """float32 d_values of 1e6 are finite, but inf once added to a float16 cache: refused, nothing written."""
    keys, values = random_kv(S=20, dtype=mx.float16)
    cache = PolicyCache("oddmerge:budget=8,n_sink=1,recent=1")
    feed(cache, keys[:, :, :12], values[:, :, :12], (12,))
    OddMerge.mode = "big"
    with pytest.raises(PluginError, match="d_values with non-finite values"):
        feed(cache, keys[:, :, 12:13], values[:, :, 12:13], (1,))
    assert cache.offset == 12 and mx.all(mx.isfinite(cache.values)).item()


def test_a_non_finite_delta_for_a_non_finite_row_is_allowed(odd_plugin):
    """Only a finite survivor is protected from NaN: the same NaN delta on a row that is already NaN is applied."""
    keys, values = random_kv(S=20)
    cache = PolicyCache("oddmerge:budget=8,n_sink=1,recent=1")
    feed(cache, keys[:, :, :8], values[:, :, :8], (8,))
    cache.values = mx.where(mx.arange(cache.values.shape[2])[:, None] == 1, math.nan, cache.values)  # slot 1: NaN
    OddMerge.mode = "nan"
    feed(cache, keys[:, :, 8:10], values[:, :, 8:10], (1, 1))  # OddMerge merges into slot 1
    assert cache.offset == 10 and mx.all(mx.isnan(cache.values[:, :, 1])).item()


def test_cores_selector_built_by_hand_to_protect_everything_is_still_checked():
    """valid_by_construction holds only when some slot is unprotected; a hand-built policy that protects
    every slot is checked, and its sink choice is a PluginError, not a silently evicted sink."""
    from kvpolicy_core.config.policy import build_policy

    policy = build_policy("h2o:budget=8,n_sink=1,recent=2,signal=proxy")
    policy.selector.recent = 50  # protects every slot: argmin over all +inf picks slot 0, a sink
    keys, values = random_kv(S=12)
    cache = PolicyCache(policy)
    feed(cache, keys[:, :, :9], values[:, :, :9], (9,))
    with pytest.raises(PluginError, match="sink"):
        feed(cache, keys[:, :, 9:10], values[:, :, 9:10], (1,))


# ----------------------------------------------------------------------------- part outputs that are not mx.array
class ForeignScorer(Scorer):
    """Returns its scores as ``ForeignScorer.kind`` (numpy, a list) of the right shape."""

    kind = "numpy"

    @classmethod
    def from_config(cls, config):
        return cls()

    def on_append(self, view, new_keys, new_positions):
        scores = np.zeros(view.scores.shape, np.float32)
        return scores if ForeignScorer.kind == "numpy" else scores.tolist()


class ForeignMerge:
    @classmethod
    def from_config(cls, config):
        return cls()

    def dispose(self, view, losers, key):
        B, H, E = losers.shape
        return MergeUpdate(mx.zeros((B, H, E), mx.int32), None, np.zeros((B, H, E, view.values.shape[-1])), None)


class ForeignPlugin:
    @hookimpl
    def register_scorers(self, register):
        register("foreign", ForeignScorer)

    @hookimpl
    def register_dispositions(self, register):
        register("foreign_merge", ForeignMerge)

    @hookimpl
    def register_methods(self, register):
        register(MethodSpec("foreign", PolicyConfig, "foreign", "lowest_score", "drop"))
        register(MethodSpec("foreignmerge", PolicyConfig, "cumulative_attention", "lowest_score", "foreign_merge"))


@pytest.fixture
def foreign_plugin():
    register_plugin(ForeignPlugin(), "foreign")
    yield
    unregister_plugin("foreign")


@pytest.mark.parametrize("kind, type_name", [("numpy", "numpy.ndarray"), ("list", "list")])
def test_a_scorer_returning_a_non_mlx_array_is_told_to_return_an_mx_array(foreign_plugin, kind, type_name):
    ForeignScorer.kind = kind
    keys, values = random_kv(S=3)
    with pytest.raises(
        PluginError,
        match=rf"scorer 'foreign' .* returned scores as a {type_name}, not an "
        r"mx\.array: it must return an mx\.array of shape \(2, 3, 3\)",
    ) as e:
        PolicyCache("foreign:budget=8,n_sink=1").update_and_fetch(keys, values)
    assert "shape (2, 3, 3), expected" not in str(e.value)


def test_a_disposition_returning_a_numpy_delta_is_told_to_return_an_mx_array(foreign_plugin):
    keys, values = random_kv(S=12)
    cache = PolicyCache("foreignmerge:budget=8,n_sink=1,recent=1")
    feed(cache, keys[:, :, :8], values[:, :, :8], (8,))
    with pytest.raises(PluginError, match=r"returned d_values as a numpy\.ndarray, not an mx\.array"):
        feed(cache, keys[:, :, 8:], values[:, :, 8:], (1,) * 4)
