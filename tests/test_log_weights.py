"""Per-slot attention log-weights in core: exact when zero, proportional attention when not, persisted."""

import math

import mlx.core as mx
import numpy as np
import pytest
from helpers import feed, random_kv, run_chunks, tiny_gemma3, tiny_llama
from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

from kvpolicy_core import (
    CacheFileError,
    KVCacheBuilder,
    MergeUpdate,
    Needs,
    PluginError,
    PolicyCache,
    load_caches,
    save_caches,
)
from kvpolicy_core.attention import hook as attention
from kvpolicy_core.attention.bias import with_log_weights
from kvpolicy_core.cache.slots import LOG_WEIGHT_BOUND
from kvpolicy_core.config.policy import Policy, build_policy
from kvpolicy_core.integration.builder import needs_hook
from kvpolicy_core.parts.drop import DropDisposition


class LogWeightedDrop(DropDisposition):
    """Drop, but ask the cache for log-weights (which then stay 0)."""

    needs = Needs(log_weights=True)


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
    cache = PolicyCache("h2o:budget=8,n_sink=2,signal=proxy")
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
    # the same masks, as the attention uses them: a restored cache whose log-weights are all 0 hands on the step's
    # own mask ("causal" or None); one that evicted at decode steps since its last restore may hand on an all-zero
    # bias (decode merges are decided on the device, so the cache does not know that none changed a log-weight)
    zero = mx.zeros(cache.log_weights.shape, mx.float32)
    for o in outs[1:]:
        assert mx.array_equal(outs[0][0], o[0]) and mx.array_equal(outs[0][1], o[1])
        a, b = (with_log_weights(m, zero, rest[0]) for m in (outs[0][2], o[2]))
        assert mx.array_equal(a, b)


def test_state_with_log_weights_is_refused_by_a_policy_without_them():
    cache, _, _ = mass_cache([1] * 20)
    state = cache.state
    with pytest.raises(Exception, match="log-weights"):
        PolicyCache("h2o:budget=10,n_sink=2").state = state


class ScriptedLogWeightMerge(DropDisposition):
    """Adds ``d_log_weights`` to slot 0 on every eviction; ``mode`` picks a good or a bad delta."""

    needs = Needs(log_weights=True)
    mode = "ok"

    def dispose(self, view, losers, key):
        B, H, _ = losers.shape
        t = mx.zeros((B, H, 1), mx.int32)
        dv = mx.zeros((B, H, 1, view.values.shape[-1]))
        d_lw = {
            "ok": mx.ones((B, H, 1)),
            "shape": mx.ones((B, H, 2)),
            "list": [[[1.0]]],
            "nan": mx.full((B, H, 1), math.nan),
            "inf": mx.full((B, H, 1), math.inf),
            "-inf": mx.full((B, H, 1), -math.inf),
        }[self.mode]
        return MergeUpdate(t, None, dv, None, d_log_weights=d_lw)


class FailingScorer:
    """The policy's scorer, but ``on_append`` raises once ``fail`` is set (after the step's merge)."""

    fail = False

    def __init__(self, scorer):
        self.scorer = scorer

    def __getattr__(self, name):
        return getattr(self.scorer, name)

    def on_append(self, *args):
        if self.fail:
            raise RuntimeError("scorer failed after the merge")
        return self.scorer.on_append(*args)


def scripted_cache():
    merge = ScriptedLogWeightMerge()
    policy = build_policy("h2o:budget=8,n_sink=1,when=stream")
    cache = PolicyCache(policy._replace(disposition=merge, scorer=FailingScorer(policy.scorer)))
    return cache, merge


@pytest.mark.parametrize("chunks", [(1,), (5,)])  # the decode write and the chunked compaction
def test_a_failed_step_rolls_the_log_weights_back(chunks):
    """The merge added to the log-weights, then the scorer failed: the step is undone as a whole."""
    K, V = random_kv(S=20)
    cache, _ = scripted_cache()
    feed(cache, K[:, :, :12], V[:, :, :12], [1] * 12)
    before = np.array(cache.log_weights)
    cache.policy.scorer.fail = True
    with pytest.raises(PluginError, match="scorer failed"):
        feed(cache, K[:, :, 12:], V[:, :, 12:], chunks)
    assert cache.offset == 12
    np.testing.assert_array_equal(np.array(cache.log_weights), before)


@pytest.mark.parametrize("mode, chunks", [("shape", (1,)), ("list", (1,)), ("shape", (5,))])
def test_a_badly_shaped_d_log_weights_is_a_plugin_error_and_rolls_back(mode, chunks):
    K, V = random_kv(S=20)
    cache, merge = scripted_cache()
    feed(cache, K[:, :, :12], V[:, :, :12], [1] * 12)
    before = np.array(cache.log_weights)
    assert before[..., 0].min() > 0  # the good deltas landed
    merge.mode = mode
    with pytest.raises(PluginError, match=r"d_log_weights (of shape|as a list, not an mx\.array)"):
        feed(cache, K[:, :, 12:], V[:, :, 12:], chunks)
    assert cache.offset == 12  # rolled back: the log-weights are part of the snapshot
    np.testing.assert_array_equal(np.array(cache.log_weights), before)


def test_non_finite_d_log_weights_leave_finite_bounded_log_weights():
    K, V = random_kv(S=30)
    cache, merge = scripted_cache()
    feed(cache, K[:, :, :10], V[:, :, :10], [10])
    for i, mode in enumerate(("nan", "inf", "inf", "-inf")):
        merge.mode = mode
        feed(cache, K[:, :, 10 + i : 11 + i], V[:, :, 10 + i : 11 + i], [1])
        lw = np.array(cache.log_weights)
        assert np.isfinite(lw).all() and np.abs(lw).max() <= LOG_WEIGHT_BOUND
    out = cache.before_attention(K[:, :, 13:14], 8**-0.5, None)
    assert np.isfinite(np.array(out)).any()


def test_d_log_weights_from_a_disposition_without_log_weights_is_a_plugin_error():
    class Undeclared(ScriptedLogWeightMerge):
        needs = Needs()

    cache = PolicyCache(build_policy("h2o:budget=8,n_sink=1")._replace(disposition=Undeclared()))
    K, V = random_kv(S=12)
    with pytest.raises(PluginError, match=r"no part declares Needs\(log_weights=True\)"):
        feed(cache, K, V, [1] * 12)


def test_the_file_checksum_covers_the_log_weights(tmp_path):
    cache, _, _ = mass_cache([1] * 30)
    path = save_caches(tmp_path / "c.safetensors", [cache])
    arrays, meta = mx.load(str(path), return_metadata=True)
    arrays["0.log_weights"] = arrays["0.log_weights"] + 1.0
    mx.save_safetensors(str(path), arrays, metadata=meta)
    with pytest.raises(CacheFileError, match="checksum"):
        load_caches(path)
