"""The one decode write (SlotStore.write): its compiled call, its eager fallback, and the stacked rows' use of it."""

from __future__ import annotations

import mlx.core as mx
from helpers import feed, random_kv

from kvpolicy_core import PolicyCache
from kvpolicy_core.cache.slots import Choice, SlotStore, Token
from kvpolicy_core.parts.base import MergeUpdate
from kvpolicy_core.parts.lowest_score import LowestScoreSelector


def same_state(a: PolicyCache, b: PolicyCache) -> bool:
    return a.offset == b.offset and all(
        mx.array_equal(x, y) if isinstance(x, mx.array) else x == y for x, y in zip(a.state, b.state)
    )


def test_a_choice_whose_selector_cannot_be_traced_is_made_by_the_checked_selection(monkeypatch):
    """H2O's fused choice with a selector that mx.compile cannot trace (a host read in rank): the write falls
    back to the step's own selection, keeps doing so, and leaves exactly the cache the unfused step leaves."""
    real = LowestScoreSelector.rank
    monkeypatch.setattr(LowestScoreSelector, "rank", lambda self, view: (view.scores.sum().item(), real(self, view))[1])
    keys, values = random_kv(B=2, S=30)
    written = []
    real_write = SlotStore.write
    monkeypatch.setattr(
        SlotStore,
        "write",
        lambda self, t, losers, *a, **k: (
            written.append(isinstance(losers, Choice)),
            real_write(self, t, losers, *a, **k),
        )[1],
    )
    fused = PolicyCache("h2o:budget=8,n_sink=1,signal=proxy")
    feed(fused, keys, values, [12] + [1] * 18)
    assert written[0] and not any(written[1:])  # one Choice tried, then the checked selection
    assert fused._step.compiling.select is False
    unfused = PolicyCache("h2o:budget=8,n_sink=1,signal=proxy")
    unfused._step.fuses_drop = False
    feed(unfused, keys, values, [12] + [1] * 18)
    assert same_state(fused, unfused)


def test_a_compiled_write_that_cannot_be_traced_writes_the_same_eager():
    """A merge update whose graph fails to trace (log-weight deltas for a store without log-weights: add raises
    inside the trace) is retried eager, which raises the same error, and nothing is written."""
    store = SlotStore()
    k = mx.random.normal((1, 2, 4, 3), key=mx.random.key(0))
    store.append(k, k, 0, 3)
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
        s.append(k, k, 0, 5)
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


def test_a_fused_choice_that_reads_key_norms_makes_the_store_keep_them_new_token_included(monkeypatch):
    """H2O's fused choice (a Choice traced into the write) with a selector whose ranking reads ``view.key_norms``,
    first read at a decode step: that write makes the store keep the norms, the new token's included, so every
    later step's view has them kept (the eager path's rule); the choices are the unfused step's, slot for slot."""
    real = LowestScoreSelector.rank
    monkeypatch.setattr(LowestScoreSelector, "rank", lambda self, view: real(self, view) + view.key_norms)
    keys, values = random_kv(B=2, S=30)
    written = []
    real_write = SlotStore.write

    def write(self, t, losers, *a, **k):
        written.append(isinstance(losers, Choice))
        return real_write(self, t, losers, *a, **k)

    monkeypatch.setattr(SlotStore, "write", write)
    fused = PolicyCache("h2o:budget=8,n_sink=1,signal=proxy")
    feed(fused, keys, values, [9] + [1] * 14)  # the prompt evicts nothing: the first read is inside the Choice
    assert written[0] and not any(written[1:])  # the Choice read norms: kept from then on, no Choice needed
    sl = fused._slots
    assert sl.track_key_norms and sl.key_norms is not None
    norms = mx.sqrt((sl.keys[..., : sl.n, :].astype(mx.float32) ** 2).sum(axis=-1))
    assert mx.allclose(sl.key_norms[..., : sl.n], norms)
    unfused = PolicyCache("h2o:budget=8,n_sink=1,signal=proxy")
    unfused._step.fuses_drop = False
    feed(unfused, keys, values, [9] + [1] * 14)
    assert same_state(fused, unfused) and mx.array_equal(sl.key_norms, unfused._slots.key_norms)
