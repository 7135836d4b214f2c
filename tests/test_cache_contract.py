"""The policy cache honours mlx-lm's cache contract on tiny random-weight models."""

import mlx.core as mx
import numpy as np
import pytest
from helpers import SHIPPED_METHODS, VOCAB, plain_caches, random_kv, run_chunks, tiny_llama, with_fields
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import KVCache

from kvpolicy_core import ConfigError, KVCacheBuilder, KVPolicyError, ModelError, PolicyCache, attach, detach
from kvpolicy_core.cache.batch import BatchPolicyCache
from kvpolicy_core.testing.conformance import feed


@pytest.mark.parametrize("method", SHIPPED_METHODS)
@pytest.mark.parametrize("chunks", [[40], [1] * 40, [13, 1, 1, 25], [7] * 5 + [1] * 5])
def test_budget_above_length_reproduces_plain_cache_exactly(llama_model, tokens, method, chunks):
    ref = run_chunks(llama_model, plain_caches(llama_model), tokens, chunks)
    got = run_chunks(
        llama_model, KVCacheBuilder.for_model(llama_model, with_fields(method, "budget=64")), tokens, chunks
    )
    assert mx.array_equal(ref, got)


class RetainedReference:
    """A test-only cache: given retained K/V, attends to them plus the new token at offset=seen."""

    def __init__(self, keys, values, offset):
        self.keys, self.values, self.offset = keys, values, offset

    def update_and_fetch(self, k, v):
        self.offset += k.shape[2]
        return mx.concatenate([self.keys, k], axis=2), mx.concatenate([self.values, v], axis=2)

    def make_mask(self, N, **_):
        return None if N == 1 else "causal"


@pytest.mark.parametrize("method", ["h2o:budget=12,n_sink=2", "cam:budget=12,n_sink=2,keys=true,merge=sim_weighted"])
def test_after_evictions_queries_rotate_at_the_absolute_position(llama_model, tokens, method):
    caches = KVCacheBuilder.for_model(llama_model, method)
    run_chunks(llama_model, caches, tokens[:, :30], [20] + [1] * 10)
    for c in caches:
        c.settle()
        assert c.offset == 30 and c.tokens_kept == 12
    refs = [RetainedReference(c.keys[..., : c.n, :], c.values[..., : c.n, :], c.offset) for c in caches]
    nxt = tokens[:, 30:31]
    want = llama_model(nxt, cache=refs)
    got = llama_model(nxt, cache=caches)
    np.testing.assert_allclose(np.array(got), np.array(want), atol=1e-5)


def test_generate_uses_fresh_bounded_caches_with_small_prefill_steps(llama_model, tokens):
    attach(llama_model, "cam:budget=10,n_sink=2")
    try:
        made = []
        for _ in range(2):
            caches = llama_model.make_cache()
            made.append(caches)
            out = [
                t
                for (t, _), _ in zip(
                    generate_step(tokens[0], llama_model, prompt_cache=caches, prefill_step_size=7), range(12)
                )
            ]
            assert len(out) == 12 and all(0 <= t < VOCAB for t in out)
            for c in caches:
                assert isinstance(c, PolicyCache) and c.tokens_kept == 10 and c.offset >= 40 + 11
        assert made[0][0] is not made[1][0]
    finally:
        detach(llama_model)
    assert "make_cache" not in llama_model.__dict__


def test_mlx_lm_generate_runs_with_attached_caches(tiny_model_dir):
    import mlx_lm

    model, tokenizer = mlx_lm.load(str(tiny_model_dir))
    attach(model, "h2o:budget=16")
    try:
        seen = []
        for response in mlx_lm.stream_generate(
            model, tokenizer, "hello there, a prompt longer than the budget", max_tokens=8
        ):
            seen.append(response.token)
        assert len(seen) == 8
        prompt = "hello again, also a prompt longer than sixteen"
        text = mlx_lm.generate(model, tokenizer, prompt, max_tokens=5)
        # fresh caches per call and greedy decoding: generate's text is exactly stream_generate's
        streamed = "".join(r.text for r in mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=5))
        assert text == streamed and len(tokenizer.encode(text, add_special_tokens=False)) >= 1
    finally:
        detach(model)


def test_offsets_sizes_and_masks_after_evictions():
    cache = PolicyCache("h2o:budget=8,n_sink=2,recent=2,signal=proxy,when=stream")
    k, v = random_kv(S=20)
    out_k, out_v = cache.update_and_fetch(k, v)
    assert out_k.shape[2] == 20 and cache.offset == 20 and cache.tokens_kept == 8
    assert cache.make_mask(1) is None and cache.make_mask(5) == "causal"
    mask = cache.make_mask(3, return_array=True)
    assert mask.shape == (3, 11) and mask[:, :8].all() and not mask[0, 9]
    for step in range(5):
        kk, vv = random_kv(S=1, seed=step + 1)
        out_k, _ = cache.update_and_fetch(kk, vv)
        assert out_k.shape[2] == 9 and cache.offset == 21 + step
    pos = np.array(cache.retained()[2])
    assert pos.shape == (2, 3, 8)
    assert (np.diff(pos, axis=-1) > 0).all() and (pos[..., :2] == [0, 1]).all() and (pos[..., -2:] == [23, 24]).all()


def test_contract_surface(tmp_path):
    cache = PolicyCache("cam:budget=8,n_sink=2,merge=sim_weighted,signal=proxy,when=stream")
    assert cache.empty() and cache.nbytes == 0 and cache.state[:4] == (None,) * 4 and not hasattr(cache, "bits")
    k, v = random_kv(S=6, dtype=mx.float16)
    cache.update_and_fetch(k, v)
    assert not cache.is_trimmable() and cache.trim(0) == 0  # scores accumulate attention: see the trim tests
    cache.update_and_fetch(*random_kv(S=10, seed=3, dtype=mx.float16))
    keys, values, positions, scores = cache.state[:4]
    assert keys.dtype == mx.float16 and keys.shape == (2, 3, 8, 8) and positions.shape == scores.shape == (2, 3, 8)
    clone = PolicyCache.from_state(cache.state, cache.meta_state)
    assert clone.offset == 16 and clone.tokens_kept == 8 and clone.policy.config == cache.policy.config
    assert mx.array_equal(clone.state[0], keys)
    assert cache.nbytes >= keys.nbytes + values.nbytes


def test_byte_accounting_uses_the_true_dtype():
    cache = PolicyCache("h2o:budget=16,n_sink=2,signal=proxy")
    cache.update_and_fetch(*random_kv(B=1, H=2, S=64, D=32, dtype=mx.bfloat16))
    per_token = 1 * 2 * (32 * 2 + 32 * 2)
    # a prompt held for its cut (h2o cuts at the prompt's end) is counted whole: memory is what the cache holds
    assert cache.tokens_seen == 64 and cache.tokens_kept == 64 and cache.compression_ratio == 1.0
    cache.settle()
    assert cache.tokens_seen == 64 and cache.tokens_kept == 16
    assert cache.kept_bytes == 16 * per_token and cache.full_seq_bytes == 64 * per_token
    assert cache.compression_ratio == pytest.approx(4.0)
    assert PolicyCache("h2o").compression_ratio == 1.0


def test_shape_and_dtype_changes_are_clear_errors():
    cache = PolicyCache("h2o:budget=8,n_sink=2,signal=proxy")
    cache.update_and_fetch(*random_kv(S=4))
    with pytest.raises(ValueError, match="changed from"):
        cache.update_and_fetch(*random_kv(H=4, S=1))
    with pytest.raises(ValueError, match="dtype changed"):
        cache.update_and_fetch(*random_kv(S=1, dtype=mx.float16))
    with pytest.raises(ValueError, match=r"\[B, H, S, D\]"):
        cache.update_and_fetch(mx.zeros((2, 3, 4)), mx.zeros((2, 3, 4)))


def test_a_policys_compiled_steps_go_with_it():
    """The compiled decode steps are cached per part (shared by every layer's cache) in a weak map: once no
    cache uses a policy, its parts and their traces are freed (a server building caches per request)."""
    import gc

    from kvpolicy_core.cache import step as compiled_parts
    from kvpolicy_core.testing.conformance import feed

    gc.collect()
    before = len(compiled_parts._traces)
    keys, values = random_kv(S=12)
    for method in ("h2o:budget=4,n_sink=1,signal=proxy", "cam:budget=4,n_sink=1,signal=proxy,min_sim=-1"):
        for _ in range(5):
            cache = PolicyCache(method)
            feed(cache, keys, values, [1] * 12)
            assert len(compiled_parts._traces) > before  # decode steps ran compiled
            del cache
    gc.collect()
    assert len(compiled_parts._traces) == before


def test_new_buffers_are_checked_against_the_next_input():
    """Decode's check passes an input shaped like the last accepted one without the field-by-field checks;
    buffers assigned from outside (a state restore) are checked against the next input again."""
    cache = PolicyCache("h2o:budget=8,n_sink=2,signal=proxy")
    for _ in range(3):
        cache.update_and_fetch(*random_kv(S=1))  # accepted: float32, the same shape every step
    half = PolicyCache("h2o:budget=8,n_sink=2,signal=proxy")
    half.update_and_fetch(*random_kv(S=4, dtype=mx.float16))
    cache.state = half.state
    with pytest.raises(ValueError, match="dtype changed"):
        cache.update_and_fetch(*random_kv(S=1))
    other = PolicyCache("h2o:budget=8,n_sink=2,signal=proxy")
    for _ in range(3):
        other.update_and_fetch(*random_kv(S=1))
    other.values = other.values.astype(mx.float16)  # values alone assigned from outside
    with pytest.raises(ValueError, match="values dtype changed from mlx.core.float16 to mlx.core.float32"):
        other.update_and_fetch(*random_kv(S=1))


@pytest.mark.parametrize("chunks", [[30], [1] * 30, [10, 1, 1, 5, 13], [12] + [1] * 18])
def test_sliding_window_layers_stay_correct(gemma_model, chunks):
    toks = mx.random.randint(0, VOCAB, (2, 30), key=mx.random.key(4))
    ref = run_chunks(gemma_model, gemma_model.make_cache(), toks, chunks)
    caches = KVCacheBuilder.for_model(gemma_model, "h2o:budget=64")
    assert [c.window for c in caches] == [8, 8, None, 8, 8, None]
    got = run_chunks(gemma_model, caches, toks, chunks)
    np.testing.assert_allclose(np.array(got), np.array(ref), atol=5e-5)


def test_window_mask_is_built_from_each_layers_positions():
    cache = PolicyCache("h2o:budget=10,n_sink=2,recent=2,signal=proxy", window=6)
    q = mx.zeros((2, 6, 1, 8))
    cache.update_and_fetch(*random_kv(S=12))
    cache.before_attention(mx.zeros((2, 6, 12, 8)), 1.0, "causal")
    for s in range(3):
        cache.update_and_fetch(*random_kv(S=1, seed=s + 7))
        cache.before_attention(q, 1.0, None)
    cache.update_and_fetch(*random_kv(S=1, seed=20))
    mask = np.array(cache.before_attention(q, 1.0, None))
    pos = np.array(cache.positions[..., : cache.n])
    want = (pos <= 15) & (pos > 15 - 6)
    assert mask.shape == (2, 6, 1, cache.n)
    np.testing.assert_array_equal(mask[:, ::2, 0], want)
    np.testing.assert_array_equal(mask[:, 1::2, 0], want)


def test_only_unbounded_layers_option_keeps_native_window_caches(gemma_model):
    caches = KVCacheBuilder.for_model(gemma_model, "cam:budget=16,layers=unbounded")
    kinds = [type(c).__name__ for c in caches]
    assert kinds == ["RotatingKVCache", "RotatingKVCache", "PolicyCache"] * 2


def test_attention_hook_is_removable_and_ignores_foreign_caches():
    import mlx_lm.models.llama as llama_mod

    model = tiny_llama(seed=3)
    original = llama_mod.scaled_dot_product_attention
    attach(model, "h2o:budget=8,signal=observed")
    assert llama_mod.scaled_dot_product_attention is not original
    toks = mx.random.randint(0, VOCAB, (1, 12), key=mx.random.key(2))
    ref = run_chunks(model, plain_caches(model), toks, [12])
    detach(model)
    assert llama_mod.scaled_dot_product_attention is original
    assert mx.array_equal(ref, run_chunks(model, plain_caches(model), toks, [12]))


def test_observed_signal_without_the_hook_is_a_clear_error():
    from kvpolicy_core.testing.tiny_models import tiny_model

    model = tiny_model("qwen2", seed=5)  # caches built by hand: no hook installed for them
    caches = [PolicyCache("h2o:budget=8,signal=observed", layer=i) for i in range(len(model.layers))]
    model(mx.zeros((1, 4), dtype=mx.int32), cache=caches)
    with pytest.raises(ModelError, match="attention hook"):
        model(mx.zeros((1, 1), dtype=mx.int32), cache=caches)


def test_for_model_rejects_models_it_cannot_serve(llama_model):
    class NoLayers:
        pass

    with pytest.raises(ModelError, match="has no `layers`"):
        KVCacheBuilder.for_model(NoLayers(), "h2o")
    with pytest.raises(ConfigError, match="head_dim: the config says 128 but the model's head_dim is 16"):
        KVCacheBuilder.for_model(llama_model, "h2o:head_dim=128")

    model = tiny_llama(seed=7)
    from mlx_lm.models.cache import ArraysCache

    object.__setattr__(model, "make_cache", lambda: [KVCache(), ArraysCache(2)])
    with pytest.raises(ModelError, match="layer 1 uses ArraysCache"):
        KVCacheBuilder.for_model(model, "h2o")


# ----------------------------------------------------------------------------- trim
def _states(cache):
    return [np.array(x) for x in cache.state[:4]]


@pytest.mark.parametrize("method", ["random:budget=12,n_sink=2", "streamingllm:budget=12,n_sink=2"])
def test_trim_is_exact_where_scores_are_per_token(method):
    """Trimmed, then fed on, a cache is the cache that never saw the trimmed tokens: slots, positions,
    scores, offset, also after evictions (trimming ends a run of prompt chunks, as a decode step does)."""
    K, V = random_kv(B=1, H=2, S=40, seed=4)
    trimmed, fresh = PolicyCache(method), PolicyCache(method)
    feed(trimmed, K[:, :, :9], V[:, :, :9], (6, 3))
    assert trimmed.is_trimmable() and trimmed.trim(4) == 4 and (trimmed.offset, trimmed.size()) == (5, 5)
    feed(fresh, K[:, :, :5], V[:, :, :5], (5,))
    for cache in (trimmed, fresh):  # the trimmed cache continues with tokens the fresh one never dropped
        feed(cache, K[:, :, 9:], V[:, :, 9:], (7,) + (1,) * 24)
    assert trimmed.offset == fresh.offset == 36
    for a, b in zip(_states(trimmed), _states(fresh)):
        np.testing.assert_array_equal(a, b)
    assert not trimmed.is_trimmable()  # evicted: refused, saying why, and nothing changes
    before = _states(trimmed)
    with pytest.raises(KVPolicyError, match="evicted"):
        trimmed.trim(1)
    assert all(np.array_equal(a, b) for a, b in zip(before, _states(trimmed))) and trimmed.offset == 36


@pytest.mark.parametrize("method", ["h2o:budget=12", "cam:budget=12", "h2o:budget=12,signal=proxy", "tova:budget=12"])
def test_trim_is_refused_where_scores_carry_the_attention_of_later_tokens(method):
    """Accumulated scores: only the last short update can be taken back (tests/test_speculative.py); a trim of
    tokens before it is refused and changes nothing."""
    cache = PolicyCache(method)
    assert cache.is_trimmable()  # empty: nothing to take back (mlx-lm's speculative decoding asks so first)
    feed(cache, *random_kv(B=1, H=2, S=7, seed=5), (6, 1))
    assert not cache.is_trimmable()
    before = _states(cache)
    with pytest.raises(KVPolicyError, match="can take back only the newest 0"):
        cache.trim(2)
    assert cache.offset == 7 and all(np.array_equal(a, b) for a, b in zip(before, _states(cache)))
    assert cache.trim(0) == 0
    batch = BatchPolicyCache([cache])
    with pytest.raises(KVPolicyError, match="cannot trim this batch"):
        batch.trim(1)


def test_trim_rejects_a_negative_count_and_leaves_the_cache_usable():
    cache = PolicyCache("h2o:budget=16")
    feed(cache, *random_kv(S=10), (10,))
    with pytest.raises(ValueError, match="trim"):
        cache.trim(-2)
    assert cache.n == cache.offset == 10 and cache.scores.shape[-1] == 10
    feed(cache, *random_kv(S=1, seed=2), (1,))
    assert cache.offset == 11


# ----------------------------------------------------------------------------- mlx-lm's generation options
def test_kv_bits_on_a_head_dim_it_cannot_quantize_is_a_clear_error():
    """mlx-lm's kv_bits quantizes policy caches (tests/test_quantized_storage.py); a head dim no group size divides
    (the tiny model's 16) is refused naming kv_group_size, never quantized wrongly or ignored."""
    from mlx_lm.generate import generate_step

    model = tiny_llama()
    caches = KVCacheBuilder.for_model(model, "h2o:budget=8")
    with pytest.raises(ValueError, match="kv_group_size=64 does not divide the head dim 16"):
        for _, (token, _) in zip(
            range(3),
            generate_step(mx.array([1, 2, 3, 4, 5]), model, prompt_cache=caches, kv_bits=4, quantized_kv_start=0),
        ):
            pass
    assert all(isinstance(c, PolicyCache) and c.storage.bits is None for c in caches)
