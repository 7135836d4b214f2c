"""Hostile inputs, plugin faults during generation, and persistence."""

import math

import mlx.core as mx
import numpy as np
import pytest
from helpers import SHIPPED_METHODS, VOCAB, plain_caches, random_kv, run_chunks, tiny_llama, with_fields

from kvpolicy_core import (
    CacheFileError,
    KVCacheBuilder,
    MethodSpec,
    PluginError,
    PolicyCache,
    PolicyConfig,
    hookimpl,
    load_caches,
    save_caches,
)
from kvpolicy_core.parts.cumulative_attention import CumulativeAttentionScorer
from kvpolicy_core.plugin.discovery import register_plugin, unregister_plugin
from kvpolicy_core.testing.conformance import feed

MERGING = [with_fields(m, "budget=8,n_sink=2") for m in SHIPPED_METHODS]


# ----------------------------------------------------------------------------- tensors
@pytest.mark.parametrize("method", MERGING)
@pytest.mark.parametrize("poison", [math.nan, math.inf])
def test_non_finite_tokens_never_contaminate_finite_retained_tokens(method, poison):
    keys, values = random_kv(B=2, H=2, S=40, D=8, seed=4)
    k, v = np.array(keys), np.array(values)
    k[:, :, [5, 17, 30]] = poison
    v[:, :, [9, 17, 33]] = poison
    cache = PolicyCache(method)
    feed(cache, mx.array(k), mx.array(v), (12,) + (1,) * 28)
    rk, rv, pos, scores = (np.array(x) for x in cache.retained())
    bad = np.isin(pos, [5, 9, 17, 30, 33])
    assert np.isfinite(rk[~bad]).all() and np.isfinite(rv[~bad]).all()
    assert not np.isnan(scores).any() and cache.tokens_kept == 8


@pytest.mark.parametrize("method", MERGING)
def test_all_zero_keys_and_all_zero_scores_are_defined(method):
    zeros = mx.zeros((1, 2, 30, 8))
    values = random_kv(B=1, H=2, S=30, D=8)[1]
    cache = PolicyCache(method)
    feed(cache, zeros, values, (10,) + (1,) * 20)
    rk, rv, pos, scores = (np.array(x) for x in cache.retained())
    assert np.isfinite(rv).all() and np.isfinite(scores).all() and pos.shape[-1] == 8
    again = PolicyCache(method)
    feed(again, zeros, values, (10,) + (1,) * 20)
    np.testing.assert_array_equal(np.array(again.retained()[2]), pos)  # deterministic tie-breaking


# ----------------------------------------------------------------------------- plugin faults
class Boom(Exception):
    pass


class FlakyScorer(CumulativeAttentionScorer):
    calls = 0
    fail_at = 10**9

    @classmethod
    def from_config(cls, config):
        return cls("proxy")

    def on_append(self, view, new_keys, new_positions):
        FlakyScorer.calls += 1
        if FlakyScorer.calls == FlakyScorer.fail_at:
            raise Boom("scorer exploded")
        return super().on_append(view, new_keys, new_positions)


class FlakyDisposition:
    @classmethod
    def from_config(cls, config):
        return cls()

    def dispose(self, view, losers, key):
        raise Boom("disposition exploded")


class FaultyPlugin:
    @hookimpl
    def register_scorers(self, register):
        register("flaky", FlakyScorer)

    @hookimpl
    def register_dispositions(self, register):
        register("flaky_drop", FlakyDisposition)

    @hookimpl
    def register_methods(self, register):
        register(MethodSpec("flaky", PolicyConfig, "flaky", "lowest_score", "drop"))
        register(MethodSpec("flakydisp", PolicyConfig, "cumulative_attention", "lowest_score", "flaky_drop"))


@pytest.fixture
def faulty():
    register_plugin(FaultyPlugin(), "faulty")
    yield
    unregister_plugin("faulty")


def snapshot(cache):
    return [
        np.array(x)
        for x in (
            cache.keys[..., : cache.n, :],
            cache.values[..., : cache.n, :],
            cache.positions[..., : cache.n],
            cache.scores,
        )
    ] + [cache.n, cache.offset]


def same(a, b):
    return all(np.array_equal(x, y) for x, y in zip(a, b))


def test_a_scorer_failure_names_the_plugin_and_leaves_the_cache_untouched(faulty):
    model = tiny_llama(seed=2)
    caches = KVCacheBuilder.for_model(model, "flaky:budget=8,n_sink=2")
    toks = mx.random.randint(0, VOCAB, (1, 30), key=mx.random.key(3))
    run_chunks(model, caches, toks, [12] + [1] * 5)
    before = [snapshot(c) for c in caches]
    FlakyScorer.calls, FlakyScorer.fail_at = 0, 1
    with pytest.raises(PluginError) as e:
        model(toks[:, 17:18], cache=caches)
    assert "scorer 'flaky' of plugin 'faulty'" in str(e.value) and "scorer exploded" in str(e.value)
    assert same(snapshot(caches[0]), before[0])  # the failing layer rolled back
    FlakyScorer.fail_at = 10**9
    for c, b in zip(caches, before):  # restore the layer that did update, then continue cleanly
        if not same(snapshot(c), b):
            c.keys, c.values = mx.array(b[0]), mx.array(b[1])
            c.positions, c.scores, c.n, c.offset = mx.array(b[2]), mx.array(b[3]), b[4], b[5]
    out = run_chunks(model, caches, toks[:, 17:], [1] * 13)
    assert not mx.isnan(out).any().item() and all(c.tokens_kept == 8 for c in caches)


def test_a_disposition_failure_names_the_plugin_and_never_corrupts(faulty):
    cache = PolicyCache("flakydisp:budget=8,n_sink=2")
    keys, values = random_kv(S=20)
    feed(cache, keys, values, (8,))
    before = snapshot(cache)
    feed(cache, keys[:, :, 8:], values[:, :, 8:], (1,))  # reaches budget + 1: no eviction yet
    mid = snapshot(cache)
    with pytest.raises(PluginError, match="disposition 'flaky_drop' of plugin 'faulty'.*disposition exploded"):
        cache.update_and_fetch(keys[:, :, 9:10], values[:, :, 9:10])
    assert same(snapshot(cache), mid) and not same(mid, before)
    with pytest.raises(PluginError):
        cache.settle()
    assert same(snapshot(cache), mid)


# ----------------------------------------------------------------------------- persistence
@pytest.mark.parametrize("method", ["cam:budget=12,n_sink=2", "h2o:budget=12,signal=observed", "cam:budget=64"])
def test_save_and_load_continue_bit_for_bit(tmp_path, method):
    model = tiny_llama(seed=6)
    toks = mx.random.randint(0, VOCAB, (2, 50), key=mx.random.key(6))
    whole = KVCacheBuilder.for_model(model, method)
    want = run_chunks(model, whole, toks, [20] + [1] * 30)
    first = KVCacheBuilder.for_model(model, method)
    run_chunks(model, first, toks[:, :27], [20] + [1] * 7)
    path = save_caches(tmp_path / "caches.safetensors", first, metadata={"note": "x"})
    resumed = load_caches(path)
    got = run_chunks(model, resumed, toks[:, 27:], [1] * 23)
    assert mx.array_equal(got, want[:, 27:])
    assert [c.offset for c in resumed] == [50, 50] and resumed[0].merges == whole[0].merges


def test_a_cache_saved_between_prompt_chunks_continues_the_run(tmp_path):
    """Saved between two chunks of a prompt that fits the budget (a run in progress), the loaded caches
    score the next chunk as part of the same run: the same logits as never saving."""
    model = tiny_llama(seed=7)
    toks = mx.random.randint(0, VOCAB, (1, 40), key=mx.random.key(7))
    whole = KVCacheBuilder.for_model(model, "h2o:budget=16,n_sink=2")
    want = run_chunks(model, whole, toks, [6, 8] + [1] * 26)
    first = KVCacheBuilder.for_model(model, "h2o:budget=16,n_sink=2")
    run_chunks(model, first, toks[:, :6], [6])
    resumed = load_caches(save_caches(tmp_path / "mid-run.safetensors", first))
    got = run_chunks(model, resumed, toks[:, 6:], [8] + [1] * 26)
    assert mx.array_equal(got, want[:, 6:])


def test_mlx_lm_caches_and_mixed_sets_round_trip(tmp_path, gemma_model):
    toks = mx.random.randint(0, VOCAB, (1, 30), key=mx.random.key(8))
    caches = KVCacheBuilder.for_model(gemma_model, "cam:budget=12,layers=unbounded")
    run_chunks(gemma_model, caches, toks[:, :20], [14] + [1] * 6)
    loaded = load_caches(save_caches(tmp_path / "mixed.safetensors", caches))
    assert [type(c).__name__ for c in loaded] == [type(c).__name__ for c in caches]
    a = run_chunks(gemma_model, caches, toks[:, 20:], [1] * 10)
    b = run_chunks(gemma_model, loaded, toks[:, 20:], [1] * 10)
    assert mx.array_equal(a, b)
    plain = plain_caches(tiny_llama(seed=1))
    assert load_caches(save_caches(tmp_path / "empty.safetensors", plain))[0].keys is None


def test_damaged_files_are_rejected(tmp_path):
    cache = PolicyCache("cam:budget=8")
    feed(cache, *random_kv(S=20), (20,))
    path = save_caches(tmp_path / "c.safetensors", [cache])
    data = bytearray(path.read_bytes())
    (tmp_path / "trunc.safetensors").write_bytes(bytes(data[: len(data) // 2]))
    with pytest.raises(CacheFileError, match="truncated or corrupted"):
        load_caches(tmp_path / "trunc.safetensors")
    data[-5] ^= 0xFF
    (tmp_path / "tamper.safetensors").write_bytes(bytes(data))
    with pytest.raises(CacheFileError, match="checksum mismatch"):
        load_caches(tmp_path / "tamper.safetensors")
    mx.save_safetensors(str(tmp_path / "other.safetensors"), {"a": mx.zeros(2)})
    with pytest.raises(CacheFileError, match="not a kvpolicy cache file"):
        load_caches(tmp_path / "other.safetensors")
    with pytest.raises(CacheFileError, match="no such cache file"):
        load_caches(tmp_path / "missing.safetensors")
    with pytest.raises(CacheFileError, match="must end in .safetensors"):
        save_caches(tmp_path / "c.bin", [cache])


def test_mlx_lm_save_and_load_prompt_cache_work_with_policy_caches(tmp_path, llama_model):
    from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

    caches = KVCacheBuilder.for_model(llama_model, "cam:budget=10,merge=mean")
    toks = mx.random.randint(0, VOCAB, (1, 30), key=mx.random.key(2))
    run_chunks(llama_model, caches, toks[:, :20], [20])
    save_prompt_cache(str(tmp_path / "p.safetensors"), caches)
    loaded = load_prompt_cache(str(tmp_path / "p.safetensors"))
    assert [type(c).__name__ for c in loaded] == ["PolicyCache", "PolicyCache"]
    assert loaded[0].policy.config == caches[0].policy.config and loaded[0].offset == 20
    a = run_chunks(llama_model, caches, toks[:, 20:], [1] * 10)
    b = run_chunks(llama_model, loaded, toks[:, 20:], [1] * 10)
    np.testing.assert_allclose(np.array(a), np.array(b), atol=1e-5)
