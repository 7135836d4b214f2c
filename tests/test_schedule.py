"""The eviction schedule: when a cache cuts (streaming or once at the end of the prompt), how many slots leave
(a selector's ``evict_count``) and how large each layer is (an allocation)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from helpers import VOCAB, feed, random_kv, tiny_gemma3
from mlx_lm.generate import generate_step

from kvpolicy_core import KVCacheBuilder, PolicyCache, attach, detach, parse_config
from kvpolicy_core.config.policy import layer_budgets
from kvpolicy_core.errors import ConfigError, PluginError
from kvpolicy_core.parts.allocation import LayerInfo, PyramidAllocation, ReachAllocation, UniformAllocation
from kvpolicy_core.parts.lowest_score import LowestScoreSelector
from kvpolicy_core.plugin.discovery import register_plugin, unregister_plugin
from kvpolicy_core.plugin.hookspecs import hookimpl


def retained(cache):
    k, v, pos, scores = cache.retained()
    return np.array(pos), np.array(k), np.array(v), np.array(scores)


@pytest.mark.parametrize("method", ["h2o:signal=proxy", "cam:merge=mean,gate=false,signal=proxy", "h2o:score=keydiff"])
def test_prompt_end_holds_the_prompt_and_cuts_it_once_as_one_chunk_would(method):
    """A prompt in chunks (7, 20, 13) is held whole; the first one-token step cuts it exactly as the streaming
    cache cuts the same prompt given as one chunk: the same kept positions, keys, values and scores."""
    K, V = random_kv(B=2, H=3, S=44)
    held = PolicyCache(f"{method},budget=12,when=prompt_end")
    one = PolicyCache(f"{method},budget=12")
    feed(held, K[:, :, :40], V[:, :, :40], (7, 20, 13))
    assert held.n == 40 and held.offset == 40 and held.tokens_kept == 40  # the held prompt is what it holds
    held.state  # mlx-lm evaluates the state after every prefill chunk: it must not cut the held prompt
    assert held.n == 40
    feed(one, K[:, :, :40], V[:, :, :40], (40,))
    for t in range(40, 44):
        for c in (held, one):
            c.update_and_fetch(K[:, :, t : t + 1], V[:, :, t : t + 1])
        assert held.n == one.n == 13
    for a, b in zip(retained(held), retained(one)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_a_streaming_cache_cuts_every_chunk_and_prompt_end_keeps_more_of_the_start():
    K, V = random_kv(B=1, H=2, S=41)
    stream = PolicyCache("h2o:signal=proxy,budget=8,when=stream")
    held = PolicyCache("h2o:signal=proxy,budget=8,when=prompt_end")
    feed(stream, K[:, :, :40], V[:, :, :40], (10, 10, 10, 10))
    feed(held, K[:, :, :40], V[:, :, :40], (10, 10, 10, 10))
    assert stream.n == 18 and held.n == 40  # budget + one chunk, against the whole prompt
    for c in (stream, held):
        c.update_and_fetch(K[:, :, 40:41], V[:, :, 40:41])
        assert c.n == 9 and c.tokens_kept == 8


def test_prompt_end_through_mlx_lm_generate_bounds_decode_and_each_turn_is_cut_at_its_end():
    """Through mlx-lm's generate_step (prefill in chunks of 16), the cache holds each turn's prompt whole and keeps
    at most budget + 1 slots while decoding; a second turn on the same caches is held and cut again."""
    model = tiny_gemma3()
    caches = KVCacheBuilder.for_model(model, "h2o:budget=16,when=prompt_end")
    glob = [c for c in caches if c.window is None]
    prompt = mx.random.randint(0, VOCAB, (60,), key=mx.random.key(3))
    held, decoding = [], []

    def progress(done, total):
        held.append(max(c.n for c in glob))

    for turn in range(2):
        steps = generate_step(
            prompt, model, prompt_cache=caches, prefill_step_size=16, prompt_progress_callback=progress
        )
        for n, _ in enumerate(steps):
            decoding.append(max(c.n for c in glob))
            if n == 3:
                break
    G = glob[0].budget  # the default allocation (reach) gives the global layers the sliding layers' unused share
    assert G == (16 * 6 - 8 * 4) // 2 and all(c.budget == 8 for c in caches if c.window is not None)
    assert max(decoding) <= G + 1  # decode: budget + the new token
    assert max(held) == G + 1 + 59  # turn 2 holds its 59 prompt tokens before its last one (G + 1 slots of turn 1)


def test_prompt_end_answers_as_the_full_cache_while_the_prompt_fits():
    model = tiny_gemma3()
    prompt = mx.random.randint(0, VOCAB, (30,), key=mx.random.key(4))
    outs = []
    for method in (None, "cam:budget=64,when=prompt_end"):
        if method:
            attach(model, method)
        outs.append(
            [t for t, _ in zip((int(t) for t, _ in generate_step(prompt, model, prefill_step_size=8)), range(6))]
        )
        detach(model)
    assert outs[0] == outs[1]


def test_a_held_prompt_state_resumes_in_a_new_cache():
    K, V = random_kv(B=1, H=2, S=31)
    held = PolicyCache("h2o:signal=proxy,budget=8,when=prompt_end")
    feed(held, K[:, :, :30], V[:, :, :30], (10, 20))
    copy = PolicyCache.from_state(held.state, held.meta_state) if hasattr(PolicyCache, "from_state") else None
    assert copy is not None and copy.n == 30
    for c in (held, copy):
        c.update_and_fetch(K[:, :, 30:31], V[:, :, 30:31])
    for a, b in zip(retained(held), retained(copy)):
        np.testing.assert_array_equal(a, b)


def test_when_is_validated_with_the_field_named():
    with pytest.raises(ConfigError, match="when"):
        parse_config("h2o:when=later")


# ---------------------------------------------------------------- how many
class ChunkSelector(LowestScoreSelector):
    """Evicts whole chunks of 4 slots (a test selector)."""

    def evict_count(self, over, n):
        return min(-(-over // 4) * 4, n - 1)


class BadCount(LowestScoreSelector):
    def evict_count(self, over, n):
        return over - 1


def _with_selector(selector):
    from kvpolicy_core.config.policy import build_policy

    policy = build_policy("h2o:signal=proxy,budget=10,recent=2")
    return policy._replace(selector=selector)


def test_a_selector_may_evict_more_than_the_overflow():
    K, V = random_kv(B=1, H=2, S=30)
    cache = PolicyCache(_with_selector(ChunkSelector(n_sink=4, recent=2)))
    feed(cache, K, V, (12, 1, 1, 1))
    sizes = []
    for t in range(4):
        cache.update_and_fetch(*random_kv(B=1, H=2, S=1, seed=10 + t))
        sizes.append(cache.n)
    assert max(sizes) <= 11 and min(sizes) <= 8  # four slots leave at once; never over budget + 1
    cache.settle()
    assert cache.n <= 10


def test_an_evict_count_below_the_overflow_is_refused_naming_the_part():
    K, V = random_kv(B=1, H=2, S=20)
    cache = PolicyCache(_with_selector(BadCount(n_sink=4, recent=2)))
    with pytest.raises(PluginError, match="evict_count"):
        feed(cache, K, V, (12, 1))


# ---------------------------------------------------------------- how large: allocations
def test_pyramid_budgets_fall_with_depth_and_keep_the_mean():
    infos = [LayerInfo(i, 8, None) for i in range(8)]
    b = PyramidAllocation(beta=4).budgets(64, infos)
    assert b == sorted(b, reverse=True) and b[0] > 64 > b[-1] and sum(b) == 64 * 8
    assert PyramidAllocation(beta=1).budgets(64, infos) == [64] * 8


def test_reach_caps_sliding_layers_at_their_window_and_gives_the_rest_to_the_global_layers():
    """Gemma 3 270M's shape (18 layers, every sixth global, the others sliding over 512 tokens): at budget 1024 a
    sliding layer keeps its 512 reachable tokens and the 3 global layers share the rest, the same total."""
    gemma = [LayerInfo(i, 18, None if i % 6 == 5 else 512) for i in range(18)]
    b = ReachAllocation().budgets(1024, gemma)
    assert [b[i] for i in (0, 5)] == [512, 3584] and sum(b) == 18 * 1024
    assert ReachAllocation().budgets(512, gemma) == [512] * 18  # no window below the budget: uniform
    assert ReachAllocation().budgets(513, gemma)[5] == 518 and sum(ReachAllocation().budgets(513, gemma)) == 18 * 513
    plain = [LayerInfo(i, 4, None) for i in range(4)]
    assert ReachAllocation().budgets(100, plain) == UniformAllocation().budgets(100, plain)
    # windows of different sizes: the smallest capped first, the level shared by the rest; all capped: less in all
    assert ReachAllocation().budgets(1024, [LayerInfo(0, 2, 256), LayerInfo(1, 2, 4096)]) == [256, 1792]
    assert ReachAllocation().budgets(1000, [LayerInfo(0, 2, 256), LayerInfo(1, 2, 300)]) == [256, 300]


def test_a_sliding_layer_never_holds_more_than_its_window_and_the_global_layers_use_its_share():
    """Through mlx-lm's generate_step with the defaults (cut at the prompt's end): the sliding layers keep at most
    their window (+ the new token) while decoding, the global layers fill the larger budget reach gives them."""
    model = tiny_gemma3(window=8)
    caches = KVCacheBuilder.for_model(model, "h2o:budget=16")
    prompt = mx.random.randint(0, VOCAB, (80,), key=mx.random.key(4))
    for n, _ in enumerate(generate_step(prompt, model, prompt_cache=caches, prefill_step_size=32)):
        assert all(c.n <= 9 for c in caches if c.window is not None)
        if n == 3:
            break
    glob = [c for c in caches if c.window is None]
    assert all(c.budget == 32 and c.tokens_kept == 32 for c in glob)  # (6 * 16 - 4 * 8) / 2


def test_a_small_pyramid_budget_keeps_every_layer_its_floor():
    """budget 8 at beta 20 puts the last layers' pyramid below one token (8 / 20 = 0.4): they keep the least a
    layer may keep (before: the pyramid returned 0 and the builder refused the method, ending a leaderboard run)."""
    infos = [LayerInfo(i, 6, None) for i in range(6)]
    assert min(PyramidAllocation().budgets(8, infos)) == 1
    caches = KVCacheBuilder.for_model(tiny_gemma3(window=64), "h2o:budget=8,n_sink=2,allocation=pyramid")
    assert [c.budget for c in caches][-1] == 3 and all(c.budget >= 3 for c in caches)  # n_sink + 1


def test_the_builder_gives_each_layer_its_allocated_budget_from_a_config_string():
    model = tiny_gemma3()
    wide = KVCacheBuilder.for_model(tiny_gemma3(window=64), "h2o:budget=32,allocation=pyramid")  # windows not reached
    budgets = [c.budget for c in wide]
    assert budgets == sorted(budgets, reverse=True) and budgets[0] > 32 > budgets[-1]
    # windows of 8: the pyramid's sliding layers capped at 8, what that frees shared by the global layers
    capped = [c.budget for c in KVCacheBuilder.for_model(model, "h2o:budget=32,allocation=pyramid")]
    assert [capped[i] for i in (0, 1, 3, 4)] == [8] * 4 and capped[2] > capped[5] and sum(capped) == 6 * 32
    uniform = KVCacheBuilder.for_model(model, "h2o:budget=32,allocation=uniform")
    assert [c.budget for c in uniform] == [32] * len(uniform)
    reach = KVCacheBuilder.for_model(model, "h2o:budget=32")  # the default: windows of 8 on 4 of the 6 layers
    assert [c.budget for c in reach] == [8, 8, 80, 8, 8, 80]
    explicit = KVCacheBuilder.for_model(model, "h2o:budget=32", budgets=[40, 30, 20, 20, 30, 40])
    assert [c.budget for c in explicit] == [40, 30, 20, 20, 30, 40]


def test_an_unknown_allocation_is_refused_naming_the_field_and_the_known_ones():
    with pytest.raises(ConfigError, match=r"allocation: .*'nope'.*pyramid.*uniform"):
        layer_budgets("h2o:allocation=nope", [LayerInfo(0, 1, None)])


class _Broken:
    @classmethod
    def from_config(cls, config):
        return cls()

    def budgets(self, budget, layers):
        return [budget]  # one for every model: wrong length


class _BrokenPlugin:
    @hookimpl
    def register_allocations(self, register):
        register("broken_alloc", _Broken)


def test_an_allocation_returning_the_wrong_count_is_refused_naming_it():
    register_plugin(_BrokenPlugin(), "broken-alloc")
    try:
        with pytest.raises(PluginError, match="broken_alloc.*2 layers"):
            layer_budgets("h2o:allocation=broken_alloc", [LayerInfo(0, 2, None), LayerInfo(1, 2, None)])
    finally:
        unregister_plugin("broken-alloc")


def test_the_end_of_prompt_cut_protects_the_observation_window_not_the_decode_recent_window():
    """SnapKV's rule: the cut keeps the prompt's last W tokens (whose queries scored it) and the best-scored rest;
    decode steps after it protect the method's own recent window (budget // 2)."""
    from kvpolicy_core.config.policy import build_policy

    policy = build_policy("h2o:budget=64,when=prompt_end,obs_window=16")
    assert policy.cut_selector.recent == 16 and policy.selector.recent == 32
    assert build_policy("h2o:budget=64").cut_selector is None  # streaming: no cut of its own
    K, V = random_kv(B=1, H=2, S=201)
    cache = PolicyCache(policy)
    feed(cache, K[:, :, :200], V[:, :, :200], (100, 100))
    cache.update_and_fetch(K[:, :, 200:201], V[:, :, 200:201])
    pos = np.array(cache.retained()[2])
    assert (pos[..., -17:] == np.arange(184, 201)).all()  # the window and the new token
    assert (pos < 200 - 32).sum(axis=-1).min() > 64 - 4 - 32  # more than the decode rule would leave the rest
