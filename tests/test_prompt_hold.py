"""What a cache holds while a prompt streams in, and what it reports: the end-of-prompt cut's ``hold``, sliding-window
layers bounded by their window in every schedule, chunked perplexity that evicts, and ``tokens_kept`` as the truth."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest
from helpers import feed, random_kv, tiny_gemma3, tiny_llama
from mlx_lm.generate import generate_step

from kvpolicy_core import KVCacheBuilder
from kvpolicy_core.cache.policy_cache import PolicyCache
from kvpolicy_core.errors import ConfigError
from kvpolicy_core.eval.perplexity import perplexity
from kvpolicy_core.integration.builder import detach


@pytest.mark.parametrize("method", ["h2o", "cam"])
def test_chunked_perplexity_evicts_under_the_end_of_prompt_cut(method):
    """``eval --chunk 16`` with the default schedule (cut at the prompt's end) must evict: each chunk is a short
    prompt cut at its end. It used to hold every chunk and report the full cache's perplexity exactly."""
    model = tiny_llama(seed=3)
    ids = mx.random.randint(0, 97, (96,), key=mx.random.key(5)).tolist()
    try:
        full = perplexity(model, ids, "full", chunk=16, progress=False)
        cut = perplexity(model, ids, f"{method}:budget=16", chunk=16, progress=False)
    finally:
        detach(model)
    assert cut["perplexity"] != full["perplexity"]
    per_token = full["kv_bytes_full"] / 95  # the last token is never fed
    assert cut["kv_bytes_kept"] == pytest.approx(16 * per_token, rel=0.01)  # the budget on every layer


def test_tokens_kept_counts_a_held_prompt_whole_until_its_cut():
    """A loop of multi-token updates is prompt: held until a one-token step (or settle) cuts it, and counted as held."""
    cache = PolicyCache("h2o:budget=8,n_sink=2,signal=proxy")
    K, V = random_kv(S=40)
    feed(cache, K, V, (10, 10, 10, 10))
    assert cache.n == 40 and cache.tokens_kept == 40 and cache.kept_bytes == cache.full_seq_bytes
    cache.settle()
    assert cache.n == cache.tokens_kept == 8


@pytest.mark.parametrize("hold", [1, 1.5, 3])
def test_a_hold_bounds_the_held_prompt_and_the_cut_still_lands_on_the_budget(hold):
    budget, S = 8, 6
    cache = PolicyCache(f"h2o:budget={budget},n_sink=2,signal=proxy,hold={hold}")
    K, V = random_kv(S=61)
    bound = max(math.ceil(hold * budget), budget + S)
    for t in range(0, 60, S):
        feed(cache, K[:, :, t : t + S], V[:, :, t : t + S], (S,))
        assert cache.n <= bound and cache.tokens_kept == cache.n
    feed(cache, K[:, :, 60:], V[:, :, 60:], (1,))  # the first decode step cuts
    assert cache.tokens_kept == budget and cache.offset == 61
    pos = np.array(cache.retained()[2])
    assert (pos[..., :2] == [0, 1]).all()  # sinks kept through the streaming part of the prompt


def test_a_hold_above_the_prompt_changes_nothing():
    K, V = random_kv(S=41)
    held = [PolicyCache(f"h2o:budget=8,signal=proxy{h}") for h in ("", ",hold=6")]
    for c in held:
        feed(c, K, V, (10, 10, 10, 10, 1))
    for a, b in zip(held[0].state[:4], held[1].state[:4]):
        assert mx.array_equal(a, b)


@pytest.mark.parametrize("bad", ["0.5", "0", "-2", "inf"])
def test_a_hold_below_the_budget_is_refused_naming_the_field(bad):
    with pytest.raises(ConfigError, match="hold"):
        PolicyCache(f"h2o:budget=8,hold={bad}")


@pytest.mark.parametrize("when", ["prompt_end", "stream"])
def test_a_sliding_window_layer_holds_at_most_its_window_through_a_prompt(when):
    """Gemma-shaped: a sliding layer (window 8) never holds more than ``w - 1 + S`` slots during the prompt (as
    mlx-lm's RotatingKVCache), in every schedule, and the logits stay those of mlx-lm's own caches while the budget
    is above what each layer can use (every layer's reach)."""
    window, chunk = 8, 6
    model = tiny_gemma3(window=window, seed=1)
    prompt = mx.random.randint(0, 97, (61,), key=mx.random.key(2))
    try:
        caches = KVCacheBuilder.for_model(model, f"h2o:budget=64,when={when}")
        sliding = [c for c in caches if c.window is not None]
        assert sliding, "the tiny Gemma 3 has sliding-window layers"
        most = []

        def after_chunk(done, total):
            most.append(max(c.n for c in sliding))

        got = [
            logits
            for (_, logits), _ in zip(
                generate_step(
                    prompt, model, prompt_cache=caches, prefill_step_size=chunk, prompt_progress_callback=after_chunk
                ),
                range(6),
            )
        ]
        native = model.make_cache()
        want = [logits for (_, logits), _ in zip(generate_step(prompt, model, prompt_cache=native), range(6))]
    finally:
        detach(model)
    assert max(most) <= window - 1 + chunk
    for a, b in zip(got, want):
        np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-4, atol=1e-4)


def test_layers_holding_different_numbers_of_slots_each_get_their_own_causal_mask(monkeypatch):
    """mlx-lm builds one array mask from the first cache of a kind (Gemma 3's sliding layers ask for one); layers
    with other budgets (a compress-once file, an allocation) hold other numbers of slots. A question of several
    tokens then crashed with a broadcast error; each layer must attend causally over its own slots."""
    import copy

    model = tiny_gemma3(window=64, seed=2)
    tokens = mx.random.randint(0, 97, (1, 33), key=mx.random.key(4))
    try:
        caches = KVCacheBuilder.for_model(model, "cam:budget=8,n_sink=2", budgets=[8, 5, 9, 6, 7, 10])
        model(tokens[:, :30], cache=caches)
        for c in caches:
            c.settle()
        assert len({c.n for c in caches}) > 1
        reference = copy.deepcopy(caches)
        got = model(tokens[:, 30:], cache=caches)
        monkeypatch.setattr(PolicyCache, "make_mask", lambda self, N, **_: "causal")  # every layer: its own slots
        want = model(tokens[:, 30:], cache=reference)
    finally:
        detach(model)
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5, atol=1e-5)
