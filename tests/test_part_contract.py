"""The part contract: one declaration (``Needs``) drives the cache, the 0.2 flags still do (deprecated),
``view.offset`` is one type on every path, and ``view.key_norms`` is there without asking."""

from __future__ import annotations

import math
import warnings

import mlx.core as mx
import numpy as np
import pytest
from helpers import SHIPPED_METHODS, feed, random_kv, with_fields

from kvpolicy_core import Disposition, Needs, PluginError, PolicyCache, Scorer, Selector
from kvpolicy_core.cache.batch import BatchPolicyCache
from kvpolicy_core.cache.batch_rows import can_stack
from kvpolicy_core.cache.step import Compiling
from kvpolicy_core.config.policy import build_policy
from kvpolicy_core.parts import traits
from kvpolicy_core.parts.base import OLD_FLAGS, CacheView, policy_needs
from kvpolicy_core.parts.lowest_score import LowestScoreSelector

BASE = "h2o:budget=8,n_sink=1,recent=1,signal=proxy"


def policy_with(**parts):
    return build_policy(BASE)._replace(**parts)


def deprecations(fn):
    """(fn's result, the messages of the DeprecationWarnings it raised)."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        out = fn()
    return out, [str(w.message) for w in seen if issubclass(w.category, DeprecationWarning)]


class QueryScorer(Scorer):
    """s_j += sum_{heads, rows} q . k_j (a toy observed signal: on_attention runs only when it is needed)."""

    def on_attention(self, view, queries, scale, mask):
        B, H = view.keys.shape[:2]
        q = queries.reshape(B, H, -1, queries.shape[-1])
        return view.scores + (q @ view.keys.swapaxes(-1, -2)).sum(axis=2)


class PositionScorer(Scorer):
    """s_j = pos_j: a token's score is its own."""

    def on_append(self, view, new_keys, new_positions):
        return view.positions.astype(mx.float32)


class OldestSelector(Selector):
    def rank(self, view):
        return mx.where(view.positions < 1, math.inf, view.positions.astype(mx.float32))


def _trimmable(cache):
    K, V = random_kv(B=1, S=6)
    feed(cache, K, V, (6,))
    return cache.is_trimmable()


def _observed(cache):
    K, V = random_kv(B=1, S=12)
    feed(cache, K, V, (6, 1, 1, 1, 1, 1, 1))
    return np.array(cache.retained()[3])


def _log_weights(cache):
    K, V = random_kv(B=1, S=13)
    feed(cache, K, V, (12, 1))
    return cache.log_weights is not None


def _stacks(cache):
    K, V = random_kv(B=1, S=9)
    other = PolicyCache(cache.policy)
    for c in (cache, other):
        feed(c, K, V, (9,))  # budget + 1 slots: the decode steady state
    return can_stack([cache, other])


@pytest.mark.parametrize("method", SHIPPED_METHODS)
def test_shipped_parts_declare_needs_and_set_no_old_flag(method):
    cache, said = deprecations(lambda: PolicyCache(with_fields(method, "budget=16,n_sink=2")))
    assert said == []
    flags = set(OLD_FLAGS) | set(traits.REMOVED_FLAGS)
    for part in (cache.policy.scorer, cache.policy.selector, cache.policy.disposition):
        assert not [f for f in flags if hasattr(part, f)], type(part)
    for base in (Scorer, Selector, Disposition):
        assert not [f for f in flags if hasattr(base, f)] and base.needs == Needs()


def test_a_need_only_a_scorer_may_declare_and_a_needs_of_the_wrong_type_are_plugin_errors():
    class Watching(OldestSelector):
        needs = Needs(attention=True)

    class Dict(QueryScorer):
        needs = {"attention": True}

    with pytest.raises(PluginError, match=r"Needs\(attention=True\), which only a scorer may declare"):
        PolicyCache(policy_with(selector=Watching()))
    with pytest.raises(PluginError, match="needs must be a kvpolicy_core.Needs"):
        policy_needs(policy_with(scorer=Dict()))


# ---------------------------------------------------------------- view.offset: one type on every path
SEEN = []


def note(where: str, view: CacheView) -> None:
    off = view.offset
    try:
        value = np.array(off)
    except Exception:  # inside a compiled graph: a tracer, no values
        value = None
    SEEN.append((where, type(off), off.dtype, tuple(off.shape), view.keys.shape[0], value))


class SeeingScorer(QueryScorer):
    needs = Needs(attention=True, batch_rows=True)

    def on_append(self, view, new_keys, new_positions):
        note("on_append", view)
        return view.scores

    def on_attention(self, view, queries, scale, mask):
        note("on_attention", view)
        return super().on_attention(view, queries, scale, mask)


class SeeingSelector(OldestSelector):
    needs = Needs(batch_rows=True)

    def rank(self, view):
        note("rank", view)
        return super().rank(view)


class SeeingDisposition(Disposition):
    needs = Needs(batch_rows=True)

    def dispose(self, view, losers, key):
        note("dispose", view)
        return None


def offsets_seen():
    assert SEEN
    for where, kind, dtype, shape, B, value in SEEN:
        assert kind is mx.array and dtype == mx.int32 and shape == (B, 1, 1), (where, kind, dtype, shape)
    return SEEN


def test_view_offset_is_int32_b11_on_prefill_decode_and_compiled_decode(monkeypatch):
    SEEN.clear()
    cache = PolicyCache(policy_with(scorer=SeeingScorer(), selector=SeeingSelector(), disposition=SeeingDisposition()))
    K, V = random_kv(B=2, S=20)
    feed(cache, K, V, (12, 1, 1, 5, 1))  # a chunk over budget (E = 4), decode evictions, a chunk, decode
    seen = offsets_seen()
    assert {w for w, *_ in seen} == {"on_append", "on_attention", "rank", "dispose"}
    assert [int(v.max()) for *_, v in seen if v is not None] and all(
        v is None or (v == v.flat[0]).all() for *_, v in seen
    )
    assert [int(v.flat[0]) for w, *_, v in seen if w == "on_append"] == [12, 13, 14, 19, 20]

    SEEN.clear()  # core's selector, compiled at decode (the selection alone, and fused with drop's write)
    rank = LowestScoreSelector.rank
    monkeypatch.setattr(LowestScoreSelector, "rank", lambda self, view: (note("compiled", view), rank(self, view))[1])
    for config in (BASE, "cam:budget=8,n_sink=1,signal=proxy,min_sim=-1"):
        cache = PolicyCache(config)
        assert cache._step.needs.compile_selector
        feed(cache, K, V, (9,) + (1,) * 11)
        assert cache._step.compiling == Compiling(choose=True, dispose=True)
    assert any(value is None for *_, value in offsets_seen())  # seen inside a compiled graph


def test_view_offset_is_int32_b11_on_a_batchs_stacked_rows():
    SEEN.clear()
    policy = policy_with(scorer=SeeingScorer(), selector=SeeingSelector(), disposition=SeeingDisposition())
    K, V = random_kv(B=1, S=24)
    rows = []
    for prompt in (9, 11):
        row = PolicyCache(policy)
        feed(row, K, V, (prompt,))
        rows.append(row)
    batch = BatchPolicyCache(rows)
    for t in range(4):  # the first step settles the rows' pending evictions one by one; then they are stacked
        SEEN.clear()
        k, v = (mx.repeat(x[:, :, 11 + t : 12 + t], 2, axis=0) for x in (K, V))
        batch.update_and_fetch(k, v)
        batch.before_attention(k, 8**-0.5, None)
        assert (batch._stacked is not None) == (t > 0)
        seen = offsets_seen()
        if t > 0:
            assert [v.reshape(-1).tolist() for w, *_, v in seen if w == "rank"] == [[9 + t, 11 + t]]
            assert all(B == 2 for *_, B, _ in seen)


def test_a_part_written_against_the_int_offset_is_refused_once_naming_the_array_offset():
    """A 0.2 scorer that builds a range from ``view.offset`` as a Python int fails on the array: it is called once
    (no retry on the same run state: the int-offset compatibility path of 0.2 is gone) and the error names the
    part and says that the offset is an array."""
    calls = []

    class IntRecent(Scorer):
        def on_append(self, view, new_keys, new_positions):
            calls.append(new_keys.shape[2])
            recent = mx.arange(view.offset - 3, view.offset)  # needs the Python int
            return mx.where((view.positions[..., None] == recent).any(axis=-1), 1.0, view.scores)

    K, V = random_kv(B=2, S=16)
    cache = PolicyCache(policy_with(scorer=IntRecent()))
    with pytest.raises(PluginError, match=r"(?s)scorer.*raised TypeError.*view.offset is an int32 mx.array"):
        feed(cache, K, V, (7,))
    assert calls == [7] and cache.offset == 0  # called once; nothing changed


# ---------------------------------------------------------------- key norms without a flag
class NormReader(Disposition):
    """Reads view.key_norms at every eviction (no flag): records (norms, keys)."""

    def __init__(self):
        self.seen = []

    def dispose(self, view, losers, key):
        self.seen.append((np.array(view.key_norms), np.array(view.keys, dtype=np.float32)))
        return None


def test_key_norms_are_there_without_a_flag_and_are_the_norms_of_the_keys():
    reader = NormReader()
    cache = PolicyCache(policy_with(disposition=reader))
    assert not cache._slots.track_key_norms
    K, V = random_kv(B=2, S=30)
    feed(cache, K, V, (12, 1, 1, 1, 6, 1, 1, 1, 1, 1, 1, 1, 1, 1))
    assert len(reader.seen) >= 10
    for norms, keys in reader.seen:
        assert norms.dtype == np.float32 and norms.shape == keys.shape[:3]
        np.testing.assert_allclose(norms, np.linalg.norm(keys, axis=-1), rtol=1e-6, atol=1e-6)
    assert cache._slots.track_key_norms and cache._slots.key_norms is not None  # kept from the first read on

    h2o = PolicyCache(BASE)  # no part reads them: none kept, none computed
    feed(h2o, K, V, (12,) + (1,) * 10)
    assert h2o._slots.key_norms is None and not h2o._slots.track_key_norms

    view = CacheView(K, V, mx.zeros(K.shape[:3], mx.int32), mx.zeros(K.shape[:3]), 30, 0, None)  # built by hand
    np.testing.assert_allclose(np.array(view.key_norms), np.linalg.norm(np.array(K), axis=-1), rtol=1e-6)
    assert view.offset.shape == (2, 1, 1) and view.offset.dtype == mx.int32 and (np.array(view.offset) == 30).all()


def test_a_part_that_fails_whatever_the_offset_is_still_a_plugin_error():
    class Broken(Scorer):
        def on_append(self, view, new_keys, new_positions):
            view.offset  # noqa: B018  read, then fail for another reason
            raise TypeError("not about the offset")

    cache = PolicyCache(policy_with(scorer=Broken()))
    K, V = random_kv(B=1, S=4)
    with pytest.raises(PluginError, match="raised TypeError: not about the offset"):
        feed(cache, K, V, (4,))
    assert cache.offset == 0 and cache.keys is None
