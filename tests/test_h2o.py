"""H2O: the equations of the scorer and selector, budget, sinks, the recent window and its freeze."""

import math

import mlx.core as mx
import numpy as np
import pytest
from helpers import feed, plain_caches, random_kv, run_chunks
from reference import reference_h2o

from kvpolicy_core import KVCacheBuilder, PolicyCache

CHUNKS = [[1] * 24, [9, 1, 1, 1, 6, 1, 5], [16, 8], [3, 17, 1, 3]]


def drive(cache, K, V, chunks, Q=None, scale=None):
    feed(cache, K, V, chunks, Q, scale)
    cache.settle()
    return cache


def as_dicts(cache):
    _, _, pos, scores = cache.retained()
    pos, scores = np.array(pos), np.array(scores)
    return {
        (b, h): dict(zip(pos[b, h].tolist(), scores[b, h].tolist()))
        for b in range(pos.shape[0])
        for h in range(pos.shape[1])
    }


def assert_same(got, want):
    assert got.keys() == want.keys()
    for bh in want:
        assert sorted(got[bh]) == sorted(want[bh]), bh
        for p in want[bh]:
            assert got[bh][p] == pytest.approx(want[bh][p], abs=1e-4), (bh, p)


@pytest.mark.parametrize("chunks", CHUNKS)
@pytest.mark.parametrize("recent", [0, 3])
def test_proxy_scores_and_evictions_match_the_reference(chunks, recent):
    K, V = random_kv(B=2, H=2, S=24, D=8, seed=11)
    cache = drive(PolicyCache(f"h2o:budget=10,n_sink=2,recent={recent},signal=proxy,when=stream"), K, V, chunks)
    assert_same(as_dicts(cache), reference_h2o(np.array(K), chunks, 10, 2, recent))


@pytest.mark.parametrize("chunks", CHUNKS)
def test_observed_scores_aggregate_query_rows_and_gqa_groups(chunks):
    K, V = random_kv(B=2, H=2, S=24, D=8, seed=12)
    Q = mx.random.normal((2, 6, 24, 8), key=mx.random.key(13))  # 3 query heads per KV head
    scale = 1 / math.sqrt(8)
    cache = drive(
        PolicyCache("h2o:budget=10,n_sink=2,recent=2,signal=observed,obs_window=0,pool=1,when=stream"),
        K,
        V,
        chunks,
        Q,
        scale,
    )
    assert_same(as_dicts(cache), reference_h2o(np.array(K), chunks, 10, 2, 2, Q=np.array(Q), scale=scale))


def test_deterministic():
    K, V = random_kv(B=2, H=2, S=60, D=8, seed=5)
    runs = [
        as_dicts(drive(PolicyCache("h2o:budget=12,n_sink=2,signal=proxy"), K, V, [20] + [1] * 40)) for _ in range(2)
    ]
    assert runs[0] == runs[1]


def retained_positions_per_step(model, method, prompt, steps):
    caches = KVCacheBuilder.for_model(model, method)
    logits = model(prompt, cache=caches)
    history = []
    tok = mx.argmax(logits[:, -1], axis=-1)[:, None]
    for _ in range(steps):
        logits = model(tok, cache=caches)
        tok = mx.argmax(logits[:, -1], axis=-1)[:, None]
        caches[0].settle()
        history.append(set(np.array(caches[0].retained()[2])[0, 0].tolist()))
    return history


def test_recent_zero_freezes_on_the_prompt_and_the_default_does_not(llama_model, tokens):
    prompt = tokens[:1, :24]
    frozen = retained_positions_per_step(llama_model, "h2o:budget=12,n_sink=2,recent=0,signal=proxy", prompt, 12)
    assert all(h == frozen[0] for h in frozen) and max(frozen[0]) < 24  # every new token evicted at once
    live = retained_positions_per_step(llama_model, "h2o:budget=12,n_sink=2", prompt, 12)
    assert all(24 + i in h for i, h in enumerate(live))  # the newest token is kept
    assert len({frozenset(h) for h in live}) == 12


def test_generation_matches_plain_cache_below_budget(llama_model, tokens):
    ref = run_chunks(llama_model, plain_caches(llama_model), tokens, [30, 1, 1, 1, 1])
    got = run_chunks(
        llama_model, KVCacheBuilder.for_model(llama_model, "h2o:budget=40,signal=observed"), tokens, [30, 1, 1, 1, 1]
    )
    assert mx.array_equal(ref, got)
