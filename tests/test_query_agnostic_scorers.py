"""The query-agnostic scorers (KeyDiff, Expected Attention): their equations against straightforward NumPy
references of kvpress's formulas, the layer RoPE the builder reads, and the methods through mlx-lm's generation
(budget, exact positions, save and restore)."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from helpers import tiny_llama, tiny_model, with_fields
from mlx_lm.generate import generate_step
from mlx_lm.models.rope_utils import DynamicNTKScalingRoPE, Llama3RoPE, SuScaledRoPE, YarnRoPE

from kvpolicy_core import ConfigError, KVCacheBuilder, ModelError, PolicyCache, load_caches, save_caches
from kvpolicy_core.config.parse import parse_config
from kvpolicy_core.integration.rope import model_ropes, rope_freqs
from kvpolicy_core.parts.base import CacheView
from kvpolicy_core.parts.expected_attention import ExpectedAttentionScorer, rotate_pairs
from kvpolicy_core.parts.keydiff import KeyDiffScorer, keydiff_scores

METHODS = ["h2o:score=keydiff", "cam:score=keydiff", "h2o:score=expected_attention", "cam:score=expected_attention"]


def view(keys, values, positions, offset, run=None):
    B, H, L, _ = keys.shape
    return CacheView(keys, values, positions, mx.zeros((B, H, L)), offset, 0, None, run=run)


# -- KeyDiff -----------------------------------------------------------------------------------------------------


def keydiff_reference(k: np.ndarray) -> np.ndarray:
    """kvpress KeyDiffPress.score: anchor = F.normalize(keys).mean(dim=2); -F.cosine_similarity(keys, anchor)."""
    unit = k / np.maximum(np.linalg.norm(k, axis=-1, keepdims=True), 1e-12)
    anchor = unit.mean(axis=2, keepdims=True)
    cos = (k * anchor).sum(-1) / (
        np.maximum(np.linalg.norm(k, axis=-1), 1e-8) * np.maximum(np.linalg.norm(anchor, axis=-1), 1e-8)
    )
    return -cos


def test_keydiff_is_minus_the_cosine_to_the_mean_unit_key_per_batch_row_and_head():
    rng = np.random.default_rng(0)
    k = rng.normal(size=(2, 3, 50, 16)).astype(np.float32) + np.array([2.0] + [0.0] * 15, np.float32)
    k[1, 2, 7] = 0.0  # a zero key: cosine 0, no NaN
    got = keydiff_scores(mx.array(k))
    np.testing.assert_allclose(np.array(got), keydiff_reference(k.astype(np.float64)), atol=1e-5)
    norms = mx.sqrt((mx.array(k) ** 2).sum(-1))
    np.testing.assert_allclose(np.array(keydiff_scores(mx.array(k), norms)), np.array(got), atol=1e-6)
    # the outlier key (most unlike the mean) scores highest: it is kept longest
    k2 = rng.normal(size=(1, 1, 20, 8)).astype(np.float32) * 0.1 + 1.0
    k2[0, 0, 5] = -1.0
    assert int(np.argmax(np.array(keydiff_scores(mx.array(k2))))) == 5


def test_keydiff_rescores_every_slot_at_each_update():
    rng = np.random.default_rng(1)
    k = mx.array(rng.normal(size=(1, 2, 12, 8)).astype(np.float32))
    pos = mx.broadcast_to(mx.arange(12, dtype=mx.int32), (1, 2, 12))
    s = KeyDiffScorer().on_append(view(k, k, pos, 12), k[:, :, -3:], mx.arange(9, 12, dtype=mx.int32))
    np.testing.assert_allclose(np.array(s), keydiff_reference(np.array(k, np.float64)), atol=1e-5)


# -- Expected Attention ------------------------------------------------------------------------------------------


def rope_matrix(theta: np.ndarray, t: np.ndarray, D: int, traditional: bool) -> np.ndarray:
    """Dense RoPE rotations [T, D, D] at positions t (kvpress's R = cos*I + sin*P for the half-split layout)."""
    m = len(theta)
    R = np.tile(np.eye(D), (len(t), 1, 1))
    ang = t[:, None] * theta[None]
    for r in range(m):
        a, b = (2 * r, 2 * r + 1) if traditional else (r, r + m)
        c, s = np.cos(ang[:, r]), np.sin(ang[:, r])
        R[:, a, a], R[:, a, b], R[:, b, a], R[:, b, b] = c, -s, s, c
    return R


def expected_attention_reference(u, qpos, keys, kpos, values, theta, offset, F, n_sink, scale, traditional, cov=True):
    """kvpress ExpectedAttentionPress.score on pre-RoPE queries u [B, Hq, S, D] (float64 throughout)."""
    B, Hq, S, D = u.shape
    H, L = keys.shape[1], keys.shape[2]
    G = Hq // H
    q = u[:, :, qpos >= n_sink]
    mu = q.mean(axis=2)
    c = q - mu[:, :, None]
    sigma = np.einsum("bnsi,bnsj->bnij", c, c) / q.shape[2]
    Rbar = rope_matrix(theta, np.arange(offset, offset + F, dtype=np.float64), D, traditional).mean(axis=0)
    mu = mu @ Rbar.T
    sigma = Rbar @ sigma @ Rbar.T
    out = np.zeros((B, H, L))
    keep = kpos[0, 0] >= n_sink
    k = np.repeat(keys[:, :, keep], G, axis=1)  # repeat_kv
    z = np.einsum("bhd,bhld->bhl", mu, k) * scale
    if cov:
        z = z + np.einsum("bhld,bhde,bhle->bhl", k, sigma, k) * scale**2 / 2
    z = np.exp(z - z.max(-1, keepdims=True))
    a = (z / z.sum(-1, keepdims=True)).reshape(B, H, G, -1).mean(axis=2)
    s = a * np.linalg.norm(values[:, :, keep], axis=-1)
    out[:, :, keep] = s
    out[:, :, ~keep] = s.max(axis=-1, keepdims=True) + 1
    return out


def rope(x: np.ndarray, D: int, base: float, offset: int, traditional: bool = False) -> mx.array:
    """The model's rotation of queries x [B, Hq, S, D] at positions offset .. offset + S - 1."""
    return mx.fast.rope(mx.array(x.astype(np.float32)), D, traditional=traditional, base=base, scale=1.0, offset=offset)


def theta_of(base: float, D: int) -> np.ndarray:
    return base ** (-np.arange(0, D, 2, dtype=np.float64) / D)


@pytest.mark.parametrize("traditional", [False, True])
@pytest.mark.parametrize("covariance", [True, False])
def test_expected_attention_matches_kvpress_formula_on_model_rotated_queries(traditional, covariance):
    rng = np.random.default_rng(2)
    B, H, G, S, L, D, base, F, n_sink = 2, 2, 3, 40, 60, 16, 500.0, 64, 4
    offset = S  # a first chunk: queries at positions 0 .. S-1 (the first n_sink left out)
    u = rng.normal(size=(B, H * G, S, D)) * 0.6 + rng.normal(size=(1, H * G, 1, D)) * 0.5
    queries = rope(u, D, base, 0, traditional)  # as the model's attention hands them over
    keys = rng.normal(size=(B, H, L, D)) * 0.7
    values = rng.normal(size=(B, H, L, D))
    kpos = np.broadcast_to(np.arange(L), (B, H, L)).astype(np.int32)
    theta = theta_of(base, D)
    scorer = ExpectedAttentionScorer(
        rope_freqs=tuple(theta.astype(np.float32).tolist()),
        rope_traditional=traditional,
        n_future=F,
        n_sink=n_sink,
        use_covariance=covariance,
    )
    v = view(mx.array(keys.astype(np.float32)), mx.array(values.astype(np.float32)), mx.array(kpos), offset)
    got = np.array(scorer.on_attention(v, queries, D**-0.5, "causal"))
    want = expected_attention_reference(
        u, np.arange(S), keys, kpos, values, theta, offset, F, n_sink, D**-0.5, traditional, covariance
    )
    np.testing.assert_allclose(got, want, rtol=2e-3, atol=1e-6)


def test_expected_attention_scores_a_run_of_chunks_as_one_chunk_and_a_decode_step_from_its_query():
    rng = np.random.default_rng(3)
    B, Hq, H, S, D = 1, 4, 2, 24, 8
    scorer = ExpectedAttentionScorer(
        rope_freqs=tuple(theta_of(100.0, D).astype(np.float32)), n_future=32, n_sink=2, rescore_every=1
    )
    q = rope(rng.normal(size=(B, Hq, S, D)), D, 100.0, 0)
    k = mx.array(rng.normal(size=(B, H, S, D)).astype(np.float32))
    pos = mx.broadcast_to(mx.arange(S, dtype=mx.int32), (B, H, S))
    whole = scorer.on_attention(view(k, k, pos, S, {}), q, 0.35, "causal")
    run = {}
    scorer.on_attention(view(k[:, :, :10], k[:, :, :10], pos[..., :10], 10, run), q[:, :, :10], 0.35, "causal")
    split = scorer.on_attention(view(k, k, pos, S, dict(run)), q[:, :, 10:], 0.35, "causal")
    np.testing.assert_allclose(np.array(split), np.array(whole), rtol=1e-4, atol=1e-6)
    # a decode step: one query (no covariance), scored at its own position
    u = rng.normal(size=(B, Hq, 1, D)) * 0.5
    qd = rope(u, D, 100.0, S - 1)
    got = scorer.on_attention(view(k, k, pos, S, {}), qd, D**-0.5, None)
    want = expected_attention_reference(
        u, np.array([S - 1]), np.array(k, np.float64), np.array(pos), np.array(k, np.float64),
        theta_of(100.0, D), S, 32, 2, D**-0.5, False, cov=False,
    )  # fmt: skip
    np.testing.assert_allclose(np.array(got), want, rtol=2e-3, atol=1e-6)


def test_expected_attention_keeps_the_scores_when_every_query_is_a_sink():
    k = mx.ones((1, 1, 3, 4))
    pos = mx.arange(3, dtype=mx.int32).reshape(1, 1, 3)
    v = view(k, k, pos, 3)._replace(scores=mx.array([[[0.5, 0.25, 0.125]]]))
    got = ExpectedAttentionScorer(n_sink=4).on_attention(v, mx.ones((1, 2, 3, 4)), 0.5, "causal")
    assert np.array(got).tolist() == [[[0.5, 0.25, 0.125]]]


# -- pooling --------------------------------------------------------------------------------------------------


def pool_reference(x: np.ndarray, pos: np.ndarray, P: int) -> np.ndarray:
    """Per row: the max over the P nearest retained slots in position order (any slot order)."""
    out = np.empty_like(x)
    r = (P - 1) // 2
    for idx in np.ndindex(*x.shape[:-1]):
        order = np.argsort(pos[idx])
        xs = x[idx][order]
        out[idx][order] = [xs[max(0, i - r) : i + r + 1].max() for i in range(len(xs))]
    return out


def test_keydiff_and_expected_attention_pool_their_scores_over_the_nearest_retained_positions():
    rng = np.random.default_rng(5)
    B, H, G, L, D = 1, 2, 2, 30, 8
    k = mx.array(rng.normal(size=(B, H, L, D)).astype(np.float32))
    retained = np.concatenate([[0, 1], 3 * np.arange(1, L - 1)])  # two sinks, then gaps of evicted positions
    pos = mx.array(np.stack([rng.permutation(retained) for _ in range(H)])[None].astype(np.int32))  # any slot order
    plain = np.array(KeyDiffScorer(pool=1).on_append(view(k, k, pos, 3 * L), k[:, :, -2:], pos[0, 0, -2:]))
    pooled = np.array(KeyDiffScorer(pool=5).on_append(view(k, k, pos, 3 * L), k[:, :, -2:], pos[0, 0, -2:]))
    np.testing.assert_allclose(pooled, pool_reference(plain, np.array(pos), 5), atol=1e-6)
    assert not np.allclose(pooled, plain)

    q = rope(rng.normal(size=(B, H * G, 6, D)), D, 100.0, 3 * L - 6)
    ea = lambda P: np.array(  # noqa: E731
        ExpectedAttentionScorer(rope_freqs=tuple(theta_of(100.0, D)), n_sink=2, pool=P).on_attention(
            view(k, k, pos, 3 * L), q, D**-0.5, "causal"
        )
    )
    plain, pooled = ea(1), ea(5)
    sink = np.array(pos) < 2
    # past the sinks: the pooled score of the non-sink neighbours; the sinks: above every other score
    want = pool_reference(np.where(sink, 0.0, plain), np.array(pos), 5)
    np.testing.assert_allclose(pooled[~sink], want[~sink], rtol=1e-5, atol=1e-7)
    assert (pooled[sink].reshape(H, 2).min(-1) > np.where(sink, -1, pooled).max(-1)[0]).all()


def test_pool_applies_to_every_score_and_must_be_odd():
    assert parse_config("h2o:score=keydiff,pool=15").policy.pool_width == 15
    assert parse_config("cam:score=expected_attention,pool=3").policy.pool_width == 3
    assert parse_config("h2o").policy.pool_width == 31 and parse_config("h2o:when=stream").policy.pool_width == 15
    with pytest.raises(ConfigError, match="pool must be odd"):
        parse_config("h2o:score=keydiff,pool=4")
    caches = KVCacheBuilder.for_model(tiny_llama(), "h2o:score=keydiff,pool=7,budget=16")
    assert caches[0].policy.scorer.pool == 7


# -- the layer RoPE --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "rope",
    [
        nn.RoPE(16, traditional=False, base=10000.0),
        nn.RoPE(16, traditional=True, base=500.0, scale=0.25),
        nn.RoPE(8, base=10000.0),  # partial rotary: 8 of 16 dims
        Llama3RoPE(16, 8192, False, 500000.0, {"factor": 8.0, "original_max_position_embeddings": 1024}),
        YarnRoPE(16, scaling_factor=4.0, original_max_position_embeddings=512, mscale=1.0, mscale_all_dim=0.5),
        SuScaledRoPE(16, 10000.0, 4096, 1024, short_factor=[1.0] * 8, long_factor=[1.5] * 8),
    ],
    ids=["default", "traditional-scaled", "partial", "llama3", "yarn", "longrope"],
)
def test_the_rope_read_from_a_module_rotates_queries_as_the_module_does(rope):
    freqs, traditional = rope_freqs(rope)
    x = mx.random.normal((1, 2, 1, 16), key=mx.random.key(1))
    for p in (0, 7, 3000):
        ang = p * mx.array(freqs)
        mine = rotate_pairs(rope(x, offset=0), mx.cos(ang), mx.sin(ang), traditional)
        np.testing.assert_allclose(np.array(mine), np.array(rope(x, offset=p)), atol=2e-3)


def test_the_builder_gives_each_layer_its_own_rope_and_refuses_one_it_cannot_read():
    model = tiny_model(
        "gemma3_text", num_hidden_layers=6, sliding_window=8, sliding_window_pattern=3, rope_theta=1e6,
        rope_local_base_freq=1e4,
    )  # fmt: skip
    caches = KVCacheBuilder.for_model(model, "cam:budget=16,n_sink=2,score=expected_attention")
    D = 16
    for i, c in enumerate(caches):
        base = 1e6 if (i + 1) % 3 == 0 else 1e4  # every third layer global
        np.testing.assert_allclose(c.policy.config.policy.rope_freqs, theta_of(base, D), rtol=1e-5)
    assert caches[0].policy is caches[1].policy and caches[0].policy is not caches[2].policy
    # keydiff needs no RoPE: one policy, no rope fields
    kd = KVCacheBuilder.for_model(model, "h2o:budget=16,n_sink=2,score=keydiff")
    assert all(c.policy.config.policy.rope_freqs is None for c in kd)
    assert len({id(c.policy) for c in kd}) == len({c.budget for c in kd})  # one policy per budget
    llama = tiny_llama(layers=2)
    for layer in llama.layers:
        layer.self_attn.rope = DynamicNTKScalingRoPE(
            16, max_position_embeddings=2048, traditional=False, base=10000.0, factor=2.0
        )
    with pytest.raises(ModelError, match="layer 0: DynamicNTKScalingRoPE.*score=keydiff"):
        KVCacheBuilder.for_model(llama, "h2o:score=expected_attention")
    assert len(model_ropes(model, 6)) == 6


# -- config ----------------------------------------------------------------------------------------------------


def test_score_dispatches_the_scorer_and_bad_values_are_refused_naming_the_field():
    assert parse_config("h2o:score=keydiff").policy.scorer_name == "keydiff"
    assert parse_config("cam:score=expected_attention").policy.scorer_name == "expected_attention"
    assert parse_config("h2o").policy.scorer_name == "observation_window"
    with pytest.raises(ConfigError, match="score.*'attention', 'keydiff' or 'expected_attention'.*'keyd'"):
        parse_config("h2o:score=keyd")
    with pytest.raises(ConfigError, match="obs_window=8: signal and obs_window apply to score='attention'"):
        parse_config("cam:score=keydiff,obs_window=8")
    with pytest.raises(ConfigError, match="n_future: apply to score='expected_attention'"):
        parse_config("h2o:score=keydiff,n_future=64")
    with pytest.raises(ConfigError, match="n_future"):
        parse_config("h2o:score=expected_attention,n_future=0")
    p = parse_config("h2o:score=expected_attention,n_future=64,covariance=false").policy
    assert (p.future_positions, p.uses_covariance, p.uses_vnorm) == (64, False, True)


# -- through mlx-lm --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model():
    return tiny_llama(layers=2, seed=4)


def generate(model, caches, prompt, n, step=16):
    return [t for t, _ in generate_step(prompt, model, max_tokens=n, prompt_cache=caches, prefill_step_size=step)]


@pytest.mark.parametrize("method", METHODS)
def test_a_query_agnostic_method_keeps_its_budget_and_exact_positions_through_generate_step(model, method):
    budget, n_sink = 16, 2
    caches = KVCacheBuilder.for_model(model, f"{method},budget={budget},n_sink={n_sink}")
    prompt = mx.random.randint(0, 97, (50,), key=mx.random.key(5))
    tokens = generate(model, caches, prompt, 12)
    assert len(tokens) == 12
    for c in caches:
        keys, _, positions, scores = c.retained()
        pos = np.array(positions)
        assert keys.shape[2] == budget and c.offset == 50 + len(tokens)  # generate_step feeds each token it yields
        assert np.isfinite(np.array(scores)).all()
        for row in pos.reshape(-1, budget):
            assert len(set(row.tolist())) == budget and row.min() >= 0 and row.max() == c.offset - 1
            assert {0, 1} <= set(row.tolist())  # sinks kept
            assert list(row) == sorted(row)


@pytest.mark.parametrize("method", ["h2o:score=keydiff", "cam:score=expected_attention"])
def test_a_query_agnostic_cache_saved_and_loaded_continues_as_the_original(model, method, tmp_path):
    config = f"{method},budget=16,n_sink=2"
    prompt = mx.random.randint(0, 97, (40,), key=mx.random.key(6))
    caches = KVCacheBuilder.for_model(model, config)
    generate(model, caches, prompt, 3)
    save_caches(tmp_path / "c.safetensors", caches)
    loaded = load_caches(tmp_path / "c.safetensors", model=model)
    assert [c.policy.config for c in loaded] == [c.policy.config for c in caches]
    nxt = mx.array([7])
    a = generate(model, caches, nxt, 6)
    b = generate(model, loaded, nxt, 6)
    assert a == b
    restored = PolicyCache.from_state(caches[0].state)
    assert restored.policy.config == caches[0].policy.config


def test_the_scores_change_the_evictions_against_the_attention_scorer(model):
    prompt = mx.random.randint(0, 97, (60,), key=mx.random.key(7))
    kept = {}
    for method in ("h2o", "h2o:score=keydiff", "h2o:score=expected_attention"):
        caches = KVCacheBuilder.for_model(model, with_fields(method, "budget=16,n_sink=2,recent=2"))
        generate(model, caches, prompt, 1)
        kept[method] = np.array(caches[0].retained()[2]).tolist()
    assert len({str(v) for v in kept.values()}) == 3


# -- rescoring at decode -----------------------------------------------------------------------------------------


def test_a_decode_step_rescores_every_k_th_step_and_otherwise_gives_the_new_token_its_rows_highest_score():
    rng = np.random.default_rng(8)
    k = mx.array(rng.normal(size=(1, 2, 9, 8)).astype(np.float32))
    pos = mx.broadcast_to(mx.arange(9, dtype=mx.int32), (1, 2, 9))
    before = mx.array(rng.normal(size=(1, 2, 9)).astype(np.float32)) * mx.array([1.0] * 8 + [0.0])  # new: 0
    scorer = KeyDiffScorer(rescore_every=4)
    held = scorer.on_append(view(k, k, pos, 9)._replace(scores=before), k[:, :, -1:], mx.array([8], dtype=mx.int32))
    want = np.array(before)
    want[..., 8] = want.max(axis=-1)
    np.testing.assert_array_equal(np.array(held), want)
    at8 = scorer.on_append(view(k, k, pos + 3, 12)._replace(scores=before), k[:, :, -1:], mx.array([11]))
    np.testing.assert_allclose(np.array(at8), keydiff_reference(np.array(k, np.float64)), atol=1e-5)
    # stacked rows (a batch's decode step): each row as it would be alone
    offsets = mx.array([9, 12], dtype=mx.int32).reshape(2, 1, 1)
    k2, p2 = mx.concatenate([k, k]), mx.concatenate([pos, pos + 3])
    both = scorer.on_append(
        CacheView(k2, k2, p2, mx.concatenate([before, before]), offsets, 1, None), k2[:, :, -1:], offsets + 0
    )
    np.testing.assert_allclose(np.array(both), np.concatenate([np.array(held), np.array(at8)]), atol=1e-6)


def test_expected_attention_holds_the_prompts_scores_at_decode_by_default():
    k = mx.array(np.random.default_rng(9).normal(size=(1, 1, 6, 4)).astype(np.float32))
    pos = mx.arange(6, dtype=mx.int32).reshape(1, 1, 6)
    before = mx.array([[[3.0, 1.0, 0.5, 2.0, 0.25, 0.0]]])
    got = ExpectedAttentionScorer(n_sink=1).on_attention(
        view(k, k, pos, 6)._replace(scores=before), mx.ones((1, 2, 1, 4)), 0.5, None
    )
    assert np.array(got).tolist() == [[[3.0, 1.0, 0.5, 2.0, 0.25, 3.0]]]
    assert parse_config("h2o:score=expected_attention").policy.rescore_interval == 0
    assert parse_config("h2o:score=keydiff").policy.rescore_interval == 8
    with pytest.raises(ConfigError, match="rescore_every=2: applies to score='keydiff' or 'expected_attention'"):
        parse_config("h2o:rescore_every=2")


def test_a_non_finite_key_scores_lowest_and_leaves_the_other_scores_of_its_head_alone():
    """One NaN key used to make the anchor NaN, so every score of its head became NaN (0 in the cache)."""
    from kvpolicy_core.parts.keydiff import NONFINITE_SCORE, _pooled_keydiff

    rng = np.random.default_rng(3)
    k = rng.normal(size=(1, 2, 12, 8)).astype(np.float32) + 1.0
    bad = k.copy()
    bad[0, 0, 5, 3] = np.nan
    bad[0, 1, 2, 0] = np.inf
    got = np.array(keydiff_scores(mx.array(bad)))
    assert np.isfinite(got).all()
    assert got[0, 0, 5] == NONFINITE_SCORE and got[0, 1, 2] == NONFINITE_SCORE
    assert (np.delete(got[0, 0], 5) > NONFINITE_SCORE).all()  # the lowest: evicted first
    for h, j in ((0, 5), (1, 2)):  # the others: as if the broken key were not there
        want = keydiff_reference(np.delete(k[:, h : h + 1], j, axis=2).astype(np.float64))[0, 0]
        np.testing.assert_allclose(np.delete(got[0, h], j), want, atol=1e-5)
    pos = mx.broadcast_to(mx.arange(12, dtype=mx.int32), (1, 2, 12))
    pooled = np.array(_pooled_keydiff(mx.array(bad), None, pos, 3))
    assert pooled[0, 0, 5] == NONFINITE_SCORE and np.isfinite(pooled).all()
    np.testing.assert_allclose(pooled[0, 0, 4], max(got[0, 0, 3], got[0, 0, 4]), atol=1e-6)  # lifts no neighbour
    s = KeyDiffScorer(pool=3).on_append(view(mx.array(bad), mx.array(bad), pos, 12), mx.array(bad), pos[0, 0])
    np.testing.assert_array_equal(np.array(s), pooled)
