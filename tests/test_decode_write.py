"""The one decode write (SlotStore.write) and the decode choice: compiled calls, their eager fallbacks."""

from __future__ import annotations

import mlx.core as mx
from helpers import feed, random_kv

from kvpolicy_core import PolicyCache
from kvpolicy_core.cache.slots import SlotStore, Token
from kvpolicy_core.parts.base import MergeUpdate
from kvpolicy_core.parts.lowest_score import LowestScoreSelector


def same_state(a: PolicyCache, b: PolicyCache) -> bool:
    return a.offset == b.offset and all(
        mx.array_equal(x, y) if isinstance(x, mx.array) else x == y for x, y in zip(a.state, b.state)
    )


def eager(config: str) -> PolicyCache:
    cache = PolicyCache(config)
    cache._step.compiling.choose = cache._step.compiling.dispose = False
    return cache


def test_a_selector_that_cannot_be_traced_chooses_eager_from_then_on_with_the_same_losers(monkeypatch):
    """A decode choice whose rank mx.compile cannot trace (a host read in rank): the step falls back to the eager
    choice, keeps doing so, and leaves exactly the cache the eager choice leaves."""
    real = LowestScoreSelector.rank
    monkeypatch.setattr(LowestScoreSelector, "rank", lambda self, view: (view.scores.sum().item(), real(self, view))[1])
    keys, values = random_kv(B=2, S=30)
    tried = PolicyCache("h2o:budget=8,n_sink=1,signal=proxy")
    feed(tried, keys, values, [12] + [1] * 18)
    assert tried._step.compiling.choose is False
    plain = eager("h2o:budget=8,n_sink=1,signal=proxy")
    feed(plain, keys, values, [12] + [1] * 18)
    assert same_state(tried, plain)


def test_a_compiled_write_that_cannot_be_traced_writes_the_same_eager():
    """A merge update whose graph fails to trace (log-weight deltas for a store without log-weights: add raises
    inside the trace) is retried eager, which raises the same error, and nothing is written."""
    store = SlotStore()
    k = mx.random.normal((1, 2, 4, 3), key=mx.random.key(0))
    store.append(k, k, 0, 4)
    before = store.snapshot()
    slots = mx.zeros((1, 2, 1), mx.int32)
    u = MergeUpdate(slots + 1, None, None, mx.ones((1, 2, 1)), None, d_log_weights=mx.ones((1, 2, 1)))
    try:
        store.write(Token(k[:, :, :1], k[:, :, :1], 4), slots, u, compiled=True)
    except ValueError as exc:
        assert "d_log_weights" in str(exc)
    else:
        raise AssertionError("expected a ValueError")
    assert all(x is y for x, y in zip(store.snapshot(), before))


def test_a_write_compiled_and_eager_give_the_same_buffers_bit_for_bit():
    """SlotStore.write with a one-target merge: compiled and eager leave the same keys, values, positions, scores,
    log-weights and key norms; a per-row offset [B, 1, 1] (stacked rows) is each row's position."""
    k = mx.random.normal((2, 2, 6, 4), key=mx.random.key(1))
    stores = []
    for compiled in (True, False):
        s = SlotStore(track_log_weights=True, track_key_norms=True)
        s.append(k, k, 0, 6)
        s._norms()
        t = mx.array([[[1], [2]], [[3], [4]]], dtype=mx.int32)
        u = MergeUpdate(t, 0.5 * k[:, :, :1], k[:, :, 1:2], mx.ones((2, 2, 1)), None, d_log_weights=mx.ones((2, 2, 1)))
        offset = mx.array([6, 9], dtype=mx.int32).reshape(2, 1, 1)
        s.write(Token(k[:, :, 5:6] + 1, k[:, :, 5:6], offset), mx.zeros((2, 2, 1), mx.int32), u, compiled=compiled)
        stores.append(s)
    a, b = stores
    for f in ("keys", "values", "positions", "scores", "log_weights", "key_norms"):
        assert mx.array_equal(getattr(a, f), getattr(b, f)), f
    assert a.positions[:, :, 0].tolist() == [[6, 6], [9, 9]]


def test_a_compiled_choice_that_reads_key_norms_makes_the_store_keep_them_new_token_included(monkeypatch):
    """A compiled decode choice whose ranking reads ``view.key_norms``, first read at a decode step: the store keeps
    the norms from then on, the new token's included (the eager path's rule); the choices are the eager step's."""
    real = LowestScoreSelector.rank
    monkeypatch.setattr(LowestScoreSelector, "rank", lambda self, view: real(self, view) + view.key_norms)
    keys, values = random_kv(B=2, S=30)
    compiled = PolicyCache("h2o:budget=8,n_sink=1,signal=proxy")
    feed(compiled, keys, values, [9] + [1] * 14)  # the prompt evicts nothing: the first read is a compiled one
    assert compiled._step.compiling.choose
    sl = compiled._slots
    assert sl.track_key_norms and sl.key_norms is not None
    norms = mx.sqrt((sl.keys[..., : sl.n, :].astype(mx.float32) ** 2).sum(axis=-1))
    assert mx.allclose(sl.key_norms[..., : sl.n], norms)
    plain = eager("h2o:budget=8,n_sink=1,signal=proxy")
    feed(plain, keys, values, [9] + [1] * 14)
    assert same_state(compiled, plain) and mx.array_equal(sl.key_norms, plain._slots.key_norms)
