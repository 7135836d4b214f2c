"""Observation-window scorer: its equation against a slow reference, pooling, and the config that selects it."""

import math

import mlx.core as mx
import numpy as np
import pytest
from helpers import random_kv
from reference import reference_window
from test_h2o import as_dicts, assert_same, drive

from kvpolicy_core import ConfigError, KVCacheBuilder, PolicyCache, parse_config
from kvpolicy_core.config.policy import build_policy
from kvpolicy_core.parts.observation_window import ObservationWindowScorer, pool_by_position

CHUNKS = [[24], [9, 1, 1, 1, 6, 1, 5], [16, 8], [3, 17, 1, 3], [2, 3, 4, 15]]  # the last two: runs of chunks


@pytest.mark.parametrize("chunks", CHUNKS)
@pytest.mark.parametrize("W,P", [(4, 3), (0, 5), (32, 1), (6, 7)])
def test_observed_window_scores_and_evictions_match_the_reference(chunks, W, P):
    K, V = random_kv(B=2, H=2, S=24, D=8, seed=21)
    Q = mx.random.normal((2, 6, 24, 8), key=mx.random.key(22))  # 3 query heads per KV head
    scale = 1 / math.sqrt(8)
    spec = f"h2o:budget=10,n_sink=2,recent=2,signal=observed,obs_window={W},pool={P},when=stream"
    cache = drive(PolicyCache(spec), K, V, chunks, Q, scale)
    want = reference_window(np.array(K), chunks, 10, 2, 2, W, P, Q=np.array(Q), scale=scale)
    assert_same(as_dicts(cache), want)


@pytest.mark.parametrize("chunks", CHUNKS[1:])
def test_proxy_window_scores_match_the_reference(chunks):
    K, V = random_kv(B=1, H=2, S=24, D=8, seed=23)
    cache = drive(
        PolicyCache("h2o:budget=10,n_sink=2,recent=3,signal=proxy,obs_window=4,pool=3,when=stream"), K, V, chunks
    )
    assert_same(as_dicts(cache), reference_window(np.array(K), chunks, 10, 2, 3, 4, 3))


@pytest.mark.parametrize("W,P", [(32, 15), (4, 3), (0, 5)])
@pytest.mark.parametrize("signal", ["observed", "proxy"])
def test_a_prompt_in_chunks_scores_as_in_one_chunk_while_nothing_is_evicted(W, P, signal):
    """However a prompt that fits the budget is split (prefill steps, a prefix reused from a prompt
    cache), its scores, and so every later eviction, are those of the prompt in one chunk."""
    K, V = random_kv(B=1, H=2, S=40, D=8, seed=26)
    Q = mx.random.normal((1, 4, 40, 8), key=mx.random.key(27))
    spec = f"h2o:budget=26,n_sink=2,signal={signal},obs_window={W},pool={P},when=stream"
    runs = [drive(PolicyCache(spec), K, V, chunks + [1] * 16, Q, 0.3) for chunks in ([24], [5, 7, 12], [3, 21])]
    want = runs[0].state[:4]
    for cache in runs[1:]:
        for a, b in zip(cache.state[:4], want):
            np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-5, atol=1e-6)
    # after an eviction a new run starts: 30 tokens (4 evicted), then 4, is not the same as 34 at once
    split = drive(PolicyCache(spec), K, V, [30, 4], Q, 0.3)
    whole = drive(PolicyCache(spec), K, V, [34], Q, 0.3)
    assert not np.array_equal(np.array(split.retained()[3]), np.array(whole.retained()[3]))


def test_decode_steps_are_the_cumulative_scorer():
    """Token by token (S == 1 always) the window scorer is exactly observed H2O."""
    K, V = random_kv(B=1, H=2, S=40, D=8, seed=24)
    Q = mx.random.normal((1, 4, 40, 8), key=mx.random.key(25))
    runs = [
        as_dicts(drive(PolicyCache(f"h2o:budget=12,signal=observed{extra}"), K, V, [1] * 40, Q, 0.3))
        for extra in ("", ",obs_window=0,pool=1")
    ]
    assert runs[0] == runs[1]


def test_pooling_follows_positions_not_slots():
    x = mx.array([[[0.0, 5.0, 0.0, 0.0, 1.0, 0.0]]])
    pos = mx.array([[[10, 3, 7, 4, 20, 5]]], dtype=mx.int32)  # sorted: 3 4 5 7 10 20
    got = np.array(pool_by_position(x, pos, 3))[0, 0]
    # sorted values 5 0 0 0 0 1 -> pooled 5 5 0 0 1 1, scattered back to slots
    np.testing.assert_array_equal(got, [1.0, 5.0, 0.0, 5.0, 1.0, 0.0])


def test_a_span_is_kept_whole():
    """One token draws the window's attention; pooling keeps its neighbours with it."""
    D, T = 8, 40
    K = mx.zeros((1, 1, T, D)).at[0, 0, 20].add(mx.ones((D,)) * 4)  # the "needle" key
    V = mx.zeros((1, 1, T, D))
    Q = mx.zeros((1, 1, T, D)).at[0, 0, T - 4 :].add(mx.ones((4, D)))  # the question looks at it
    for P, want in ((1, {20}), (5, {18, 19, 20, 21, 22})):
        cache = PolicyCache(f"h2o:budget=14,n_sink=0,recent=4,obs_window=4,pool={P}")
        drive(cache, K, V, [T - 1, 1], Q, 1.0)
        kept = set(np.array(cache.retained()[2])[0, 0].tolist())
        assert want <= kept


def test_a_taper_orders_a_plateau_by_distance_and_nothing_else():
    x = mx.array([[[0.0, 0.0, 0.0, 5.0, 0.0, 0.0, 0.0, 0.0, 2.0, 0.0]]])
    pos = mx.arange(10, dtype=mx.int32)[None, None]
    plain = np.array(pool_by_position(x, pos, 5))[0, 0]
    tapered = np.array(pool_by_position(x, pos, 5, taper=1e-6))[0, 0]
    np.testing.assert_array_equal(plain, [0, 5, 5, 5, 5, 5, 2, 2, 2, 2])  # a plateau: ties
    assert tapered[3] == 5.0 and tapered[2] == tapered[4] > tapered[1] == tapered[5] > tapered[6]
    np.testing.assert_allclose(tapered, plain, rtol=3e-6)  # a tie-break, not a new score
    assert np.array_equal(np.argsort(-tapered, kind="stable")[:5], [3, 2, 4, 1, 5])


def test_the_cut_keeps_the_middle_of_a_span_the_budget_splits():
    """At the end-of-prompt cut a pooled span is one plateau; a budget that holds only part of it keeps the tokens
    nearest the one the question attends to (the needle), not an arbitrary part."""
    D, T = 8, 40
    K = mx.zeros((1, 1, T, D)).at[0, 0, 20].add(mx.ones((D,)) * 4)
    V = mx.zeros((1, 1, T, D))
    Q = mx.zeros((1, 1, T, D)).at[0, 0, T - 4 :].add(mx.ones((4, D)))
    cache = PolicyCache("h2o:budget=9,n_sink=0,obs_window=4,pool=9")  # 4 for the window, 5 of the 9-token span
    assert cache.policy.scorer.taper > 0
    drive(cache, K, V, [T - 1, 1], Q, 1.0)
    kept = set(np.array(cache.retained()[2])[0, 0].tolist())
    assert {18, 19, 20, 21, 22} <= kept, sorted(kept)


def test_config_defaults_and_the_v01_behaviour():
    h2o = build_policy("h2o:budget=64")
    assert type(h2o.scorer) is ObservationWindowScorer and (h2o.scorer.window, h2o.scorer.pool) == (32, 31)
    assert build_policy("h2o:budget=64,when=stream").scorer.pool == 15
    assert h2o.scorer.taper > 0 and build_policy("cam:budget=64,when=stream").scorer.taper == 0.0
    assert h2o.scorer.signal == "observed"
    for spec in ("h2o:signal=proxy", "cam:signal=proxy", "h2o:signal=observed,obs_window=0,pool=1"):
        assert type(build_policy(spec).scorer).__name__ == "CumulativeAttentionScorer", spec
    assert parse_config("cam:signal=proxy").policy.obs_window_rows == 0
    with pytest.raises(ConfigError, match="pool must be odd"):
        parse_config("h2o:pool=4")
    with pytest.raises(ConfigError, match="obs_window"):
        parse_config("cam:obs_window=-1")


def test_default_h2o_runs_on_a_model_through_the_hook(llama_model, tokens):
    caches = KVCacheBuilder.for_model(llama_model, "h2o:budget=16")
    llama_model(tokens[:1, :30], cache=caches)
    llama_model(tokens[:1, 30:31], cache=caches)
    assert caches[0].tokens_kept == 16 and float(mx.sum(caches[0].scores)) > 0


@pytest.mark.parametrize("mask", ["causal", "array"])
def test_a_chunk_filling_the_window_keeps_its_queries_not_its_rows_and_a_short_chunk_after_it_scores_the_same(
    mask, tmp_path
):
    """A held prompt's run keeps, for a chunk longer than the window, the window's queries (W x D per query head)
    instead of its attention rows (W x L per KV head); a later chunk shorter than the window computes those rows
    again from them, and the scores are bit for bit those of rows kept whole (and of a cache saved and restored
    between the two chunks)."""
    from kvpolicy_core import load_caches, save_caches
    from kvpolicy_core.parts.observation_window import WINDOW_QUERIES

    K, V = random_kv(B=1, H=2, S=45, D=8, seed=31)
    Q = mx.random.normal((1, 4, 45, 8), key=mx.random.key(32))
    spec = "h2o:budget=16,n_sink=2,obs_window=8,pool=3,when=prompt_end"

    def first_chunk(cache):
        cache.update_and_fetch(K[:, :, :40], V[:, :, :40])
        m = "causal" if mask == "causal" else mx.tril(mx.ones((40, 40), dtype=mx.bool_))
        cache.before_attention(Q[:, :, :40], 0.3, m)
        return cache

    def short_chunk(cache):  # two chunks shorter than the window: the second needs rows of both earlier chunks
        for a, b in ((40, 42), (42, 45)):
            cache.update_and_fetch(K[:, :, a:b], V[:, :, a:b])
            cache.before_attention(Q[:, :, a:b], 0.3, "causal")
        return np.array(cache.scores)

    cache = first_chunk(PolicyCache(spec))
    run = cache.row_state().run
    assert "rows" not in run and set(WINDOW_QUERIES[:3]) <= set(run)
    assert run["window_queries"].shape == (1, 4, 8, 8)
    restored = PolicyCache.from_state(cache.state, cache.meta_state)
    assert "window_queries" in restored.row_state().run
    save_caches(tmp_path / "c.safetensors", [cache])  # and through a cache file, in the window's form
    (loaded,) = load_caches(tmp_path / "c.safetensors")
    assert "window_queries" in loaded.row_state().run
    got = short_chunk(cache)

    kept = PolicyCache(spec)  # the same run with the rows kept whole, as computed at the first chunk (the form before)
    scorer = kept.policy.scorer
    scorer._add = lambda view, weights, S, source=None: ObservationWindowScorer._add(scorer, view, weights, S)
    first_chunk(kept)
    assert "rows" in kept.row_state().run and "window_queries" not in kept.row_state().run
    np.testing.assert_array_equal(got, short_chunk(kept))
    np.testing.assert_array_equal(got, short_chunk(restored))
    np.testing.assert_array_equal(got, short_chunk(loaded))
