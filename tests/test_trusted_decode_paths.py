"""The shipped parts' decode fast paths. Core's selector and CaM's merges are valid by construction, so their
outputs go unchecked (no host sync) and pass every check when it is forced on; the fused one-call steps are
the separate calls bit for bit; the store's own guard keeps a non-finite delta out of a finite element."""

import math

import mlx.core as mx
import numpy as np
import pytest
from helpers import random_kv

from kvpolicy_core import PluginError, PolicyCache
from kvpolicy_core.testing.conformance import feed


# ----------------------------------------------------------------------------- unchecked outputs
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


# ----------------------------------------------------------------------------- fused steps
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
    from kvpolicy_core.parts import shipped

    monkeypatch.setitem(shipped._shipped, MassMergeDisposition, shipped.Traits(compile_decode=compiled, key_norms=True))
    keys, values = random_kv(B=2, S=30)
    scores_only = PolicyCache("cam:budget=8,n_sink=1,signal=proxy,merge=mass_blend,min_sim=-1")
    feed(scores_only, keys, values, [12] + [1] * 18)
    assert scores_only.merges > 0
    k, v, p, _ = scores_only.state[:4]
    idx = p[..., None]  # every kept slot holds its own token's key and value, unblended
    assert mx.array_equal(k, mx.take_along_axis(keys, idx, axis=2))
    assert mx.array_equal(v, mx.take_along_axis(values, idx, axis=2))


# ----------------------------------------------------------------------------- the store's guard
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
