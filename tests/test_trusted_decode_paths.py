"""The decode fast paths, with no part trusted. Any selector (core's or a plugin's) only ranks: the engine's
choice adds no host sync and is valid whatever the ranks; the shipped parts' decode updates, which go unchecked
after a cache's first checked decode evictions, pass every value check when it is forced on; the compiled
decode calls (choice, update, write) are the eager ones bit for bit; the store's own guard keeps a non-finite
delta out of a finite element."""

import math

import mlx.core as mx
import numpy as np
import pytest
from helpers import random_kv
from host_syncs import HostSyncs

from kvpolicy_core import PolicyCache
from kvpolicy_core.config.policy import build_policy
from kvpolicy_core.parts.base import Selector
from kvpolicy_core.parts.traits import traits
from kvpolicy_core.testing.conformance import feed


class OldestFirst(Selector):
    """A plugin's selector in the rank form: the oldest slot loses (sinks are the engine's to protect)."""

    def rank(self, view):
        return view.positions.astype(mx.float32)


@traits(compile_decode=True)
class CompiledOldestFirst(OldestFirst):
    """The same, with its decode choice compiled (the trait a plugin may declare)."""


def with_selector(config: str, selector=None):
    policy = build_policy(config)
    return policy if selector is None else policy._replace(selector=selector)


def same_state(a: PolicyCache, b: PolicyCache) -> bool:
    """The two caches hold the same slots bit for bit, log-weights and key norms included."""
    if a.offset != b.offset or a.n != b.n:
        return False
    for x, y in zip(a.state, b.state):
        if not (mx.array_equal(x, y) if isinstance(x, mx.array) else x == y):
            return False
    for f in ("log_weights", "key_norms"):
        x, y = getattr(a._slots, f), getattr(b._slots, f)
        if not ((x is None and y is None) or (x is not None and y is not None and mx.array_equal(x, y))):
            return False
    return True


# ----------------------------------------------------------------------------- the choice: no sync, no check
@pytest.mark.parametrize("window", [None, 6])  # 6: a sliding-window layer past its window (window-dead slots)
@pytest.mark.parametrize("selector", [None, OldestFirst, CompiledOldestFirst], ids=["core", "plugin", "compiled"])
def test_no_selector_adds_a_host_sync_to_a_decode_step(monkeypatch, selector, window):
    """A decode eviction with drop (core's selector or any plugin's, eager or compiled) evaluates nothing inside
    the cache once past the first, evaluated steps: the choice has no value check to read back."""
    from kvpolicy_core.cache.step import PolicyStep

    read = []
    real = PolicyStep._raise_broken
    monkeypatch.setattr(
        PolicyStep, "_raise_broken", lambda self, pending: (read.append(list(pending)), real(self, pending))[1]
    )
    keys, values = random_kv(S=40)
    policy = with_selector("h2o:budget=8,n_sink=1,recent=2,signal=proxy", selector and selector())
    cache = PolicyCache(policy, window=window)
    feed(cache, keys[:, :, :20], values[:, :, :20], [12] + [1] * 8)  # the prompt chunk and the first decode steps
    with HostSyncs(["kvpolicy_core"]) as syncs:
        feed(cache, keys[:, :, 20:], values[:, :, 20:], [1] * 20)
    assert cache.offset == 40 and cache.n == 9
    assert syncs.calls == []
    assert read == []  # nothing pending at any eviction, the prompt chunk's included: drop has no update
    if selector is CompiledOldestFirst:
        assert cache._step.compiling.choose  # the compiled choice was the path taken


@pytest.mark.parametrize("window", [None, 6])
def test_a_merges_value_checks_are_the_dispositions_alone(monkeypatch, window):
    """With a merge, the only pending value checks are the disposition's, one per decode eviction for a cache's
    first CHECKED_DECODE_EVICTIONS ones, then none (the choice is never checked)."""
    from kvpolicy_core.cache.step import CHECKED_DECODE_EVICTIONS, PolicyStep

    read = []
    real = PolicyStep._raise_broken
    monkeypatch.setattr(
        PolicyStep, "_raise_broken", lambda self, pending: (read.append(list(pending)), real(self, pending))[1]
    )
    keys, values = random_kv(S=30)
    cache = PolicyCache(with_selector("cam:budget=8,n_sink=1,min_sim=-1,signal=proxy", OldestFirst()), window=window)
    feed(cache, keys, values, [9] + [1] * 21)  # budget + 1 slots: every later token evicts one
    assert [[p.kind for p in pending] for pending in read] == [["disposition"]] * CHECKED_DECODE_EVICTIONS
    assert cache._step.checked_decode == 0 and (window is not None or cache.merges > 0)  # dead losers never merge


def retained(cache: PolicyCache) -> np.ndarray:
    """Positions [B, H, n] of the valid slots."""
    return np.array(cache.positions[..., : cache.n])


def assert_valid(cache: PolicyCache, n_sink: int, sinks_kept: bool = True) -> None:
    """Each row of the cache holds distinct positions already seen; the sinks too, unless window-dead."""
    pos = retained(cache)
    assert pos.shape[-1] == cache.n and ((0 <= pos) & (pos < cache.offset)).all()
    for row in pos.reshape(-1, pos.shape[-1]):
        assert len(set(row.tolist())) == len(row)  # no slot lost to a repeated or out-of-range loser
        if sinks_kept:
            assert set(range(n_sink)) <= set(row.tolist())


class AllProtected(Selector):
    def rank(self, view):
        return mx.full(view.scores.shape, math.inf)


class AllNaN(Selector):
    def rank(self, view):
        return mx.full(view.scores.shape, math.nan)


class SinksLowest(Selector):
    """Ranks the sinks (the first positions) lowest, -inf, and the rest by score."""

    def rank(self, view):
        return mx.where(view.positions < 2, -math.inf, view.scores)


class HugeIntegers(Selector):
    """Integer ranks far outside float32's exact range, the oldest lowest."""

    def rank(self, view):
        return (view.positions.astype(mx.int64) - 2**40) * 2**20


@pytest.mark.parametrize("chunks", [(12,) + (1,) * 20, (3,) * 8 + (1,) * 8], ids=["decode", "chunks"])
@pytest.mark.parametrize("selector", [AllProtected, AllNaN, SinksLowest, HugeIntegers, CompiledOldestFirst])
def test_whatever_a_plugin_selector_ranks_no_sink_is_evicted_and_every_loser_is_a_slot(selector, chunks):
    """Ranks that protect everything (+inf, NaN), that rank the sinks lowest (-inf) or that overflow float32: the
    engine still evicts only distinct slots inside the cache, never a sink (no PluginError: nothing to refuse)."""
    keys, values = random_kv(S=sum(chunks))
    cache = PolicyCache(with_selector("h2o:budget=8,n_sink=2,recent=1,signal=proxy", selector()))
    feed(cache, keys, values, chunks)
    assert cache.offset == sum(chunks) and cache.n <= 9
    assert_valid(cache, n_sink=2)


def test_the_oldest_first_plugin_keeps_exactly_the_sinks_and_the_newest():
    """The choice is the rank's, sinks aside: oldest-first keeps positions 0, 1 and the newest budget - 2."""
    keys, values = random_kv(S=30)
    for selector in (OldestFirst, CompiledOldestFirst):
        cache = PolicyCache(with_selector("h2o:budget=8,n_sink=2,recent=0,signal=proxy", selector()))
        feed(cache, keys, values, [12] + [1] * 18)
        cache.settle()
        assert (np.sort(retained(cache), axis=-1) == [0, 1, 24, 25, 26, 27, 28, 29]).all()


@pytest.mark.parametrize("selector", [AllProtected, SinksLowest, OldestFirst])
def test_window_dead_sinks_are_evicted_first(selector):
    """On a sliding-window layer, slots no future query sees go first, sinks included, whatever the ranks."""
    keys, values = random_kv(S=30)
    cache = PolicyCache(with_selector("h2o:budget=8,n_sink=2,recent=1,signal=proxy", selector()), window=5)
    feed(cache, keys, values, [12] + [1] * 18)
    assert_valid(cache, n_sink=2, sinks_kept=False)
    pos = retained(cache)
    assert (pos >= 2).all()  # the sinks were dead long ago
    assert (np.sort(pos, axis=-1)[..., -4:] == [26, 27, 28, 29]).all()  # every live slot (window 5) kept


def test_a_live_slot_ranked_minus_inf_goes_after_every_window_dead_slot():
    """step.choose's tiers are strict: window-dead slots go before any live slot, whatever its rank."""
    from kvpolicy_core.cache.step import choose

    ranked = mx.array([[[-math.inf, 5.0, 6.0, 7.0]]])
    positions = mx.array([[[4, 5, 6, 7]]], dtype=mx.int32)
    dead = mx.array([[[False, False, False, True]]])
    assert choose(ranked, positions, 0, dead, 1).tolist() == [[[3]]]


def test_choose_orders_dead_then_finite_then_protected_and_never_a_live_sink():
    """step.choose directly: window-dead first, then finite ranks (lowest first, huge ones capped), then the
    protected (+inf, NaN), and a sink (position < n_sink) never unless it is window-dead."""
    from kvpolicy_core.cache.step import choose

    # slots:            sink       dead sink  protected  NaN       huge     finite  dead    finite
    ranked = mx.array([[[-math.inf, 9.0, math.inf, math.nan, 3.3e38, 2.0, 50.0, -1.0]]])
    positions = mx.array([[[0, 1, 2, 3, 4, 5, 6, 7]]], dtype=mx.int32)
    dead = mx.array([[[False, True, False, False, False, False, True, False]]])
    order = [sorted(choose(ranked, positions, 2, dead, e).tolist()[0][0]) for e in range(1, 8)]
    assert order[1] == [1, 6]  # both dead slots first (the dead sink included)
    assert order[3] == [1, 5, 6, 7]  # then the finite ranks, lowest first
    assert order[4] == [1, 4, 5, 6, 7]  # 3.3e38 is capped, still below the protected
    assert order[6] == [1, 2, 3, 4, 5, 6, 7]  # the protected last; the live sink (slot 0) never
    assert sorted(choose(ranked, positions, 2, None, 6).tolist()[0][0]) == [2, 3, 4, 5, 6, 7]  # no dead: no sink


def test_on_append_is_called_exactly_when_the_scorers_class_overrides_it():
    """A scorer whose class keeps Scorer.on_append (it returns the scores as they are) is not called on append,
    so its view is not built; one that overrides it (core's scorers, a plugin's, a subclass of core's) is."""
    from kvpolicy_core.cache.step import PolicyStep
    from kvpolicy_core.parts.base import Needs, Scorer
    from kvpolicy_core.parts.observation_window import ObservationWindowScorer

    def appends(config, scorer=None):
        policy = build_policy(config)
        return PolicyStep(policy if scorer is None else policy._replace(scorer=scorer), 0).appends

    class PluginScorer(ObservationWindowScorer):
        def on_append(self, view, new_keys, new_positions):
            return view.scores + 1.0

    class AttentionOnly(Scorer):
        needs = Needs(attention=True)

        def on_attention(self, view, queries, scale, mask):
            return view.scores + 1.0

    assert appends("h2o:budget=8,signal=proxy") and appends("random:budget=8") and appends("cam:budget=8")
    assert appends("h2o:budget=8", PluginScorer("observed"))
    assert not appends("h2o:budget=8", AttentionOnly())
    for scorer, called in ((AttentionOnly(), False), (PluginScorer("proxy"), True)):
        cache = PolicyCache(build_policy("h2o:budget=8")._replace(scorer=scorer))
        calls = []
        real = cache._step.on_append
        cache._step.on_append = lambda *a: (calls.append(1), real(*a))[1]
        keys, values = random_kv(S=3)
        feed(cache, keys, values, (2, 1))
        assert calls == ([1, 1] if called else [])
        assert cache.scores.shape[-1] == 3


# ----------------------------------------------------------------------------- checked and unchecked updates
@pytest.mark.parametrize("window", [None, 5, 12])  # 5: below the budget (dead sinks); 12: above it
@pytest.mark.parametrize(
    "config",
    [
        "cam:budget=8,n_sink=2,min_sim=-1,signal=proxy",
        "cam:budget=8,n_sink=2",
        "cam:budget=8,n_sink=2,merge=sim_weighted,keys=true,signal=proxy",
        "cam:budget=8,n_sink=2,merge=paper,m=3,signal=proxy",
        "cam:budget=8,n_sink=2,merge=mass_blend,min_sim=-1,signal=proxy",
    ],
)
def test_the_shipped_decode_updates_pass_the_checks_they_skip(monkeypatch, config, window):
    """The decode updates the shipped merges give unchecked (every one past a cache's first checked decode
    evictions, compiled) pass every value check when the checks are forced on for all of them: the same caches
    bit for bit, log-weights and key norms included, and no PluginError. (H2O drops: it has no update to check.)"""
    from kvpolicy_core.cache.step import PolicyStep

    checked_updates = []
    real = PolicyStep._raise_broken
    monkeypatch.setattr(
        PolicyStep, "_raise_broken", lambda self, pending: (checked_updates.append(1), real(self, pending))[1]
    )
    keys, values = random_kv(B=2, S=48)
    unchecked = PolicyCache(config, window=window)
    feed(unchecked, keys, values, [10] + [1] * 38)
    assert unchecked._step.checked_decode == 0
    n_default = len(checked_updates)
    checked = PolicyCache(config, window=window)
    checked._step.checked_decode = 10**6
    feed(checked, keys, values, [10] + [1] * 38)  # a broken rule would raise here
    assert len(checked_updates) - n_default > n_default + 30  # every decode update was checked this time
    assert unchecked.merges == checked.merges and (window == 5 or checked.merges > 0)  # dead losers never merge
    assert same_state(unchecked, checked)


# ----------------------------------------------------------------------------- compiled steps
def eager(cache: PolicyCache) -> PolicyCache:
    cache._step.compiling.choose = cache._step.compiling.dispose = False
    return cache


@pytest.mark.parametrize("window", [None, 10])  # a sliding-window layer: window-dead slots (sinks too) go first
@pytest.mark.parametrize(
    "config",
    [
        "h2o:budget=8,n_sink=1,recent=2,signal=proxy",
        "h2o:budget=8,n_sink=2",
        "h2o:budget=8,n_sink=0,recent=0,signal=proxy",
        "cam:budget=8,n_sink=1,min_sim=-1,signal=proxy",
        "cam:budget=8,n_sink=2,merge=sim_weighted,keys=true,signal=proxy",
    ],
)
def test_the_compiled_decode_eviction_is_the_eager_one_bit_for_bit(monkeypatch, config, window):
    """A decode eviction's compiled calls (the selector's ranks and the choice, the disposition's update, the
    write) leave exactly the buffers, positions, scores, log-weights and key norms of the same calls eager, and
    are the path decode takes."""
    from kvpolicy_core.cache import step as step_mod
    from kvpolicy_core.cache.slots import SlotStore

    taken = {"choose": 0, "dispose": 0, "write": 0}

    def counting(name, fn):
        return lambda *a, **k: (taken.__setitem__(name, taken[name] + 1), fn(*a, **k))[1]

    real_write, real_run = SlotStore.write, step_mod._run_traced
    choose, dispose = counting("choose", real_run), counting("dispose", real_run)
    # a compiled choice takes one input (n_sink), a compiled dispose two (losers, key)
    monkeypatch.setattr(step_mod, "_run_traced", lambda f, b, v, *i: (choose if len(i) == 1 else dispose)(f, b, v, *i))
    monkeypatch.setattr(
        SlotStore,
        "write",
        lambda self, *a, compiled=False: (
            taken.__setitem__("write", taken["write"] + compiled),
            real_write(self, *a, compiled=compiled),
        )[1],
    )
    keys, values = random_kv(B=2, S=40)
    fast = PolicyCache(config, window=window)
    feed(fast, keys, values, [12] + [1] * 28)
    assert fast._step.compiling.choose and fast._step.compiling.dispose  # nothing fell back
    assert taken["choose"] >= 27 and taken["write"] >= 27  # every full-buffer decode eviction
    if config.startswith("cam"):
        assert taken["dispose"] >= 20 and fast.merges > 0  # every one past the checked decode evictions
    monkeypatch.setattr(SlotStore, "write", lambda self, *a, compiled=False: real_write(self, *a, compiled=False))
    slow = eager(PolicyCache(config, window=window))
    feed(slow, keys, values, [12] + [1] * 28)
    assert same_state(fast, slow)


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
    they are and adds its scores, at decode steps (compiled or eager merge, one write) and prompt chunks."""
    from kvpolicy_cam.mass_merge import MassMergeDisposition
    from kvpolicy_core.parts import traits as part_traits

    real = MassMergeDisposition.dispose
    monkeypatch.setattr(
        MassMergeDisposition,
        "dispose",
        lambda self, *a: (lambda u: None if u is None else u._replace(d_values=None, d_keys=None))(real(self, *a)),
    )
    monkeypatch.setitem(
        part_traits._traits, MassMergeDisposition, part_traits.Traits(compile_decode=compiled, key_norms=True)
    )
    keys, values = random_kv(B=2, S=30)
    scores_only = PolicyCache("cam:budget=8,n_sink=1,signal=proxy,merge=mass_blend,min_sim=-1")
    assert scores_only._step.needs.compile_disposition == compiled
    feed(scores_only, keys, values, [12] + [1] * 18)
    assert scores_only.merges > 0 and scores_only._step.compiling.dispose
    k, v, p, _ = scores_only.state[:4]
    idx = p[..., None]  # every kept slot holds its own token's key and value, unblended
    assert mx.array_equal(k, mx.take_along_axis(keys, idx, axis=2))
    assert mx.array_equal(v, mx.take_along_axis(values, idx, axis=2))


# ----------------------------------------------------------------------------- the store's guard
def test_the_store_never_adds_a_non_finite_delta_to_a_finite_element():
    """SlotStore.add's device-side guard (what protects the cache from a decode update past the checked ones): a
    delta element that is NaN or inf is not added where the target element is finite (that element keeps its
    value), is added where it is not; a finite delta whose sum leaves float16's range saturates; finite elements of
    the same row still change."""
    from kvpolicy_core.cache.slots import SlotStore
    from kvpolicy_core.parts.base import MergeUpdate

    store = SlotStore(track_log_weights=True, track_key_norms=True)
    keys, values = random_kv(B=1, H=1, S=3, D=2, dtype=mx.float16)
    values = values.at[0, 0, 1, 1].add(math.inf)  # slot 1's second element is non-finite
    store.append(keys, values, 0, steady=9)
    t = mx.array([[[1, 2]]], dtype=mx.int32)
    d_values = mx.array([[[[0.5, math.nan], [1e6, 0.25]]]])  # added in float32: the float16 sum saturates
    store.add(
        MergeUpdate(
            t, d_values=d_values, d_scores=mx.array([[[math.inf, 2.0]]]), d_log_weights=mx.array([[[math.nan, 0.5]]])
        )
    )
    v = np.array(store.values[0, 0, :3].astype(mx.float32))
    want = np.array(values[0, 0].astype(mx.float32))
    assert v[0].tolist() == want[0].tolist() and v[1, 0] == np.float16(want[1, 0] + np.float16(0.5))
    assert np.isnan(v[1, 1])  # inf + NaN: the non-finite element may take any delta
    assert v[2, 0] == 65504 and v[2, 1] == np.float16(want[2, 1] + np.float16(0.25))  # + 1e6 saturates
    assert store.scores.tolist() == [[[0.0, 0.0, 2.0]]] and store.log_weights.tolist() == [[[0.0, 0.0, 0.5]]]


def test_the_store_adds_nothing_at_a_target_outside_the_cache():
    """SlotStore.add's other guard: a target outside the n valid slots (negative, n or more) adds nothing (MLX
    does not bounds-check a scatter), while the update's targets inside still apply."""
    from kvpolicy_core.cache.slots import SlotStore
    from kvpolicy_core.parts.base import MergeUpdate

    store = SlotStore(track_log_weights=True, track_key_norms=True)
    keys, values = random_kv(B=1, H=1, S=3, D=2)
    store.append(keys, values, 0, steady=9)  # capacity 9: slots 3.. exist in the buffers but are not valid
    store._norms()  # the key norms kept from here on
    before = [np.array(x) for x in (store.keys, store.values, store.key_norms)]
    t = mx.array([[[-1, 3, 8, 2**31 - 1, 2]]], dtype=mx.int32)
    ones = mx.ones((1, 1, 5, 2))
    store.add(MergeUpdate(t, d_keys=ones, d_values=ones, d_scores=mx.ones((1, 1, 5)), d_log_weights=mx.ones((1, 1, 5))))
    k, v, norms = (np.array(x) for x in (store.keys, store.values, store.key_norms))
    assert (v[0, 0, 2] == before[1][0, 0, 2] + 1).all() and (k[0, 0, 2] == before[0][0, 0, 2] + 1).all()
    rest = [0, 1] + list(range(3, 9))
    assert (v[0, 0, rest] == before[1][0, 0, rest]).all() and (k[0, 0, rest] == before[0][0, 0, rest]).all()
    assert (norms[0, 0, rest] == before[2][0, 0, rest]).all()
    assert store.scores.tolist() == [[[0.0, 0.0, 1.0]]] and store.log_weights.tolist() == [[[0.0, 0.0, 1.0]]]


def test_a_shipped_merge_whose_delta_exceeds_the_cache_dtype_still_merges_finite():
    """float16 values near +-60000 blended by a similarity weight near 1: the delta (~120000) is past float16's
    range, the blend is not. Past a cache's checked decode evictions, CaM's decode merge is not value-checked; its
    float32 deltas are added in float32, so the merge applies and every value stays finite."""
    keys = mx.ones((1, 1, 12, 4), mx.float16)  # identical keys: cosine 1, weight 1
    values = mx.where(mx.arange(12)[None, None, :, None] % 2 == 0, 60000.0, -60000.0) * mx.ones((1, 1, 12, 4))
    values = values.astype(mx.float16)
    cache = PolicyCache("cam:budget=8,n_sink=1,signal=proxy,merge=sim_weighted,gate=false")
    feed(cache, keys[:, :, :9], values[:, :, :9], [9])
    cache._step.checked_decode = 0  # as after the checked decode evictions
    feed(cache, keys[:, :, 9:], values[:, :, 9:], [1] * 3)
    assert cache.offset == 12 and cache.merges > 0 and mx.all(mx.isfinite(cache.values)).item()


@pytest.mark.parametrize("config", ["h2o:budget=8,n_sink=1", "cam:budget=8,n_sink=1,min_sim=-1,signal=proxy"])
def test_the_decode_route_is_picked_when_the_steps_state_changes(config):
    """PolicyStep.decode is the checked route for a cache's first CHECKED_DECODE_EVICTIONS decode evictions, then the
    steady one, whose choice and update were picked with it: no flag is read per step. A compiled call given up
    re-routes at once; a copy and an unpickled cache pick their own routes (bound to their own step)."""
    import copy
    import pickle

    from kvpolicy_core.cache.step import CHECKED_DECODE_EVICTIONS

    keys, values = random_kv(S=20)
    cache = PolicyCache(config)
    step = cache._step
    feed(cache, keys[:, :, :9], values[:, :, :9], [9])  # budget + 1 slots
    assert step.decode == step._decode_checked and step.n_evict == step._overflow
    feed(cache, keys[:, :, 9:], values[:, :, 9:], [1] * CHECKED_DECODE_EVICTIONS)
    drop = config.startswith("h2o")
    assert step.checked_decode == 0 and step.decode == step._decode_steady
    assert step._losers == step._choose_compiled
    assert step._update == (step._no_update if drop else step._dispose_compiled)
    for other in (copy.deepcopy(cache), pickle.loads(pickle.dumps(cache))):
        s = other._step
        assert s.decode == s._decode_steady and s._losers.__self__ is s and s.compiling.step is s
    step.compiling.choose = step.compiling.dispose = False
    assert step._losers == step._choose_one and step._update == (step._no_update if drop else step._disposed)
    step.checked_decode = 1
    assert step.decode == step._decode_checked
