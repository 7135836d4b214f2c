"""Refusals and rollbacks at the boundaries: bad part outputs, bad inputs, persistence, plugins, config."""

import math
import re
import resource
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest
from helpers import random_kv, tiny_llama

from kvpolicy_core import (
    CacheFileError,
    KVCacheBuilder,
    MergeUpdate,
    MethodSpec,
    PluginError,
    PolicyCache,
    PolicyConfig,
    attach,
    detach,
    hookimpl,
    load_caches,
    save_caches,
)
from kvpolicy_core.parts.base import Scorer, Selector
from kvpolicy_core.parts.lowest_score import LowestScoreSelector
from kvpolicy_core.plugin.discovery import register_plugin, unregister_plugin
from kvpolicy_core.testing.conformance import feed


# ----------------------------------------------------------------------------- 8: trim(-n)
def test_trim_rejects_a_negative_count_and_leaves_the_cache_usable():
    cache = PolicyCache("h2o:budget=16")
    feed(cache, *random_kv(S=10), (10,))
    with pytest.raises(ValueError, match="trim"):
        cache.trim(-2)
    assert cache.n == cache.offset == 10 and cache.scores.shape[-1] == 10
    feed(cache, *random_kv(S=1, seed=2), (1,))
    assert cache.offset == 11


# ----------------------------------------------------------------------------- 3: +inf scores
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


# ----------------------------------------------------------------------------- 4: one NaN key
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


# ----------------------------------------------------------------------------- 5, 6: files
def test_the_checksum_covers_the_header(tmp_path):
    cache = PolicyCache("h2o:budget=8")
    feed(cache, *random_kv(S=18), (18,))
    path = save_caches(tmp_path / "c.safetensors", [cache])
    data = path.read_bytes()
    j = re.search(rb'offset[\\"]+: 18', data).end() - 2  # the layer's offset in the (escaped) header JSON
    path.write_bytes(data[:j] + b"19" + data[j + 2 :])  # the same length: only the header's offset changes
    with pytest.raises(CacheFileError, match="checksum"):
        load_caches(path)


def test_a_failed_save_keeps_the_previous_file_and_says_why(tmp_path):
    path = tmp_path / "c.safetensors"
    script = f"""
import signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
from kvpolicy_core import CacheFileError, PolicyCache, save_caches
from kvpolicy_core.testing.conformance import feed, random_kv
cache = PolicyCache("h2o:budget=64")
feed(cache, *random_kv(B=1, H=2, S=60, D=32), (60,))
if sys.argv[1] == "good":
    save_caches({str(path)!r}, [cache]); sys.exit(0)
feed(cache, *random_kv(B=1, H=2, S=4, D=32, seed=9), (4,))
try:
    save_caches({str(path)!r}, [cache])
except CacheFileError as exc:
    print(exc); sys.exit(0)
sys.exit(3)
"""
    run = lambda arg, **kw: subprocess.run(
        [sys.executable, "-c", script, arg], capture_output=True, text=True, timeout=120, **kw
    )  # noqa: E731
    assert run("good").returncode == 0
    good = path.read_bytes()
    limit = lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))  # noqa: E731
    bad = run("bad", preexec_fn=limit)  # a disk that fills up part-way through the write
    assert bad.returncode == 0, ("the failed save must raise CacheFileError", bad.returncode, bad.stderr[-400:])
    assert path.read_bytes() == good and load_caches(path)[0].offset == 60
    assert [p.name for p in tmp_path.iterdir()] == ["c.safetensors"]  # no temporary file left behind


def test_saving_onto_a_directory_is_a_clear_error(tmp_path):
    (tmp_path / "d.safetensors").mkdir()
    with pytest.raises(CacheFileError, match="directory"):
        save_caches(tmp_path / "d.safetensors", [PolicyCache("h2o:budget=8")])


# ----------------------------------------------------------------------------- 7: mlx-lm files of fresh caches
def test_mlx_lm_round_trip_of_fresh_policy_caches(tmp_path):
    from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

    model = tiny_llama()
    caches = KVCacheBuilder.for_model(model, "cam:budget=8")
    save_prompt_cache(str(tmp_path / "p.safetensors"), caches)
    back = load_prompt_cache(str(tmp_path / "p.safetensors"))
    assert len(back) == len(caches) and all(isinstance(c, PolicyCache) and c.offset == 0 for c in back)
    assert back[0].policy.config == caches[0].policy.config


# ----------------------------------------------------------------------------- 9, 10: attach / detach
def test_detach_restores_the_models_own_make_cache():
    from mlx_lm.models.cache import RotatingKVCache

    model = tiny_llama()
    custom = lambda: [RotatingKVCache(max_size=32, keep=4) for _ in model.layers]  # noqa: E731
    model.make_cache = custom
    attach(model, "h2o:budget=16")
    detach(model)
    assert model.make_cache is custom


def test_one_users_detach_does_not_break_another_users_observed_caches():
    model = tiny_llama(seed=6)
    mine = KVCacheBuilder.for_model(model, "h2o:budget=8,signal=observed")
    KVCacheBuilder.for_model(model, "h2o:budget=8")
    detach(model)  # someone else's detach
    tokens = mx.random.randint(0, 97, (1, 20), key=mx.random.key(2))
    model(tokens[:, :12], cache=mine)
    model(tokens[:, 12:13], cache=mine)  # still observed: no ModelError
    assert all(c.offset == 13 for c in mine)


# ----------------------------------------------------------------------------- 1, 2: part outputs
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


@pytest.mark.parametrize("window", [None, 6])  # 6: a sliding-window layer past its window (window-dead slots)
def test_cores_selector_adds_no_host_sync_to_a_decode_step(monkeypatch, window):
    """H2O's decode eviction (core's selector, drop) evaluates nothing inside the cache: no check to read."""
    from kvpolicy_core.cache.step import PolicyStep

    read = []
    real = PolicyStep._raise_broken
    monkeypatch.setattr(
        PolicyStep, "_raise_broken", lambda self, pending: (read.append(len(pending)), real(self, pending))[1]
    )
    keys, values = random_kv(S=20)
    cache = PolicyCache("h2o:budget=8,n_sink=1,recent=2,signal=proxy", window=window)
    feed(cache, keys, values, [12] + [1] * 8)
    assert cache.n == 9 and read[0] > 0  # the prompt chunk's 4 losers: checked
    # one-loser decode evictions: nothing pending (the fused decode write does not reach the checks at all)
    assert len(read) <= 8 and all(r == 0 for r in read[1:])


def test_on_append_is_skipped_only_where_it_returns_the_scores_unchanged():
    """Core's observed scorers score from the attention hook, so the cache skips their on_append (and its
    view); a proxy signal, the random scorer and any plugin's scorer (a subclass of core's included) are called."""
    from kvpolicy_core.cache.step import PolicyStep
    from kvpolicy_core.config.policy import build_policy
    from kvpolicy_core.parts.observation_window import ObservationWindowScorer

    def appends(config, scorer=None):
        policy = build_policy(config)
        return PolicyStep(policy if scorer is None else policy._replace(scorer=scorer), 0).appends

    class PluginScorer(ObservationWindowScorer):
        def on_append(self, view, new_keys, new_positions):
            return view.scores + 1.0

    assert not appends("h2o:budget=8") and not appends("cam:budget=8")
    assert appends("h2o:budget=8,signal=proxy") and appends("random:budget=8")
    assert appends("h2o:budget=8", PluginScorer("observed"))
    calls = []
    cache = PolicyCache("h2o:budget=8,signal=proxy")
    real = cache._step.on_append
    cache._step.on_append = lambda *a: (calls.append(1), real(*a))[1]
    cache.update_and_fetch(*random_kv(S=3))
    assert calls == [1]


@pytest.mark.parametrize("window", [None, 5, 12])  # 5: below the budget (dead sinks); 12: above it
@pytest.mark.parametrize(
    "config",
    [
        "h2o:budget=8,n_sink=2,recent=2,signal=proxy",
        "h2o:budget=8,n_sink=3,recent=0",
        "cam:budget=8,n_sink=2,min_sim=-1,signal=proxy",
        "cam:budget=8,n_sink=2",
        "cam:budget=8,n_sink=2,merge=sim_weighted,keys=true,signal=proxy",
        "cam:budget=8,n_sink=2,merge=paper,m=3,signal=proxy",
        "cam:budget=8,n_sink=2,merge=mass_blend,min_sim=-1,signal=proxy",
    ],
)
def test_what_core_trusts_passes_the_checks_it_skips(monkeypatch, config, window):
    """The decode outputs the shipped parts give unchecked (core's selector's choices, CaM's merges: valid by
    construction, sliding-window layers included) pass every value check when the checks are forced on: the
    same caches bit for bit, log-weights and key norms included, and no PluginError."""
    from kvpolicy_core.cache import step as policy_step

    keys, values = random_kv(B=2, S=48)
    trusted = PolicyCache(config, window=window)
    feed(trusted, keys, values, [10] + [1] * 38)
    monkeypatch.setattr(policy_step, "valid_by_construction", lambda part: False)
    checked = PolicyCache(config, window=window)
    feed(checked, keys, values, [10] + [1] * 38)  # a broken rule would raise here
    assert trusted.offset == checked.offset == 48
    for x, y in zip(trusted.state, checked.state):
        assert mx.array_equal(x, y) if isinstance(x, mx.array) else x == y
    for f in ("log_weights", "key_norms"):
        x, y = getattr(trusted._slots, f), getattr(checked._slots, f)
        assert (x is None and y is None) or mx.array_equal(x, y)


@pytest.mark.parametrize("window", [None, 10])  # a sliding-window layer: window-dead slots (sinks too) go first
@pytest.mark.parametrize(
    "config",
    [
        "h2o:budget=8,n_sink=1,recent=2,signal=proxy",
        "h2o:budget=8,n_sink=2",
        "h2o:budget=8,n_sink=0,recent=0,signal=proxy",
    ],
)
def test_the_fused_decode_eviction_is_the_three_call_step_bit_for_bit(monkeypatch, config, window):
    """H2O's decode eviction as one compiled call (select + write: a Choice) leaves exactly the buffers, positions
    and scores of select, dispose and the write called one after another, and is the path decode takes."""
    from kvpolicy_core.cache.slots import Choice, SlotStore

    keys, values = random_kv(B=2, S=40)
    fused = PolicyCache(config, window=window)
    taken = []
    real = SlotStore.write
    monkeypatch.setattr(
        SlotStore,
        "write",
        lambda self, t, losers, *a, **k: (taken.append(isinstance(losers, Choice)), real(self, t, losers, *a, **k))[1],
    )
    feed(fused, keys, values, [12] + [1] * 28)
    monkeypatch.setattr(SlotStore, "write", real)
    three = PolicyCache(config, window=window)
    three._step.fuses_drop = False
    feed(three, keys, values, [12] + [1] * 28)
    assert taken and all(taken[1:])  # every full-buffer decode eviction took the fused call
    assert fused.offset == three.offset and fused.n == three.n
    for x, y in zip(fused.state, three.state):
        assert mx.array_equal(x, y) if isinstance(x, mx.array) else x == y


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize(
    "config",
    [
        "cam:budget=8,n_sink=1,signal=proxy,min_sim=-1",
        "cam:budget=8,n_sink=1,signal=proxy,min_sim=-1,keys=false,cap=none",
        "cam:budget=8,n_sink=2,signal=proxy,merge=mass_blend",
        "cam:budget=8,n_sink=1,signal=proxy,merge=sim_weighted,keys=true",
    ],
)
def test_a_decode_merge_and_its_write_in_one_call_are_the_two_calls_bit_for_bit(monkeypatch, config, dtype):
    """A decode eviction's one-target merge and the new token's write as one compiled call
    (SlotStore.write, compiled) leave exactly the buffers, log-weights and key norms of the same write eager."""
    from kvpolicy_core.cache.slots import SlotStore

    keys, values = random_kv(B=2, S=40, dtype=dtype)
    calls = []
    real = SlotStore.write
    monkeypatch.setattr(
        SlotStore,
        "write",
        lambda self, *a, compiled=False: (calls.append(compiled), real(self, *a, compiled=compiled))[1],
    )
    one = PolicyCache(config)
    feed(one, keys, values, [12] + [1] * 28)
    monkeypatch.setattr(SlotStore, "write", lambda self, *a, compiled=False: real(self, *a, compiled=False))
    two = PolicyCache(config)
    feed(two, keys, values, [12] + [1] * 28)
    assert sum(calls) > 10 and one.merges == two.merges > 0  # merges took the one-call path
    for x, y in zip(one.state, two.state):
        assert mx.array_equal(x, y) if isinstance(x, mx.array) else x == y
    for f in ("log_weights", "key_norms"):
        x, y = getattr(one._slots, f), getattr(two._slots, f)
        assert (x is None and y is None) or mx.array_equal(x, y)


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


def test_the_store_never_adds_a_non_finite_delta_to_a_finite_element():
    """SlotStore.add's device-side guard (what protects the cache from a shipped merge, which is not checked): a
    delta element that is NaN or inf in the buffer's dtype is not added where the target element is finite
    (that element keeps its value), is added where it is not; finite elements of the same row still change."""
    from kvpolicy_core.cache.slots import SlotStore
    from kvpolicy_core.parts.base import MergeUpdate

    store = SlotStore(track_log_weights=True, track_key_norms=True)
    keys, values = random_kv(B=1, H=1, S=3, D=2, dtype=mx.float16)
    values = values.at[0, 0, 1, 1].add(math.inf)  # slot 1's second element is non-finite
    store.append(keys, values, 0, budget=8)
    t = mx.array([[[1, 2]]], dtype=mx.int32)
    d_values = mx.array([[[[0.5, math.nan], [1e6, 0.25]]]])  # 1e6 is inf in float16
    store.add(
        MergeUpdate(
            t, d_values=d_values, d_scores=mx.array([[[math.inf, 2.0]]]), d_log_weights=mx.array([[[math.nan, 0.5]]])
        )
    )
    v = np.array(store.values[0, 0, :3].astype(mx.float32))
    want = np.array(values[0, 0].astype(mx.float32))
    assert v[0].tolist() == want[0].tolist() and v[1, 0] == np.float16(want[1, 0] + np.float16(0.5))
    assert np.isnan(v[1, 1])  # inf + NaN: the non-finite element may take any delta
    assert v[2, 0] == want[2, 0] and v[2, 1] == np.float16(want[2, 1] + np.float16(0.25))  # 1e6 (inf) not added
    assert store.scores.tolist() == [[[0.0, 0.0, 2.0]]] and store.log_weights.tolist() == [[[0.0, 0.0, 0.5]]]


def test_a_shipped_merge_whose_delta_overflows_the_cache_dtype_leaves_the_element_as_it_was():
    """float16 values near +-60000 blended by a similarity weight near 1: the delta (~120000) is inf in float16.
    Checked (as a plugin's update is), that is a PluginError; CaM's own decode merge is not checked, and the
    guard keeps those elements (every value stays finite) while the rest of the merge applies."""
    from kvpolicy_core.cache import step as policy_step

    keys = mx.ones((1, 1, 12, 4), mx.float16)  # identical keys: cosine 1, weight 1
    values = mx.where(mx.arange(12)[None, None, :, None] % 2 == 0, 60000.0, -60000.0) * mx.ones((1, 1, 12, 4))
    values = values.astype(mx.float16)
    config = "cam:budget=8,n_sink=1,signal=proxy,merge=sim_weighted,gate=false"
    cache = PolicyCache(config)
    feed(cache, keys, values, [9] + [1] * 3)
    assert cache.merges > 0 and mx.all(mx.isfinite(cache.values)).item()
    original = policy_step.valid_by_construction
    try:
        policy_step.valid_by_construction = lambda part: False
        checked = PolicyCache(config)
        with pytest.raises(PluginError, match="non-finite values"):
            feed(checked, keys, values, [9] + [1] * 3)
    finally:
        policy_step.valid_by_construction = original


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


# ----------------------------------------------------------------------------- weaker spots
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


def test_the_same_field_twice_is_an_error_not_last_wins():
    from kvpolicy_core import ConfigError, parse_config

    for bad in ("cam:budget=8,cam_budget=9", {"method": "cam", "budget": 8, "cam_budget": 9}):
        with pytest.raises(ConfigError, match="given twice"):
            parse_config(bad)


def test_a_bool_is_not_an_integer_field():
    from kvpolicy_core import ConfigError, parse_config

    for bad, field in (
        ({"method": "h2o", "budget": True}, "budget"),
        ({"method": "h2o", "n_sink": False}, "n_sink"),
        ({"method": "h2o", "seed": True}, "seed"),
        ({"method": "cam", "cam_m": True}, "cam_m"),
    ):
        with pytest.raises(ConfigError, match=f"{field}.*bool"):
            parse_config(bad)


def test_seeds_outside_64_bits_are_rejected_naming_the_range():
    from kvpolicy_core import ConfigError, parse_config

    assert parse_config({"method": "h2o", "seed": 2**64 - 1}).seed == 2**64 - 1
    for bad in (2**64, 2**70, -1, "h2o:seed=18446744073709551616"):
        spec = bad if isinstance(bad, str) else {"method": "h2o", "seed": bad}
        with pytest.raises(ConfigError, match=r"seed: .*(18446744073709551615|0)"):
            parse_config(spec)


def test_alias_mixing_names_the_fields_the_user_wrote():
    from kvpolicy_core import ConfigError, parse_config

    with pytest.raises(ConfigError, match=r"^merge_gate: the field 'merge_gate' is given twice \(as 'gate'"):
        parse_config("cam:gate=false,merge_gate=true")
    with pytest.raises(ConfigError, match=r"^gate: .*given twice"):
        parse_config({"method": "cam", "merge_gate": False, "gate": True})
    with pytest.raises(ConfigError, match=r"^cam_gate: Input should be a valid boolean"):
        parse_config("cam:gate=maybe")


def test_a_huge_integer_is_a_range_error_not_inf():
    from kvpolicy_core import ConfigError, parse_config

    with pytest.raises(ConfigError, match=r"budget: .*5000 digits\) is out of range") as e:
        parse_config("h2o:budget=" + "9" * 5000)
    assert "inf" not in str(e.value)
    with pytest.raises(ConfigError, match=r"h2o_budget: must be an integer in \[") as e:
        parse_config({"method": "h2o", "budget": 10**5000})
    assert "inf" not in str(e.value)


# ----------------------------------------------------------------------------- plugin name clash
class Intruder:
    @hookimpl
    def register_methods(self, register):
        register(MethodSpec("mine", PolicyConfig, "cumulative_attention", "lowest_score", "drop"))
        register(MethodSpec(Intruder.name, PolicyConfig, "cumulative_attention", "lowest_score", "drop"))


@pytest.mark.parametrize("taken, owner", [("h2o", "h2o"), ("random", "kvpolicy_core")])
def test_a_plugin_taking_a_shipped_name_is_the_one_reported_and_skipped(taken, owner):
    import importlib

    from kvpolicy_core.plugin import builtin
    from kvpolicy_core.plugin.discovery import PluginManager
    from kvpolicy_core.plugin.registry import Registry, fill

    Intruder.name = taken
    pm = PluginManager()  # the intruder's entry point is loaded before the shipped h2o plugin
    pm.register_from(builtin, "kvpolicy_core", "kvpolicy-core")
    pm.register_from(Intruder(), "intruder", "kvpolicy-intruder")
    pm.register_from(importlib.import_module("kvpolicy_h2o.plugin"), "h2o", "kvpolicy-h2o")
    registry = Registry()
    with pytest.warns(RuntimeWarning, match=f"'{taken}' is registered twice: plugin 'intruder'") as w:
        fill(registry, pm, strict=False)
    assert "'intruder'" in str(w[0].message) and f"plugin {owner!r}" in str(w[0].message)
    methods = registry.methods()
    assert methods[taken].plugin == owner and methods["h2o"].plugin == "h2o"  # the rightful owners
    assert methods["mine"].plugin == "intruder"  # only the intruder's clashing registration is skipped
    assert registry.method(taken) is methods[taken].obj


def test_kvpolicy_methods_lists_the_rightful_owner(capsys):
    from kvpolicy_core.apps.cli import main

    Intruder.name = "h2o"
    register_plugin(Intruder(), "intruder")
    try:
        with pytest.warns(RuntimeWarning, match="plugin 'intruder' tried to take the name"):
            main(["methods"])
        out = capsys.readouterr().out
        line = next(x for x in out.splitlines() if x.split() and x.split()[0] == "h2o")
        assert "intruder" not in line and "kvpolicy-h2o" in out
        from kvpolicy_core.plugin.discovery import get_registry

        assert get_registry().methods()["h2o"].plugin == "h2o"
        assert PolicyCache("h2o:budget=8").budget == 8
    finally:
        unregister_plugin("intruder")


def test_strict_mode_does_not_say_skipping_while_it_raises(tmp_path, monkeypatch):
    code = (
        "import sys; sys.path.insert(0, %r)\nfrom kvpolicy_core.plugin.discovery import get_registry\nget_registry()\n"
    ) % str(tmp_path)
    dist = tmp_path / "kvp_broken-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: kvp-broken\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[kvpolicy]\nbroken = kvp_broken_mod\n")
    (tmp_path / "kvp_broken_mod.py").write_text("raise ImportError('boom')\n")
    env = {"KVPOLICY_STRICT_PLUGINS": "1", "PYTHONPATH": str(tmp_path)}
    import os

    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, **env})
    assert r.returncode != 0 and "PluginError" in r.stderr and "boom" in r.stderr
    assert "skipping" not in r.stderr


# ----------------------------------------------------------------------------- part outputs
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


def test_from_state_with_bad_meta_is_a_clear_error():
    import json

    from kvpolicy_core import KVPolicyError

    cache = PolicyCache("h2o:budget=8")
    feed(cache, *random_kv(S=5), (5,))
    state = list(cache.state)
    for garbage in ("{garbage", "[1, 2]", "{}", json.dumps({**json.loads(state[4]), "offset": "x"})):
        with pytest.raises(KVPolicyError, match="meta state"):
            PolicyCache.from_state((*state[:4], garbage))
    meta = json.loads(state[4])
    meta["offset"] = 2
    with pytest.raises(KVPolicyError, match="offset 2 is below the 5 tokens held"):
        PolicyCache.from_state((*state[:4], json.dumps(meta)))
    assert PolicyCache.from_state(tuple(state)).offset == 5


def test_a_cache_file_for_another_model_is_refused(tmp_path):
    two, three = tiny_llama(layers=2), tiny_llama(layers=3)
    caches = KVCacheBuilder.for_model(two, "h2o:budget=8")
    two(mx.array([[1, 2, 3, 4]]), cache=caches)
    save_caches(tmp_path / "c.safetensors", caches)
    with pytest.raises(CacheFileError, match="2 layers, but the model has 3"):
        load_caches(tmp_path / "c.safetensors", model=three)
    with pytest.raises(CacheFileError, match="2 layers, but the model has 3"):
        load_caches(tmp_path / "c.safetensors", expect_layers=3)
    assert [c.offset for c in load_caches(tmp_path / "c.safetensors", model=two)] == [4, 4]


def test_kv_bits_with_policy_caches_warns_instead_of_being_ignored_silently():
    from mlx_lm.generate import generate_step

    model = tiny_llama()
    caches = KVCacheBuilder.for_model(model, "h2o:budget=8")
    with pytest.warns(RuntimeWarning, match="kv_bits=4 is ignored"):
        for _, (token, _) in zip(
            range(3),
            generate_step(mx.array([1, 2, 3, 4, 5]), model, prompt_cache=caches, kv_bits=4, quantized_kv_start=0),
        ):
            pass
    assert all(isinstance(c, PolicyCache) for c in caches) and caches[0].offset >= 6


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


@pytest.mark.parametrize("compiled", [True, False])
def test_an_update_without_value_deltas_moves_only_what_it_names(monkeypatch, compiled):
    """MergeUpdate's deltas are each optional: an update of scores alone (d_values None) leaves values as
    they are and adds its scores, at decode steps (one compiled merge-and-write) and prompt chunks."""
    from kvpolicy_cam.mass_merge import MassMergeDisposition

    real = MassMergeDisposition.dispose
    monkeypatch.setattr(
        MassMergeDisposition,
        "dispose",
        lambda self, *a: (lambda u: None if u is None else u._replace(d_values=None, d_keys=None))(real(self, *a)),
    )
    monkeypatch.setattr(MassMergeDisposition, "compile_decode", compiled)
    keys, values = random_kv(B=2, S=30)
    scores_only = PolicyCache("cam:budget=8,n_sink=1,signal=proxy,merge=mass_blend,min_sim=-1")
    feed(scores_only, keys, values, [12] + [1] * 18)
    assert scores_only.merges > 0
    k, v, p, _ = scores_only.state[:4]
    idx = p[..., None]  # every kept slot holds its own token's key and value, unblended
    assert mx.array_equal(k, mx.take_along_axis(keys, idx, axis=2))
    assert mx.array_equal(v, mx.take_along_axis(values, idx, axis=2))
