"""A selector's ``evict_count`` anywhere in its documented range ``[over, n - 1]`` never evicts a sink: the cache
clamps the count to ``n - n_sink``."""

import numpy as np
import pytest

from kvpolicy_core import MethodSpec, PolicyCache, PolicyConfig, hookimpl
from kvpolicy_core.parts.lowest_score import LowestScoreSelector
from kvpolicy_core.plugin.discovery import register_plugin, unregister_plugin
from kvpolicy_core.testing.conformance import feed, random_kv


class GreedyCount(LowestScoreSelector):
    """Evicts as many slots as the documented range allows: ``n - 1``."""

    def evict_count(self, over, n):
        return n - 1


class GreedyPlugin:
    @hookimpl
    def register_selectors(self, register):
        register("greedy_count", GreedyCount)

    @hookimpl
    def register_methods(self, register):
        register(MethodSpec("greedy", PolicyConfig, "cumulative_attention", "greedy_count", "drop"))


@pytest.fixture
def greedy():
    register_plugin(GreedyPlugin(), "greedy")
    yield
    unregister_plugin("greedy")


@pytest.mark.parametrize("when, chunks", [("stream", (1,) * 30), ("stream", (12, 9, 9)), ("prompt_end", (20, 1, 1))])
@pytest.mark.parametrize("n_sink", [1, 3])
def test_an_evict_count_of_n_minus_1_keeps_every_sink(greedy, when, chunks, n_sink):
    keys, values = random_kv(S=sum(chunks))
    cache = PolicyCache(f"greedy:budget=8,n_sink={n_sink},when={when}")
    feed(cache, keys, values, chunks)
    positions = np.array(cache.retained()[2])
    for p in positions.reshape(-1, positions.shape[-1]):
        assert set(range(n_sink)) <= set(p.tolist())  # every sink, in every row and head
    assert cache.n <= 8
