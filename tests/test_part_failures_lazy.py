"""A part whose output only fails when MLX evaluates it is named, never an innocent part that consumes its output,
and never a raw MLX error: each part's output is evaluated on its own where values are checked (a prompt chunk's
eviction, the end-of-prompt cut, a cache's first decode evictions)."""

import mlx.core as mx
import pytest

from kvpolicy_cam import CamConfig
from kvpolicy_core import MethodSpec, PluginError, PolicyCache, PolicyConfig, hookimpl
from kvpolicy_core.parts.base import Selector
from kvpolicy_core.parts.lowest_score import LowestScoreSelector
from kvpolicy_core.plugin.discovery import register_plugin, unregister_plugin
from kvpolicy_core.testing.conformance import feed, random_kv


def fails_when_evaluated() -> mx.array:
    """A scalar whose graph raises only at evaluation (the inverse of a singular matrix, on the CPU)."""
    return mx.linalg.inv(mx.zeros((2, 2)), stream=mx.cpu).sum()


class LazyRank(Selector):
    """H2O's ranks, plus a term that fails at evaluation while ``broken``."""

    broken = True

    def rank(self, view):
        ranks = LowestScoreSelector().rank(view)
        return ranks + fails_when_evaluated() if LazyRank.broken else ranks


class LazyPlugin:
    @hookimpl
    def register_selectors(self, register):
        register("lazy_rank", LazyRank)

    @hookimpl
    def register_methods(self, register):
        register(MethodSpec("lazycam", CamConfig, "cumulative_attention", "lazy_rank", "gated_merge"))
        register(MethodSpec("lazydrop", PolicyConfig, "cumulative_attention", "lazy_rank", "drop"))


@pytest.fixture
def lazy():
    register_plugin(LazyPlugin(), "lazy")
    LazyRank.broken = True
    yield
    LazyRank.broken = True
    unregister_plugin("lazy")


@pytest.mark.parametrize("method", ["lazycam:merge=sim_weighted,gate=false", "lazydrop:seed=0"])
@pytest.mark.parametrize(
    "when, chunks",
    [
        ("stream", (10, 1)),  # a decode eviction (checked)
        ("stream", (10, 10)),  # a prompt chunk's eviction
        ("prompt_end", (20, 1)),  # the end-of-prompt cut
    ],
)
def test_a_selector_whose_ranks_fail_lazily_is_named_and_the_cache_rolled_back(lazy, method, when, chunks):
    keys, values = random_kv(S=40)
    cache = PolicyCache(f"{method},budget=8,n_sink=1,when={when}")
    head = chunks[0]
    feed(cache, keys[:, :, :head], values[:, :, :head], (head,))
    with pytest.raises(PluginError, match=r"selector 'lazy_rank' of plugin 'lazy' returned ranks that MLX cannot"):
        feed(cache, keys[:, :, head : head + chunks[1]], values[:, :, head : head + chunks[1]], chunks[1:])
    assert cache.offset == head  # rolled back
    LazyRank.broken = False
    feed(cache, keys[:, :, head:], values[:, :, head:], (1,) * (40 - head))  # and it keeps working
    mx.eval(cache.keys, cache.values)
    assert cache.offset == 40 and cache.n <= 9
