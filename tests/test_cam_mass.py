"""CaM's mass merges (merge="mass", "mass_blend"): slow references, mass preservation, drop == H2O untouched."""

import math

import mlx.core as mx
import numpy as np
import pytest
from helpers import feed, random_kv

from kvpolicy_cam.mass_merge import MassMergeDisposition
from kvpolicy_core import PolicyCache
from kvpolicy_core.attention.bias import with_log_weights
from kvpolicy_core.cache.slots import SlotStore
from kvpolicy_core.parts.base import CacheView


def random_view(seed, B=2, H=2, L=12, D=6, log_weights=True):
    rng = np.random.default_rng(seed)
    K = rng.normal(size=(B, H, L, D)).astype(np.float32)
    V = rng.normal(size=(B, H, L, D)).astype(np.float32)
    pos = np.stack([np.stack([rng.permutation(L) for _ in range(H)]) for _ in range(B)]).astype(np.int32)
    s = rng.uniform(0.0, 3.0, size=(B, H, L)).astype(np.float32)
    s[0, 0, 5] = 0.0  # a slot that drew no attention
    lw = rng.uniform(0.0, 1.0, size=(B, H, L)).astype(np.float32) if log_weights else None
    offset = L + 3
    view = CacheView(
        mx.array(K),
        mx.array(V),
        mx.array(pos),
        mx.array(s),
        offset,
        0,
        None,
        log_weights=None if lw is None else mx.array(lw),
    )
    return view, (K, V, pos, s, lw, offset)


def losers_of(view, E, seed):
    rng = np.random.default_rng(seed)
    B, H, L = view.scores.shape
    pos = np.array(view.positions)
    out = np.zeros((B, H, E), np.int32)
    for b in range(B):
        for h in range(H):
            cand = [j for j in range(L) if pos[b, h, j] >= 2]  # n_sink = 2
            out[b, h] = rng.choice(cand, E, replace=False)
    return mx.array(out)


def reference_mass_merge(
    K, V, pos, s, lw, offset, losers, log_weights, n_sink=2, min_sim=-1.0, cap=None, after_tokens=0
):
    """Loops: nearest non-sink survivor by cosine (a loser below ``min_sim`` is dropped, and one whose
    target's log-weight is at ``log(cap)`` already, and every loser before ``offset`` reaches
    ``after_tokens``), then the docstring's equations per target."""
    B, H, L, _ = K.shape
    V2, s2 = V.copy(), s.copy()
    lw2 = None if lw is None else lw.copy()
    for b in range(B):
        for h in range(H):
            ls = set(losers[b, h].tolist())
            groups = {}
            for l in losers[b, h].tolist():
                best, tgt = -math.inf, None
                for j in range(L):
                    if j in ls or pos[b, h, j] < n_sink:
                        continue
                    c = K[b, h, l] @ K[b, h, j] / (np.linalg.norm(K[b, h, l]) * np.linalg.norm(K[b, h, j]))
                    if c > best:
                        best, tgt = c, j
                full = cap is not None and lw[b, h, tgt] >= math.log(cap)
                if best >= min_sim and not full and offset >= after_tokens:
                    groups.setdefault(tgt, []).append(l)
            for t, group in groups.items():
                if log_weights:
                    m = lambda j: max(s[b, h, j], 0) / max(offset - pos[b, h, j], 1)  # noqa: E731
                else:
                    m = lambda j: max(s[b, h, j], 0)  # noqa: E731
                mt, ml = m(t), sum(m(l) for l in group)
                if mt + ml > 0:
                    V2[b, h, t] = (mt * V[b, h, t] + sum(m(l) * V[b, h, l] for l in group)) / (mt + ml)
                if log_weights and mt > 0:
                    step = math.log1p(min(ml / mt, 1e4))
                    if cap is not None:
                        step = min(step, math.log(cap) - lw[b, h, t])
                    lw2[b, h, t] = lw[b, h, t] + step
                s2[b, h, t] = s[b, h, t] + sum(s[b, h, l] for l in group)
    return V2, s2, lw2


def apply(view, update):
    store = SlotStore(track_log_weights=view.log_weights is not None)
    store.restore((view.keys, view.values, view.positions, view.scores, view.keys.shape[2], view.log_weights))
    store.add(update)
    return store


@pytest.mark.parametrize(
    "min_sim, cap, after", [(-1.0, None, 0), (0.5, None, 0), (-1.0, 1.5, 0), (-1.0, None, 1), (-1.0, None, 10**6)]
)
@pytest.mark.parametrize("log_weights", [True, False])
@pytest.mark.parametrize("E", [1, 4])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_mass_merges_match_the_slow_reference(log_weights, E, seed, min_sim, cap, after):
    view, (K, V, pos, s, lw, offset) = random_view(seed, log_weights=log_weights)
    losers = losers_of(view, E, seed)
    after = after * offset  # 0: no condition; 1 x offset: merges (at the threshold); 10**6 x: drops
    d = MassMergeDisposition(
        n_sink=2, log_weights=log_weights, gate=False, min_sim=min_sim, cap=cap, after_tokens=after
    )
    store = apply(view, d.dispose(view, losers, mx.random.key(0)))
    cap = cap if log_weights else None  # the cap bounds log-weights: mass_blend keeps none
    V2, s2, lw2 = reference_mass_merge(
        K, V, pos, s, lw, offset, np.array(losers), log_weights, min_sim=min_sim, cap=cap, after_tokens=after
    )
    np.testing.assert_allclose(np.array(store.values), V2, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.array(store.scores), s2, rtol=1e-6)
    if log_weights:
        np.testing.assert_allclose(np.array(store.log_weights), lw2, rtol=1e-5, atol=1e-6)


def test_mass_merge_keeps_the_attention_output_of_a_query_whose_shares_match_the_rates():
    """Three slots a, t, l with attention shares p_j for query q; the rates r_j = s_j / age_j equal p_j.

    After merging l into t the cache holds {a, t'} and attention(q) over it equals the full one."""
    rng = np.random.default_rng(4)
    D = 8
    K = rng.normal(size=(3, D)).astype(np.float32)
    K[2] = K[1] + 0.3 * rng.normal(size=D)  # l is t's nearest neighbour
    V = rng.normal(size=(3, D)).astype(np.float32)
    q = rng.normal(size=D).astype(np.float32)
    logits = K @ q / math.sqrt(D)
    p = np.exp(logits - logits.max())
    p /= p.sum()
    pos = np.array([2, 5, 9], np.int32)
    offset = 12
    s = (p * (offset - pos)).astype(np.float32)  # rate = share
    view = CacheView(
        mx.array(K)[None, None],
        mx.array(V)[None, None],
        mx.array(pos)[None, None],
        mx.array(s)[None, None],
        offset,
        0,
        None,
        log_weights=mx.zeros((1, 1, 3)),
    )
    d = MassMergeDisposition(n_sink=0, log_weights=True, gate=False)
    u = d.dispose(view, mx.array([[[2]]], mx.int32), mx.random.key(0))
    assert u.targets.item() == 1
    store = apply(view, u)
    keep = mx.array([0, 1])
    Kk, Vk = store.keys[:, :, keep], store.values[:, :, keep]
    qq = mx.array(q)[None, None, None]
    mask = with_log_weights(None, store.log_weights[:, :, keep], qq)
    out = mx.fast.scaled_dot_product_attention(qq, Kk, Vk, scale=D**-0.5, mask=mask)
    full = mx.fast.scaled_dot_product_attention(qq, mx.array(K)[None, None], mx.array(V)[None, None], scale=D**-0.5)
    assert mx.allclose(out, full, atol=1e-5)
    dropped = mx.fast.scaled_dot_product_attention(
        qq, mx.array(K[:2])[None, None], mx.array(V[:2])[None, None], scale=D**-0.5
    )
    assert not mx.allclose(dropped, full, atol=1e-3)  # dropping l would have changed it


def test_mass_blend_barely_moves_a_heavy_survivor():
    K = np.array([[1, 0], [1, 0.1], [1, 0.12], [0, 1]], np.float32)
    V = np.array([[0, 0], [1, 1], [9, 9], [5, 5]], np.float32)
    s = np.array([1, 10.0, 0.1, 1], np.float32)
    view = CacheView(
        mx.array(K)[None, None],
        mx.array(V)[None, None],
        mx.arange(4, dtype=mx.int32)[None, None],
        mx.array(s)[None, None],
        4,
        0,
        None,
        log_weights=None,
    )
    u = MassMergeDisposition(n_sink=1, log_weights=False).dispose(view, mx.array([[[2]]], mx.int32), mx.random.key(0))
    store = apply(view, u)
    assert u.targets.item() == 1 and u.d_log_weights is None
    np.testing.assert_allclose(np.array(store.values[0, 0, 1]), 1 + 8 * 0.1 / 10.1, rtol=1e-5)


@pytest.mark.parametrize("merge", ["mass", "mass_blend"])
@pytest.mark.parametrize("chunks", [[1] * 40, [15, 1, 1, 18, 5]])
def test_mass_caches_hold_the_budget_stay_finite_and_count_merges(merge, chunks):
    K, V = random_kv(B=2, H=2, S=40, D=8, seed=5)
    cache = PolicyCache(f"cam:budget=10,n_sink=2,merge={merge},signal=observed,gate=false,min_sim=-1")
    feed(cache, K, V, chunks)
    cache.settle()
    keys, values, positions, _ = cache.retained()
    assert keys.shape[2] == 10 and cache.merges > 0
    assert mx.isfinite(values).all().item()
    assert (merge == "mass") == (cache.log_weights is not None)
    assert np.all(np.array(positions)[..., :2] == [0, 1])  # sinks kept


@pytest.mark.parametrize("chunks", [[1] * 40, [15, 1, 1, 18, 5]])
def test_min_sim_trades_merges_for_drops_and_one_is_h2o_exactly_on_keys_of_distinct_directions(chunks):
    K, V = random_kv(B=2, H=2, S=40, D=8, seed=6)
    base = "budget=10,n_sink=2,signal=proxy,prompt=true,when=stream"
    merges = []
    for tau in (-1.0, 0.5, 0.8):
        cache = PolicyCache(f"cam:{base},min_sim={tau}")
        feed(cache, K, V, chunks)
        merges.append(int(cache.merges))
    assert merges[0] > merges[1] > merges[2] > 0  # a higher threshold merges fewer losers
    never, h2o = PolicyCache(f"cam:{base},min_sim=1"), PolicyCache("h2o:budget=10,n_sink=2,signal=proxy,when=stream")
    for c in (never, h2o):
        feed(c, K, V, chunks)
    assert never.merges == 0 and not mx.any(never.log_weights).item()
    for x, y in zip(never.state[:4], h2o.state[:4]):
        assert mx.array_equal(x, y)


def test_cap_bounds_what_one_slot_stands_for_and_cap_one_is_h2o_exactly():
    """cap=c: no slot's attention weight exp(lw) exceeds c over a long decode run; cap=1 never merges."""
    K, V = random_kv(B=2, H=2, S=80, D=8, seed=9)
    base = "budget=10,n_sink=2,signal=proxy,min_sim=-1"
    free, capped = PolicyCache(f"cam:{base},cap=none"), PolicyCache(f"cam:{base},cap=2")
    for c in (free, capped):
        feed(c, K, V, [1] * 80)
    assert float(mx.max(free.log_weights).item()) > math.log(2) + 0.1  # uncapped, some slot absorbs more
    assert float(mx.max(capped.log_weights).item()) <= math.log(2) + 1e-6
    assert 0 < capped.merges < free.merges  # full targets drop their losers instead
    never, h2o = PolicyCache(f"cam:{base},cap=1"), PolicyCache("h2o:budget=10,n_sink=2,signal=proxy,when=stream")
    for c in (never, h2o):
        feed(c, K, V, [1] * 80)
    assert never.merges == 0
    for x, y in zip(never.state[:4], h2o.state[:4]):
        assert mx.array_equal(x, y)


def test_cap_is_refused_below_one_and_for_merges_without_log_weights():
    from kvpolicy_core.config.parse import parse_config
    from kvpolicy_core.errors import ConfigError

    for bad in ("cam:cap=0.5", "cam:merge=mass_blend,cap=4", "cam:merge=sim_weighted,cap=4"):
        with pytest.raises(ConfigError, match="cap"):
            parse_config(bad)


def test_min_sim_is_refused_for_merges_that_do_not_use_it():
    from kvpolicy_core.config.parse import parse_config
    from kvpolicy_core.errors import ConfigError

    with pytest.raises(ConfigError, match="min_sim"):
        parse_config("cam:merge=sim_weighted,min_sim=0.5")
    with pytest.raises(ConfigError, match="min_sim"):
        parse_config("cam:min_sim=3")


def test_the_default_merges_only_at_decode_steps_so_a_prompt_is_compressed_as_h2o_compresses_it():
    """cam's default (prompt=false): a prompt chunk's losers are dropped, bit for bit H2O's cache; decode merges."""
    K, V = random_kv(B=2, H=2, S=48, D=8, seed=8)
    cam, h2o = (PolicyCache(f"{m}:budget=12,n_sink=2,signal=proxy,when=stream") for m in ("cam", "h2o"))
    for c in (cam, h2o):
        feed(c, K[:, :, :40], V[:, :, :40], [30, 10])  # two prompt chunks, both evict
    assert cam.merges == 0
    for x, y in zip(cam.state[:4], h2o.state[:4]):
        assert mx.array_equal(x, y)
    for c in (cam, h2o):
        feed(c, K[:, :, 40:], V[:, :, 40:], [1] * 8)  # decode steps: losers within min_sim merge
    assert cam.merges > 0 and not mx.array_equal(cam.state[1], h2o.state[1])
    prompts = PolicyCache("cam:budget=12,n_sink=2,signal=proxy,prompt=true,min_sim=-1,when=stream")
    feed(prompts, K[:, :, :40], V[:, :, :40], [30, 10])
    assert prompts.merges > 0  # prompt=true merges prompt losers too


def bits(x: mx.array) -> mx.array:
    """The bit patterns of a float array (array_equal calls -0.0 and 0.0 equal; these differ)."""
    return x.view({mx.float32: mx.uint32, mx.float16: mx.uint16, mx.bfloat16: mx.uint16}.get(x.dtype, x.dtype))


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16])
def test_an_update_that_changes_nothing_leaves_the_buffers_bit_for_bit(monkeypatch, dtype):
    """Decode evictions where no loser merges return all-zero deltas; decided on the device, the cache then
    holds H2O's buffers bit for bit (a -0.0 value stays -0.0: adding +0.0 would turn it into 0.0), and the key
    norms and log-weights of a disposition that returns no update at all."""
    K, V = random_kv(B=1, H=2, S=30, D=8, seed=10, dtype=dtype)
    V = mx.where(mx.arange(8) % 3 == 0, mx.array(-0.0, dtype), V)  # some -0.0 elements in every row
    config = "cam:budget=10,n_sink=2,signal=proxy,min_sim=1,gate=true"  # no two keys parallel
    never, h2o = PolicyCache(config), PolicyCache("h2o:budget=10,n_sink=2,signal=proxy,when=stream")
    for c in (never, h2o):
        feed(c, K, V, [1] * 30)
    assert never.merges == 0 and never.gate_draws == 0
    for x, y in zip(never.state[:4], h2o.state[:4]):
        assert mx.array_equal(bits(x), bits(y))
    monkeypatch.setattr(MassMergeDisposition, "dispose", lambda self, view, losers, key: None)
    untouched = PolicyCache(config)
    feed(untouched, K, V, [1] * 30)
    untouched.settle()  # as never.state did
    for x, y in ((never.log_weights, untouched.log_weights), (never._slots.key_norms, untouched._slots.key_norms)):
        assert mx.array_equal(bits(x), bits(y))
    monkeypatch.undo()
    merging = PolicyCache("cam:budget=10,n_sink=2,signal=proxy,min_sim=-1")
    feed(merging, K, V, [1] * 30)
    assert merging.merges > 0


def test_after_drops_until_the_cache_has_seen_after_times_its_budget_then_merges():
    """after=a: every loser is dropped (H2O's cache, bit for bit) while the cache has seen fewer than a x budget
    tokens; from there on decode losers merge. An ``after`` beyond the run is H2O for the whole run."""
    K, V = random_kv(B=2, H=2, S=60, D=8, seed=11)
    base = "budget=10,n_sink=2,signal=proxy,min_sim=-1"
    late, h2o = PolicyCache(f"cam:{base},after=4"), PolicyCache("h2o:budget=10,n_sink=2,signal=proxy")
    for c in (late, h2o):
        feed(c, K[:, :, :39], V[:, :, :39], [1] * 39)  # evictions (state settles one) at offsets < 4 x 10: drops
    assert late.merges == 0 and not mx.any(late.log_weights).item()
    for x, y in zip(late.state[:4], h2o.state[:4]):
        assert mx.array_equal(x, y)
    for c in (late, h2o):
        feed(c, K[:, :, 39:], V[:, :, 39:], [1] * 21)  # evictions at offset 40 and later: merges
    assert late.merges > 0 and not mx.array_equal(late.state[1], h2o.state[1])
    early = PolicyCache(f"cam:{base}")
    feed(early, K, V, [1] * 60)
    assert early.merges > late.merges


@pytest.mark.parametrize("after", [1e3, 3e8, 1e30, 1e308])
def test_an_after_beyond_any_offset_is_h2o_for_the_whole_run(after):
    """A threshold past 2**31 tokens (the int32 offset of compiled steps) is accepted and never reached."""
    K, V = random_kv(B=2, H=2, S=40, D=8, seed=12)
    late, h2o = (
        PolicyCache(f"cam:budget=10,n_sink=2,signal=proxy,min_sim=-1,after={after}"),
        PolicyCache("h2o:budget=10,n_sink=2,signal=proxy"),
    )
    for c in (late, h2o):
        feed(c, K, V, [12] + [1] * 28)
    assert late.merges == 0
    for x, y in zip(late.state[:4], h2o.state[:4]):
        assert mx.array_equal(x, y)


def test_after_is_refused_below_one_and_for_merges_that_do_not_use_it():
    from kvpolicy_core.config.parse import parse_config
    from kvpolicy_core.errors import ConfigError

    for bad in ("cam:after=0.5", "cam:merge=sim_weighted,after=2", "cam:merge=drop,after=2"):
        with pytest.raises(ConfigError, match="after"):
            parse_config(bad)
    assert parse_config("cam:merge=mass_blend,after=3").policy.merge_after == 3.0
