"""CaM: the specification's Evidence list (target, gate, blend, eviction, cache) and the paper's merge."""

import mlx.core as mx
import numpy as np
import pytest
from helpers import CAM_METHODS, feed, random_kv, run_chunks, tiny_llama, with_fields

from kvpolicy_cam import CamConfig
from kvpolicy_cam.gated_merge import GatedMergeDisposition, bernoulli, gate_probability, merge_targets
from kvpolicy_cam.paper_merge import PaperMergeDisposition
from kvpolicy_core import KVCacheBuilder, PolicyCache
from kvpolicy_core.config.policy import step_key
from kvpolicy_core.parts.base import CacheView


def view(keys, values=None, scores=None, positions=None, offset=None):
    """A CacheView over [L, D] keys for one batch row and head."""
    K = mx.array(np.asarray(keys, np.float32))[None, None]
    L = K.shape[2]
    V = K if values is None else mx.array(np.asarray(values, np.float32))[None, None]
    s = mx.ones((1, 1, L)) if scores is None else mx.array(np.asarray(scores, np.float32))[None, None]
    p = mx.arange(L, dtype=mx.int32)[None, None] if positions is None else mx.array(positions, mx.int32)[None, None]
    return CacheView(K, V, p, s, L if offset is None else offset, 0, None)


def L(i):
    return mx.array([[[i]]], mx.int32)


# ---------------------------------------------------------------- target
def test_target_is_the_closest_non_sink_survivor_by_cosine():
    keys = [[1, 0], [0.9, 0.1], [0, 1], [0.7, 0.7], [10, 1], [0.1, 1]]  # slots 0, 1 are sinks
    t, cos, has = merge_targets(view(keys), L(2), n_sink=2)
    assert t.item() == 5 and has.item() and cos.item() == pytest.approx(1 / np.sqrt(1.01), abs=1e-6)
    t, _, _ = merge_targets(view(keys), L(4), n_sink=2)
    assert t.item() == 3  # cosine (scale-free), not dot product; never the sinks 0/1 nor itself


def test_no_target_when_only_sinks_remain():
    _, _, has = merge_targets(view([[1, 0], [0, 1], [1, 1]]), L(2), n_sink=2)
    assert not has.item()
    d = GatedMergeDisposition(n_sink=2, gate=False)
    u = d.dispose(view([[1, 0], [0, 1], [1, 1]]), L(2), mx.random.key(0))
    assert u.stats["merges"].item() == 0 and not np.array(u.d_values).any()  # dropped, not merged


# ---------------------------------------------------------------- gate
def test_gate_probability_bounds_and_clamping():
    s_l = mx.array([0.5, 2.0, -1.0, 1.0, 0.0, 0.0, 3.0])
    s_t = mx.array([1.0, 1.0, 1.0, 0.0, 0.0, -2.0, 4.0])
    np.testing.assert_allclose(np.array(gate_probability(s_l, s_t)), [0.5, 1.0, 0.0, 1.0, 0.0, 0.0, 0.75])


def test_gate_draws_are_reproducible_by_seed_layer_and_step():
    p = mx.full((4, 8, 3), 0.5)
    draw = lambda seed, layer, step: np.array(bernoulli(p, step_key(seed, layer, step)))  # noqa: E731
    assert (draw(0, 1, 7) == draw(0, 1, 7)).all()
    assert (draw(0, 1, 7) != draw(1, 1, 7)).any()
    assert (draw(0, 1, 7) != draw(0, 2, 7)).any() and (draw(0, 1, 7) != draw(0, 1, 8)).any()


def test_low_relative_score_loser_is_dropped_most_of_the_time():
    p = gate_probability(mx.full((10000,), 0.1), mx.full((10000,), 1.0))
    rate = np.array(bernoulli(p, step_key(3, 0, 0))).mean()
    assert 0.08 < rate < 0.12


def test_gate_off_merges_every_loser_with_a_target():
    K, V = random_kv(B=2, H=3, S=40, D=8, seed=9)
    cache = stream("cam:merge=sim_weighted,signal=proxy,budget=8,n_sink=2,gate=false", K, V, (1,) * 40)
    assert cache.merges == 2 * 3 * 32 and cache.gate_draws == 0
    gated = stream("cam:merge=sim_weighted,signal=proxy,budget=8,n_sink=2", K, V, (1,) * 40)
    assert gated.gate_draws == 2 * 3 * 32 and 0 < gated.merges < gated.gate_draws


# ---------------------------------------------------------------- blend
def blend(mode, keys, values, merge_keys=False, loser=3):
    d = GatedMergeDisposition(n_sink=1, mode=mode, gate=False, merge_keys=merge_keys)
    v = view(keys, values)
    u = d.dispose(v, L(loser), mx.random.key(0))
    t = u.targets.item()
    new_v = np.array(v.values[0, 0, t] + u.d_values[0, 0, 0])
    new_k = None if u.d_keys is None else np.array(v.keys[0, 0, t] + u.d_keys[0, 0, 0])
    return t, new_v, new_k


def test_mean_averages_the_values():
    t, new_v, _ = blend("mean", [[1, 0], [1, 0.1], [0, 1], [1, 0.2]], [[0, 0], [2, 4], [9, 9], [6, 8]])
    assert t == 1 and np.allclose(new_v, [4, 6])


def test_sim_weighted_folds_a_similar_loser_in_strongly_and_a_dissimilar_one_weakly():
    _, near, _ = blend("sim_weighted", [[1, 0], [1, 0.001], [0, 1], [1, 0]], [[0, 0], [0, 0], [5, 5], [10, 10]])
    assert np.allclose(near, [10, 10], atol=1e-3)  # w = cos ~ 1
    keys = [[1, 0], [1, 1], [-1, 0.2], [0, 1]]  # loser [0, 1] vs [1, 1]: cos = 0.707
    _, far, _ = blend("sim_weighted", keys, [[0, 0], [0, 0], [9, 9], [10, 10]])
    assert np.allclose(far, np.full(2, 10 / np.sqrt(2)), atol=1e-5)
    _, neg, _ = blend(
        "sim_weighted", [[1, 0], [-1, 0.1], [-1, -0.1], [1, 0]], [[0, 0], [1, 1], [1, 1], [10, 10]], loser=3
    )
    assert np.allclose(neg, [1, 1])  # negative cosine clipped to w = 0


def test_merge_keys_toggles_key_blending():
    keys, values = [[1, 0], [1, 0.5], [0, 1], [1, 0.3]], [[0, 0], [2, 2], [1, 1], [4, 4]]
    _, _, k_off = blend("mean", keys, values)
    t, _, k_on = blend("mean", keys, values, merge_keys=True)
    assert k_off is None and np.allclose(k_on, [1, 0.4])


def stream(method, K, V, chunks):
    cache = PolicyCache(method)
    feed(cache, K, V, chunks)
    cache.settle()
    return cache


@pytest.mark.parametrize("chunks", [[1] * 50, [20, 1, 1, 1, 27]])
def test_values_only_merge_leaves_kept_keys_identical_to_the_drop_path(chunks):
    K, V = random_kv(B=2, H=2, S=50, D=8, seed=21)
    drop = stream("h2o:budget=12,n_sink=2,signal=proxy", K, V, chunks).retained()
    merged = stream("cam:merge=sim_weighted,signal=proxy,budget=12,n_sink=2,gate=false", K, V, chunks).retained()
    drop_cam = stream("cam:signal=proxy,budget=12,n_sink=2,merge=drop", K, V, chunks).retained()
    assert not mx.array_equal(drop[1], merged[1])  # values did merge
    for a, b in zip(drop, drop_cam):
        assert mx.array_equal(a, b)
    # with merging the selection can differ (mass transfer); where positions agree, keys agree
    same = np.array(drop[2]) == np.array(merged[2])
    assert same.any()
    np.testing.assert_array_equal(np.array(drop[0])[same], np.array(merged[0])[same])


def test_mass_is_conserved_by_a_merge_and_the_new_token_adds_its_attention():
    K, V = random_kv(B=2, H=3, S=30, D=8, seed=2)
    cache = PolicyCache("cam:merge=sim_weighted,signal=proxy,budget=10,n_sink=2,gate=false")
    feed(cache, K[:, :, :29], V[:, :, :29], [29])
    before = np.array(cache.scores).sum(axis=-1)
    cache.settle()  # 19 losers, all merged: their score mass moves to the survivors
    assert cache.merges == 2 * 3 * 19
    np.testing.assert_allclose(np.array(cache.scores).sum(axis=-1), before, rtol=1e-5)
    kept_k, kept_s = np.array(cache.keys[..., :10, :]), np.array(cache.scores)
    cache.update_and_fetch(K[:, :, 29:30], V[:, :, 29:30])
    # the new key k_t attends to the 10 survivors: s_j += softmax_j(k_t . k_j / sqrt(D)); it enters with 0
    logits = np.einsum("bhd,bhld->bhl", np.array(K[:, :, 29]), kept_k) / np.sqrt(8)
    w = np.exp(logits - logits.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    after = np.array(cache.scores)
    np.testing.assert_allclose(after[..., :10], kept_s + w, rtol=1e-5, atol=1e-6)
    assert (after[..., 10] == 0).all()


# ---------------------------------------------------------------- eviction & cache
@pytest.mark.parametrize("method", CAM_METHODS)
def test_eviction_is_deterministic_with_a_seed(method):
    K, V = random_kv(B=2, H=2, S=60, D=8, seed=8)
    a = stream(with_fields(method, "budget=12,seed=4"), K, V, [20] + [1] * 40).retained()
    b = stream(with_fields(method, "budget=12,seed=4"), K, V, [20] + [1] * 40).retained()
    for x, y in zip(a, b):
        assert mx.array_equal(x, y)


@pytest.mark.parametrize("method", CAM_METHODS)
@pytest.mark.parametrize("n_kv_heads, batch", [(1, 1), (2, 3), (4, 2)])
def test_cache_on_tiny_models_across_batch_and_heads(method, n_kv_heads, batch):

    model = tiny_llama(n_kv_heads=n_kv_heads, seed=n_kv_heads)
    caches = KVCacheBuilder.for_model(model, with_fields(method, "budget=16,n_sink=2"))
    assert len(caches) == len(model.layers) and all(isinstance(c, PolicyCache) for c in caches)
    toks = mx.random.randint(0, 97, (batch, 40), key=mx.random.key(batch))
    out = run_chunks(model, caches, toks, [25] + [1] * 15)
    assert out.shape == (batch, 40, 97) and not mx.isnan(out).any().item()
    for c in caches:
        assert c.tokens_kept == 16 and c.keys.shape[:2] == (batch, n_kv_heads)
        named = [m for m in ("paper", "mean", "drop", "mass_blend", "mass", "sim_weighted") if f"merge={m}" in method]
        assert c.merge_mode == (named[0] if named else CamConfig().merge)


# ---------------------------------------------------------------- the paper's merge
def test_paper_merge_spreads_the_loser_over_the_next_m_tokens():
    values = [[0, 0], [1, 1], [8, 4], [2, 2], [3, 3], [4, 4], [5, 5]]
    scores = [9, 9, 1.0, 4.0, 0.5, 1.5, 9]
    keys = np.eye(7, 2)
    v = view(keys, values, scores)
    d = PaperMergeDisposition(m=3, gate=True)
    # loser slot 2 (pos 2): next 3 survivors are pos 3, 4, 5 with mean score 2.0 -> p = 0.5
    u = None
    for seed in range(40):  # find a draw that merges, then check the arithmetic exactly
        u = d.dispose(v, L(2), mx.random.key(seed))
        if u.stats["merges"].item():
            break
    assert (
        u.stats["gate_draws"].item() == 1 and u.stats["merges"].item() == 1 and u.d_keys is None and u.d_scores is None
    )
    targets = np.array(u.targets[0, 0]).tolist()
    adds = dict(zip(targets, np.array(u.d_values[0, 0]).tolist()))
    assert sorted(targets) == [3, 4, 5]
    for j in (3, 4, 5):
        assert np.allclose(adds[j], [8 / 3, 4 / 3])
    rates = np.mean([d.dispose(v, L(2), mx.random.key(s)).stats["merges"].item() for s in range(400)])
    assert 0.4 < rates < 0.6  # p = clamp(1.0 / 2.0, 0, 1)


def test_paper_merge_without_followers_drops_and_divides_by_m():
    d = PaperMergeDisposition(m=4, gate=False)
    u = d.dispose(view(np.eye(5, 2), [[1, 1]] * 4 + [[4, 8]]), L(3), mx.random.key(0))
    adds = dict(zip(np.array(u.targets[0, 0]).tolist(), np.array(u.d_values[0, 0]).tolist()))
    assert adds[4] == [0.25, 0.25] and sum(map(sum, adds.values())) == pytest.approx(0.5)
    u = d.dispose(view(np.eye(5, 2)), L(4), mx.random.key(0))
    assert u.stats["merges"].item() == 0 and not np.array(u.d_values).any()
