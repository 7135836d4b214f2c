"""A plugin part's output is checked before it reaches the cache: ranks that are not an mx.array of the scores'
shape and a real dtype, a selector in the removed select form, merge targets outside the cache, deltas of the
wrong shape or dtype, non-finite in the cache's dtype, stats that are not a dict, outputs that are not mx.array:
each is a PluginError naming the part and saying what is wrong, the call is rolled back and the next one works.
Ranks need no value check: whatever they are, the engine evicts distinct slots of the cache and never a live
sink. Merge updates are value-checked at prompt chunks and a cache's first decode evictions; after those, the
slot store's device guards keep a broken update from writing outside the cache or a non-finite delta into a
finite slot."""

import math

import mlx.core as mx
import numpy as np
import pytest
from helpers import random_kv

from kvpolicy_core import MergeUpdate, MethodSpec, PluginError, PolicyCache, PolicyConfig, hookimpl
from kvpolicy_core.parts.base import Disposition, Scorer, Selector
from kvpolicy_core.parts.lowest_score import LowestScoreSelector
from kvpolicy_core.parts.traits import traits
from kvpolicy_core.plugin.discovery import register_plugin, unregister_plugin
from kvpolicy_core.testing.conformance import feed


# ----------------------------------------------------------------------------- ranks and merge updates
class BadSelector(Selector):
    """Ranks that are not an mx.array of the scores' shape and a real dtype (``mode``; None: good ranks)."""

    mode = "short"

    def rank(self, view):
        B, H, L = view.scores.shape
        mode = BadSelector.mode
        if mode == "raise":
            raise ValueError("no ranks today")
        return {
            None: view.scores,
            "short": view.scores[..., :-1],  # [B, H, L - 1]
            "list": view.scores.tolist(),
            "numpy": np.array(view.scores),
            "complex": view.scores.astype(mx.complex64),
            "bool": view.scores > 0,
        }[mode]


@traits(compile_decode=True)
class CompiledBadSelector(BadSelector):
    """The same with its decode choice compiled: the compiled call fails, the eager call reports it."""


class SelectForm:
    """The 0.1 form: select(view, n_evict) returning indices, removed in 0.3."""

    @classmethod
    def from_config(cls, config):
        return cls()

    def select(self, view, n_evict):
        B, H, L = view.scores.shape
        return mx.broadcast_to(mx.arange(n_evict, dtype=mx.int32), (B, H, n_evict))


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
    """A plugin's subclass of core's selector that ranks sinks lowest (-inf)."""

    def rank(self, view):
        return mx.where(view.positions < self.n_sink, -math.inf, super().rank(view))


class BadPlugin:
    @hookimpl
    def register_selectors(self, register):
        register("bad_sel", BadSelector)
        register("bad_sel_compiled", CompiledBadSelector)
        register("bad_lowest", SinkEatingSelector)
        register("select_form", SelectForm)

    @hookimpl
    def register_dispositions(self, register):
        register("bad_merge", BadMerge)

    @hookimpl
    def register_methods(self, register):
        register(MethodSpec("badsel", PolicyConfig, "cumulative_attention", "bad_sel", "drop"))
        register(MethodSpec("badselc", PolicyConfig, "cumulative_attention", "bad_sel_compiled", "drop"))
        register(MethodSpec("badmerge", PolicyConfig, "cumulative_attention", "lowest_score", "bad_merge"))
        register(MethodSpec("badlowest", PolicyConfig, "cumulative_attention", "bad_lowest", "drop"))
        register(MethodSpec("selectform", PolicyConfig, "cumulative_attention", "select_form", "drop"))


@pytest.fixture
def bad_plugin():
    register_plugin(BadPlugin(), "bad")
    yield
    BadSelector.mode = "short"
    unregister_plugin("bad")


@pytest.mark.parametrize(
    "mode, needle",
    [
        ("short", r"returned ranks of shape \(2, 3, 11\), expected \(2, 3, 12\)"),
        ("list", r"returned ranks as a list, not an mx\.array: it must return an mx\.array of shape \(2, 3, 12\)"),
        ("numpy", r"returned ranks as a numpy\.ndarray, not an mx\.array"),
        ("complex", "returned ranks of dtype .*complex64, expected a real dtype"),
        ("bool", "returned ranks of dtype .*bool, expected a real dtype"),
        ("raise", "raised ValueError: no ranks today"),
    ],
)
@pytest.mark.parametrize("method", ["badsel", "badselc"])  # eager, and compiled at decode
@pytest.mark.parametrize("chunks", [(12, 1), (12, 6)])  # a multi-loser eviction, then the chunked compaction
def test_bad_ranks_are_a_plugin_error_naming_the_part_and_the_cache_stays_usable(
    bad_plugin, mode, needle, method, chunks
):
    BadSelector.mode = mode
    keys, values = random_kv(S=20)
    cache = PolicyCache(f"{method}:budget=8,n_sink=1,recent=1")
    feed(cache, keys[:, :, :12], values[:, :, :12], chunks[:1])
    name = "bad_sel_compiled" if method == "badselc" else "bad_sel"
    with pytest.raises(PluginError, match=rf"layer 0: selector '{name}' of plugin 'bad' {needle}"):
        feed(cache, keys[:, :, 12:], values[:, :, 12:], chunks[1:])
    assert cache.offset == 12 and cache.n == 12  # rolled back: nothing half-applied, nothing corrupted
    assert mx.array_equal(cache.keys[..., :12, :], keys[:, :, :12]) and cache.scores.shape[-1] == 12
    BadSelector.mode = None
    feed(cache, keys[:, :, 12:], values[:, :, 12:], chunks[1:])  # the next call works
    assert cache.offset == 12 + chunks[1]


@pytest.mark.parametrize("mode", ["short", "list", "complex"])
@pytest.mark.parametrize("method", ["badsel", "badselc"])
def test_bad_ranks_at_a_steady_decode_step_are_a_plugin_error(bad_plugin, mode, method):
    """A selector that turns bad at a later decode step (one loser, past the first checked steps; compiled for a
    selector with the compile_decode trait) is still refused by name: ranks are checked at every call."""
    BadSelector.mode = None
    keys, values = random_kv(S=20)
    cache = PolicyCache(f"{method}:budget=8,n_sink=1,recent=1")
    feed(cache, keys[:, :, :15], values[:, :, :15], (9,) + (1,) * 6)
    BadSelector.mode = mode
    with pytest.raises(PluginError, match="selector 'bad_sel.*' of plugin 'bad' returned ranks"):
        feed(cache, keys[:, :, 15:16], values[:, :, 15:16], (1,))
    assert cache.offset == 15 and cache.n == 9
    BadSelector.mode = None
    feed(cache, keys[:, :, 15:], values[:, :, 15:], (1,) * 5)
    assert cache.offset == 20


def test_a_selector_in_the_select_form_is_refused_naming_rank(bad_plugin):
    with pytest.raises(PluginError, match=r"select_form.*select\(view, n_evict\).*rank\(view\)"):
        PolicyCache("selectform:budget=8,n_sink=1,recent=1")


def test_a_plugin_subclass_of_cores_selector_ranking_sinks_lowest_never_evicts_them(bad_plugin):
    """Ranking the sinks -inf does not evict them: the engine protects sinks whatever the ranks."""
    keys, values = random_kv(S=20)
    cache = PolicyCache("badlowest:budget=8,n_sink=2,recent=1")
    feed(cache, keys, values, (8, 1, 1, 1, 1, 3, 1, 1, 1, 1, 1))
    assert cache.offset == 20
    pos = np.array(cache.positions[..., : cache.n])
    assert ((pos == 0).sum(-1) == 1).all() and ((pos == 1).sum(-1) == 1).all()


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
    half = base.astype(mx.float16)  # checked as added, in float32: 1e6 is finite (the float16 sum saturates)
    assert update_checks(t, scalar(2), [(one * 1e6, half)], None)[0].item() == 1
    assert nonfinite_flags(t, 2, [(one * 1e6, half)]) == [False]
    assert update_checks(t, scalar(2), [((one * 1e6).astype(mx.float16), half)], None)[0].item() == 2  # inf
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
        elif mode == "stats_list":
            return MergeUpdate(t, None, dv, None, stats=[3])
        elif mode == "stats_array":  # the 0.1 positional draws counter, now in stats' place
            return MergeUpdate(t, None, dv, None, mx.array(3))
        elif mode == "stats_float_list":
            return MergeUpdate(t, None, dv, None, stats={"merges": [1.5]})
        return MergeUpdate(t, None, dv, None)


class SinkSelector(Selector):
    """Oldest first: ranks position 0, a sink, lowest."""

    def rank(self, view):
        return view.positions


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
        ("stats_list", "returned stats of type list, expected a dict name -> count"),
        ("stats_array", "the 0.1 form: draws/merges were removed in 0.3"),
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


def test_a_selector_ranking_a_sink_lowest_never_evicts_it(odd_plugin):
    """The engine, not the selector, protects the sinks: oldest-first keeps positions 0 and 1 (n_sink=2) and the
    newest; without sinks, the oldest slots are a fair choice."""
    keys, values = random_kv(S=20)
    cache = PolicyCache("sinksel:budget=8,n_sink=2,recent=1")
    feed(cache, keys, values, (12,) + (1,) * 8)
    assert cache.offset == 20 and cache.n == 9
    cache.settle()
    assert (np.sort(np.array(cache.positions[..., : cache.n]), axis=-1) == [0, 1, 14, 15, 16, 17, 18, 19]).all()
    ok = PolicyCache("sinksel:budget=8,n_sink=0,recent=1")  # without sinks, slot 0 is a fair choice
    feed(ok, keys, values, (12,) + (1,) * 8)
    ok.settle()
    assert (np.sort(np.array(ok.positions[..., : ok.n]), axis=-1) == list(range(12, 20))).all()


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


def test_a_delta_whose_sum_leaves_the_caches_dtype_saturates(odd_plugin):
    """float32 d_values of 1e6 are finite; added to a float16 cache the sums saturate at 65504: accepted, and
    every value stays finite."""
    keys, values = random_kv(S=20, dtype=mx.float16)
    cache = PolicyCache("oddmerge:budget=8,n_sink=1,recent=1")
    feed(cache, keys[:, :, :12], values[:, :, :12], (12,))
    OddMerge.mode = "big"
    feed(cache, keys[:, :, 12:13], values[:, :, 12:13], (1,))
    assert cache.offset == 13 and mx.all(mx.isfinite(cache.values)).item()
    assert mx.all(cache.values[:, :, 1] == 65504).item()


def test_a_non_finite_delta_for_a_non_finite_row_is_allowed(odd_plugin):
    """Only a finite survivor is protected from NaN: the same NaN delta on a row that is already NaN is applied."""
    keys, values = random_kv(S=20)
    cache = PolicyCache("oddmerge:budget=8,n_sink=1,recent=1")
    feed(cache, keys[:, :, :8], values[:, :, :8], (8,))
    cache.values = mx.where(mx.arange(cache.values.shape[2])[:, None] == 1, math.nan, cache.values)  # slot 1: NaN
    OddMerge.mode = "nan"
    feed(cache, keys[:, :, 8:10], values[:, :, 8:10], (1, 1))  # OddMerge merges into slot 1
    assert cache.offset == 10 and mx.all(mx.isnan(cache.values[:, :, 1])).item()


# ----------------------------------------------------------------------------- after the checked decode evictions
class StickyMerge(Disposition):
    """Merges nothing (all-zero deltas) while ``mode`` is None; else the same broken update at every call."""

    mode = None

    def dispose(self, view, losers, key):
        B, H, E = losers.shape
        L, Dv = view.scores.shape[-1], view.values.shape[-1]
        t = mx.zeros((B, H, E), mx.int32) + 1
        dv, ds = mx.zeros((B, H, E, Dv)), None
        mode = StickyMerge.mode
        if mode is not None:
            dv = dv + 1.0  # written, it would change slot 1
        if mode == "big_target":
            t = t + L + 2
        elif mode == "negative_target":
            t = t - 3
        elif mode == "wide_target":
            t = mx.zeros((B, H, E), mx.int64) + 2**32 + 1
        elif mode == "nan":
            dv, ds = dv * math.nan, mx.full((B, H, E), math.inf)
        return MergeUpdate(t, None, dv, ds)


@traits(compile_decode=True)
class CompiledStickyMerge(StickyMerge):
    """The same, its decode updates compiled (past the checked decode evictions)."""


class StickyPlugin:
    @hookimpl
    def register_dispositions(self, register):
        register("sticky", StickyMerge)
        register("sticky_compiled", CompiledStickyMerge)

    @hookimpl
    def register_methods(self, register):
        register(MethodSpec("sticky", PolicyConfig, "cumulative_attention", "lowest_score", "sticky"))
        register(MethodSpec("stickyc", PolicyConfig, "cumulative_attention", "lowest_score", "sticky_compiled"))
        register(MethodSpec("plaindrop", PolicyConfig, "cumulative_attention", "lowest_score", "drop"))


@pytest.fixture
def sticky_plugin():
    register_plugin(StickyPlugin(), "sticky")
    yield
    StickyMerge.mode = None
    unregister_plugin("sticky")


@pytest.mark.parametrize(
    "mode, needle",
    [
        ("big_target", "merge targets outside the cache"),
        ("negative_target", "merge targets outside the cache"),
        ("wide_target", "merge targets outside the cache"),
        ("nan", "non-finite values"),
    ],
)
@pytest.mark.parametrize("method", ["sticky", "stickyc"])
def test_a_broken_merge_is_refused_while_checked_then_guarded_on_the_device(sticky_plugin, method, mode, needle):
    """A disposition whose every update is broken: refused (rolled back, the next call works) at a cache's first
    decode evictions and at every prompt chunk's; at later decode evictions, which are not value-checked, the
    store's guards add nothing of it (no write outside the cache, no non-finite delta into a finite slot), so the
    cache is exactly the one a plain drop leaves."""
    from kvpolicy_core.cache.step import CHECKED_DECODE_EVICTIONS

    config = "budget=8,n_sink=1,recent=1"
    keys, values = random_kv(S=30)
    cache = PolicyCache(f"{method}:{config}")
    feed(cache, keys[:, :, :9], values[:, :, :9], (9,))  # budget + 1 slots: every next token evicts one
    StickyMerge.mode = mode
    with pytest.raises(PluginError, match=rf"disposition 'sticky(_compiled)?' of plugin 'sticky' .*{needle}"):
        feed(cache, keys[:, :, 9:10], values[:, :, 9:10], (1,))  # a checked decode eviction
    before = [mx.array(x) for x in (cache.keys, cache.values, cache.scores)]
    assert cache.offset == 9 and all(
        mx.array_equal(a, b) for a, b in zip(before, (cache.keys, cache.values, cache.scores))
    )
    StickyMerge.mode = None
    feed(cache, keys[:, :, 9:12], values[:, :, 9:12], (1,) * 3)  # the next calls work
    assert cache._step.checked_decode == 0 and CHECKED_DECODE_EVICTIONS == 4  # one refused, three passed
    StickyMerge.mode = mode
    feed(cache, keys[:, :, 12:24], values[:, :, 12:24], (1,) * 12)  # unchecked: guarded, no error
    assert cache._step.needs.compile_disposition == (method == "stickyc") and cache._step.compiling.dispose
    mx.eval(cache.keys, cache.values, cache.scores)
    drop = PolicyCache(f"plaindrop:{config}")
    feed(drop, keys[:, :, :24], values[:, :, :24], (9,) + (1,) * 15)
    assert cache.offset == drop.offset == 24 and cache.n == drop.n == 9
    for x, y in zip(cache.state[:4], drop.state[:4]):  # keys, values, positions, scores (not the method's name)
        assert mx.array_equal(x, y)
    assert mx.all(mx.isfinite(cache.values)).item() and mx.all(mx.isfinite(cache.scores)).item()
    # a prompt chunk's eviction (more than one loser) is value-checked whatever the decode count says
    feed(cache, keys[:, :, 24:27], values[:, :, 24:27], (3,))  # n = budget + 1: this chunk evicts one
    before = [mx.array(x) for x in (cache.keys, cache.values, cache.scores)]
    with pytest.raises(PluginError, match=needle):
        feed(cache, keys[:, :, 27:30], values[:, :, 27:30], (3,))  # n = budget + 3: evicts three
    assert cache.offset == 27 and all(
        mx.array_equal(a, b) for a, b in zip(before, (cache.keys, cache.values, cache.scores))
    )
    StickyMerge.mode = None
    feed(cache, keys[:, :, 27:30], values[:, :, 27:30], (3,))
    assert cache.offset == 30


def test_cores_selector_built_by_hand_to_protect_everything_still_keeps_the_sinks():
    """A hand-built policy whose selector protects every slot (+inf ranks): the engine evicts protected slots
    then, but never a sink, and never loses a slot to a repeated or out-of-range choice."""
    from kvpolicy_core.config.policy import build_policy

    policy = build_policy("h2o:budget=8,n_sink=1,recent=2,signal=proxy")
    policy.selector.recent = 50  # protects every slot
    keys, values = random_kv(S=16)
    cache = PolicyCache(policy)
    feed(cache, keys, values, (9,) + (1,) * 4 + (3,))
    cache.settle()
    pos = np.array(cache.positions[..., : cache.n])
    assert cache.n == 8 and cache.offset == 16 and ((pos >= 0) & (pos < 16)).all()
    for row in pos.reshape(-1, 8):
        assert 0 in row.tolist() and len(set(row.tolist())) == 8


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
