"""Speculative decoding with policy caches (cache/undo.py): a trim takes back the newest tokens of the last update
exactly, refuses more, and mlx-lm's draft-model generation gives plain greedy decoding's tokens wherever no eviction
falls inside a verify step."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from helpers import SHIPPED_METHODS, random_kv, tiny_llama, with_fields
from mlx_lm.generate import generate_step, speculative_generate_step
from mlx_lm.models.cache import LRUPromptCache, make_prompt_cache

from kvpolicy_core import KVCacheBuilder, PolicyCache
from kvpolicy_core.cache.undo import UNDO_TOKENS
from kvpolicy_core.errors import KVPolicyError

#: every shipped method (the core's and its distributions' variants, and the example plugins' methods)
ALL_METHODS = SHIPPED_METHODS + ["snapkv", "pyramidkv", "chunkkv", "squeeze", "streamingllm", "streamingmerge", "tova"]


def _fused(q, k, v, cache, scale, mask):
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)


def _step(cache, K, V, Q, a, b):
    """Tokens ``a .. b - 1`` as one update, with their queries through the cache's attention (what the hook does)."""
    k, v = cache.update_and_fetch(K[:, :, a:b], V[:, :, a:b])
    out = cache.attend(Q[:, :, a:b], k, v, 0.35, cache.make_mask(b - a), _fused)
    mx.eval(out, cache.scores)


def _kv(seed=1):
    K, V = random_kv(B=1, H=2, S=80, seed=seed)
    return K, V, random_kv(B=1, H=4, S=80, seed=seed + 1)[0]


def _same(a: PolicyCache, b: PolicyCache) -> None:
    assert (a.offset, a.n) == (b.offset, b.n)
    for x, y in zip(a.retained(), b.retained()):
        np.testing.assert_array_equal(np.array(x), np.array(y))


def _decoding(method, K, V, Q):
    """A cache past its prompt (30 tokens) and 3 decode steps, then trimmed by 0 (as after a verify step)."""
    cache = PolicyCache(with_fields(method, "budget=16,n_sink=2"))
    assert cache.is_trimmable()  # empty: mlx-lm's speculative decoding asks first
    _step(cache, K, V, Q, 0, 30)
    for i in range(30, 33):
        _step(cache, K, V, Q, i, i + 1)
    assert cache.trim(0) == 0
    return cache


@pytest.mark.parametrize("method", ALL_METHODS)
def test_a_trimmed_verify_step_is_the_shorter_verify_step_bit_for_bit(method):
    """A verify step of 5 tokens trimmed by 3 is the cache that got a verify step of 2: slots, positions and scores
    bit for bit, and so are both after the next verify steps and a decode step (their evictions included)."""
    K, V, Q = _kv()
    long, short = _decoding(method, K, V, Q), _decoding(method, K, V, Q)
    _step(long, K, V, Q, 33, 38)
    assert long.is_trimmable() and long.trim(3) == 3 and long.offset == 35
    _step(short, K, V, Q, 33, 35)
    assert short.trim(0) == 0
    _same(long, short)
    for cache in (long, short):
        _step(cache, K, V, Q, 35, 39)
        assert cache.trim(1) == 1
        _step(cache, K, V, Q, 38, 39)
    _same(long, short)
    assert long.n <= 16 and long.offset == 39  # chunkkv evicts whole chunks


@pytest.mark.parametrize("method", ["h2o", "cam", "h2o:signal=proxy", "random", "tova", "snapkv"])
def test_the_first_verify_step_is_a_prompt_chunk_taken_back_exactly(method):
    """The first verify step carries the prompt's last token: a held prompt chunk. Trimmed, it is the shorter chunk;
    the trim ends the prompt, so the next short update cuts it and is scored as decode steps."""
    K, V, Q = _kv(3)
    caches = []
    for n in (5, 2):
        cache = PolicyCache(with_fields(method, "budget=16,n_sink=2"))
        assert cache.is_trimmable()
        _step(cache, K, V, Q, 0, 30)
        _step(cache, K, V, Q, 30, 30 + n)
        assert cache.trim(n - 2) == n - 2
        caches.append(cache)
    _same(*caches)
    for cache in caches:
        _step(cache, K, V, Q, 32, 35)
        assert cache.n == 16 + 3  # cut to the budget first, then the 3 tokens appended
    _same(*caches)


@pytest.mark.parametrize("method", ["h2o", "cam", "random"])
def test_a_trim_beyond_the_last_update_is_refused_and_changes_nothing(method):
    K, V, Q = _kv(5)
    cache = _decoding(method, K, V, Q)
    _step(cache, K, V, Q, 33, 34)  # a decode step: nothing on record (it wrote into an evicted slot)
    assert not cache.is_trimmable()
    before = [np.array(x) for x in cache.retained()]
    with pytest.raises(KVPolicyError, match="can take back only the newest 0"):
        cache.trim(1)
    _step(cache, K, V, Q, 34, 37)  # after the trim: a verify step
    with pytest.raises(KVPolicyError, match="only the newest 3"):
        cache.trim(4)
    assert cache.offset == 37 and cache.trim(3) == 3 and cache.offset == 34
    assert all(np.array_equal(a, np.array(b)) for a, b in zip(before, cache.retained()))
    assert UNDO_TOKENS >= 16


def test_mlx_lm_prompt_cache_still_reuses_an_untrimmable_cache_only_as_a_prefix():
    """A cache nobody asked about while empty keeps no record of its prompt chunks: mlx-lm's prompt cache (the
    server's) does not trim it, as before."""
    model = tiny_llama(seed=2)
    caches = KVCacheBuilder.for_model(model, "h2o:budget=16")
    model(mx.array([[1, 2, 3, 4, 5, 6]]), cache=caches)
    lru = LRUPromptCache()
    lru.insert_cache("m", [1, 2, 3, 4, 5, 6], caches)
    cache, rest = lru.fetch_nearest_cache("m", [1, 2, 3, 9])
    assert cache is None and rest == [1, 2, 3, 9]


def _greedy(model, caches, prompt, n):
    return [int(t) for t, _ in zip((t for t, _ in generate_step(prompt, model, prompt_cache=caches)), range(n))]


def _speculative(model, draft, caches, prompt, n, k):
    out = list(
        speculative_generate_step(
            prompt, model, draft, prompt_cache=caches + make_prompt_cache(draft), max_tokens=n, num_draft_tokens=k
        )
    )
    return [int(t) for t, _, _ in out], sum(d for _, _, d in out)


@pytest.fixture(scope="module")
def models():
    return tiny_llama(seed=0), tiny_llama(seed=1)


@pytest.mark.parametrize("method", ALL_METHODS)
def test_speculative_decoding_equals_greedy_where_nothing_is_evicted(models, method):
    """Every shipped method under mlx-lm's draft-model generation (a random draft: rejections; the model itself as
    its draft: every draft accepted) gives plain greedy decoding's tokens while the budget holds everything."""
    model, other = models
    prompt = mx.array(list(range(3, 43)), dtype=mx.uint32)
    build = lambda: KVCacheBuilder.for_model(model, with_fields(method, "budget=128"))  # noqa: E731
    plain = _greedy(model, build(), prompt, 40)
    assert plain == _greedy(model, make_prompt_cache(model), prompt, 40)
    for draft, k in ((other, 3), (model, 2)):
        got, accepted = _speculative(model, draft, build(), prompt, 40, k)
        assert got == plain
        assert accepted > 0


@pytest.mark.parametrize("method", ["h2o", "cam", "random", "tova"])
def test_speculative_decoding_with_evictions_runs_within_the_budget(models, method):
    """With evictions inside verify steps the tokens may part from greedy decoding's; the cache stays within its
    budget plus one verify step."""
    model, other = models
    prompt = mx.array(list(range(3, 43)), dtype=mx.uint32)
    caches = KVCacheBuilder.for_model(model, with_fields(method, "budget=16,n_sink=2"))
    got, _ = _speculative(model, other, caches, prompt, 48, 3)
    assert len(got) == 48 and all(c.n <= 16 + 4 for c in caches)
    assert caches[0].offset in (40 + 48 - 1, 40 + 48)  # the last verify step may leave its last token unfed


@pytest.mark.parametrize("method", ["h2o", "cam", "h2o:signal=proxy", "tova", "random"])
def test_no_host_sync_on_a_verify_step_at_steady_state(models, method):
    """Past the first checked evictions, a verify step, its overflow's eviction (m losers at once) and its trim make
    no host sync in kvpolicy's code (mlx-lm reads the tokens back itself)."""
    from host_syncs import HostSyncs

    model, other = models
    caches = KVCacheBuilder.for_model(model, with_fields(method, "budget=16,n_sink=2"))
    prompt = mx.array(list(range(3, 43)), dtype=mx.uint32)
    gen = speculative_generate_step(
        prompt, model, other, prompt_cache=caches + make_prompt_cache(other), max_tokens=60, num_draft_tokens=3
    )
    counts = []
    with HostSyncs(["kvpolicy_core", "kvpolicy_h2o", "kvpolicy_cam"]) as syncs:
        for i, _ in enumerate(gen):
            if i >= 30:
                counts.append(len(syncs.calls))
            syncs.reset()
    assert len(counts) == 30 and sum(counts) == 0, syncs.calls
