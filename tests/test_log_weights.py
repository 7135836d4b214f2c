"""Per-slot attention log-weights in core: exact when zero, proportional attention when not, persisted."""

import math

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

from helpers import feed, random_kv, run_chunks, tiny_gemma3, tiny_llama
from kvpolicy_core import KVCacheBuilder, attention, PolicyCache, load_caches, save_caches
from kvpolicy_core.attention_bias import with_log_weights
from kvpolicy_core.builder import needs_hook
from kvpolicy_core.parts.drop import DropDisposition
from kvpolicy_core.policy import Policy, build_policy


class LogWeightedDrop(DropDisposition):
    """Drop, but ask the cache for log-weights (which then stay 0)."""

    uses_log_weights = True


def with_zero_log_weights(config: str) -> Policy:
    p = build_policy(config)
    return p._replace(disposition=LogWeightedDrop())


def caches_for(model, policy):
    built = KVCacheBuilder.for_model(model, policy.config)
    return [PolicyCache(policy, layer=c.layer, window=c.window) for c in built]


@pytest.mark.parametrize("make_model", [tiny_llama, tiny_gemma3])
@pytest.mark.parametrize("chunks", [[1] * 30, [9, 1, 1, 12, 1, 6]])
@pytest.mark.parametrize("signal", ["proxy", "observed"])
def test_all_zero_log_weights_change_nothing_bit_for_bit(make_model, chunks, signal):
    model = make_model()
    tokens = mx.array(np.random.default_rng(0).integers(0, 97, (2, 30)), mx.int32)
    config = f"h2o:budget=8,n_sink=2,signal={signal}"
    plain = run_chunks(model, KVCacheBuilder.for_model(model, config), tokens, chunks)
    policy = with_zero_log_weights(config)
    caches = caches_for(model, policy)
    assert all(c.uses_log_weights for c in caches) and needs_hook(caches)
    hook = attention.install(model)  # what for_model does for such a policy
    try:
        weighted = run_chunks(model, caches, tokens, chunks)
    finally:
        hook.remove()
    assert caches[0].log_weights is not None and not caches[0].log_weights.any().item()
    assert mx.array_equal(plain, weighted)


def test_a_policy_without_log_weights_keeps_no_buffer_and_needs_no_hook():
    K, V = random_kv(S=20)
    cache = PolicyCache("h2o:budget=8,n_sink=2")
    feed(cache, K, V, [1] * 20)
    assert not cache.uses_log_weights and cache.log_weights is None and not needs_hook([cache])


def test_log_weight_log_c_attends_like_c_copies_of_the_slot():
    """softmax with +log 3 on slot j == softmax over a cache holding slot j three times."""
    B, Hq, H, L, D = 1, 4, 2, 6, 8
    rng = np.random.default_rng(1)
    q = mx.array(rng.normal(size=(B, Hq, 1, D)), mx.float32)
    K = mx.array(rng.normal(size=(B, H, L, D)), mx.float32)
    V = mx.array(rng.normal(size=(B, H, L, D)), mx.float32)
    lw = np.zeros((B, H, L), np.float32)
    lw[:, :, 2] = math.log(3.0)
    mask = with_log_weights(None, mx.array(lw), q)
    out = mx.fast.scaled_dot_product_attention(q, K, V, scale=D**-0.5, mask=mask)
    K3 = mx.concatenate([K, K[:, :, 2:3], K[:, :, 2:3]], axis=2)
    V3 = mx.concatenate([V, V[:, :, 2:3], V[:, :, 2:3]], axis=2)
    ref = mx.fast.scaled_dot_product_attention(q, K3, V3, scale=D**-0.5)
    assert mx.allclose(out, ref, atol=1e-5)


def test_bias_keeps_a_boolean_or_causal_mask():
    q = mx.zeros((1, 2, 3, 4))
    lw = mx.array([[[0.5, 0.0, 0.0, 0.0, 0.0]]])
    m = with_log_weights("causal", lw, q)
    assert m.shape == (1, 2, 3, 5) and m[0, 0, 0, 3].item() == -math.inf and m[0, 1, 2, 0].item() == 0.5
    with pytest.raises(ValueError, match="mask"):
        with_log_weights("sliding", lw, q)


def mass_cache(chunks, T=40, seed=3):
    K, V = random_kv(B=2, H=2, S=T, D=8, seed=seed)
    cache = PolicyCache("cam:budget=10,n_sink=2,merge=mass,signal=observed,gate=false")
    feed(cache, K, V, chunks)
    return cache, K, V


def test_merges_set_log_weights_through_the_merge_update():
    cache, _, _ = mass_cache([1] * 40)
    lw = np.array(cache.log_weights)
    assert cache.merges > 0 and (lw > 0).any() and np.isfinite(lw).all() and (lw >= 0).all()


@pytest.mark.parametrize("chunks", [[1] * 40, [12, 1, 1, 20, 1, 5]])
def test_log_weights_survive_save_load_and_mlx_lm_prompt_cache(tmp_path, chunks):
    cache, K, V = mass_cache(chunks[:-1], T=40)
    cache.settle()
    path = save_caches(tmp_path / "c.safetensors", [cache])
    (loaded,) = load_caches(path)
    assert mx.array_equal(loaded.log_weights, cache.log_weights)
    save_prompt_cache(str(tmp_path / "p.safetensors"), [cache])  # settles cache
    (settled,) = load_prompt_cache(str(tmp_path / "p.safetensors"))
    assert mx.array_equal(settled.log_weights, cache.log_weights)
    rest = K[:, :, 40 - chunks[-1] :], V[:, :, 40 - chunks[-1] :]
    outs = []
    for c in (cache, loaded, settled):
        k, v = c.update_and_fetch(*rest)
        outs.append((k, v, c.before_attention(rest[0], 8**-0.5, None if chunks[-1] == 1 else "causal")))
    for o in outs[1:]:
        for a, b in zip(outs[0], o):
            assert mx.array_equal(a, b)


def test_state_with_log_weights_is_refused_by_a_policy_without_them():
    cache, _, _ = mass_cache([1] * 20)
    state = cache.state
    with pytest.raises(Exception, match="log-weights"):
        PolicyCache("h2o:budget=10,n_sink=2").state = state
