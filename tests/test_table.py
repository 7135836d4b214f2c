"""The rest of the original library's table (kvpolicy-table: snapkv, pyramidkv, chunkkv, squeeze): the equivalences are
not vacuous, and each method's own behaviour. Registration, conformance and the equivalences themselves are the
distribution's own tests (examples/kvpolicy-table/tests)."""

import mlx.core as mx
import numpy as np
import pytest
from helpers import feed, random_kv

from kvpolicy_core import KVCacheBuilder, PolicyCache
from kvpolicy_core.testing.equivalence import assert_equivalent
from kvpolicy_core.testing.tiny_models import tiny_llama

TABLE = ["snapkv", "pyramidkv", "chunkkv", "squeeze"]


def test_the_equivalences_are_not_vacuous():
    for a in ("chunkkv:budget=12,n_sink=2,chunk_size=4", "pyramidkv:budget=12,n_sink=2", "snapkv:budget=12,n_sink=2"):
        with pytest.raises(AssertionError):
            assert_equivalent(a, "h2o:budget=12,n_sink=2")
    with pytest.raises(AssertionError):
        assert_equivalent("squeeze:budget=12,n_sink=2,strength=1", "h2o:budget=12,n_sink=2,when=prompt_end")


def test_chunkkv_keeps_or_evicts_whole_chunks():
    K, V = random_kv(B=2, H=3, S=221)
    cache = PolicyCache("chunkkv:budget=80,n_sink=4,chunk_size=10,signal=proxy")
    feed(cache, K, V, (200,) + (1,) * 21)
    cache.settle()
    pos = np.array(cache.retained()[2])
    assert pos.shape[-1] <= 80
    for row in pos.reshape(-1, pos.shape[-1]):
        chunks, counts = np.unique(row[row < 210] // 10, return_counts=True)
        assert (counts == 10).all(), dict(zip(chunks, counts))  # every chunk before the newest is whole


def test_pyramidkv_budgets_fall_with_depth_and_keep_the_mean():
    model = tiny_llama(layers=4, seed=1)
    budgets = [c.budget for c in KVCacheBuilder.for_model(model, "pyramidkv:budget=32,n_sink=2,pyramid_beta=4")]
    assert budgets == sorted(budgets, reverse=True) and budgets[0] > 32 > budgets[-1] and sum(budgets) == 4 * 32


def test_snapkv_holds_the_prompt_and_cuts_it_at_its_end():
    model = tiny_llama(layers=2, seed=1)
    caches = KVCacheBuilder.for_model(model, "snapkv:budget=16,n_sink=2")
    model(mx.arange(40)[None], cache=caches)
    assert all(c.n == 40 for c in caches)
    model(mx.array([[7]]), cache=caches)
    assert all(c.n == 17 and c.tokens_kept == 16 for c in caches)


def test_squeeze_sets_each_layers_budget_from_the_prompt_at_its_end_keeping_the_mean():
    """Uniform until the prompt ends; then budgets from the layers' measured attention change (one host sync),
    the mean kept; the next turn is measured again."""
    from mlx_lm.generate import generate_step

    model = tiny_llama(layers=4, seed=1)
    caches = KVCacheBuilder.for_model(model, "squeeze:budget=16,n_sink=2,strength=1")
    assert [c.budget for c in caches] == [16] * 4
    for _ in zip(generate_step(mx.arange(60), model, prompt_cache=caches, prefill_step_size=16), range(3)):
        pass
    budgets = [c.budget for c in caches]
    assert len(set(budgets)) > 1 and abs(sum(budgets) / 4 - 16) <= 1
    assert all(c.n <= c.budget + 1 for c in caches)
    calm = KVCacheBuilder.for_model(model, "squeeze:budget=16,n_sink=2,strength=0.5")
    for _ in zip(generate_step(mx.arange(60), model, prompt_cache=calm, prefill_step_size=16), range(3)):
        pass
    spread = lambda bs: max(bs) - min(bs)  # noqa: E731
    assert spread([c.budget for c in calm]) < spread(budgets)  # strength moves the budgets from uniform


def test_squeeze_streaming_is_refused_naming_allocation_and_when():
    from kvpolicy_core import ConfigError

    with pytest.raises(ConfigError, match=r"allocation: .*squeeze.*when='prompt_end'"):
        KVCacheBuilder.for_model(tiny_llama(layers=2, seed=1), "squeeze:budget=16,when=stream")
