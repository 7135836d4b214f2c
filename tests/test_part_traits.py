"""Engine traits are not inherited silently past an override of the method they vouch for, and ranks and scores
at NaN and +-inf are chosen as the docs say."""

import math

import mlx.core as mx
import numpy as np
import pytest

from kvpolicy_core import MethodSpec, PolicyCache, PolicyConfig, hookimpl
from kvpolicy_core.parts.base import Selector
from kvpolicy_core.parts.cumulative_attention import CumulativeAttentionScorer
from kvpolicy_core.parts.lowest_score import LowestScoreSelector
from kvpolicy_core.parts.traits import traits, traits_of
from kvpolicy_core.plugin.discovery import register_plugin, unregister_plugin
from kvpolicy_core.testing.conformance import feed, random_kv


class CountingSelector(LowestScoreSelector):
    """A stateful subclass of core's (compiled) selector: its rank counts its calls in Python."""

    def __init__(self, n_sink=4, recent=0):
        super().__init__(n_sink, recent)
        self.calls = 0

    def rank(self, view):
        self.calls += 1
        return super().rank(view)


@traits(compile_decode=True)
class DeclaredAgain(CountingSelector):
    """The same, declaring the trait itself: compiled, as it asked."""


class KeepsRank(LowestScoreSelector):
    """A subclass that changes nothing the compiled graph runs: it keeps the trait."""

    def __init__(self, n_sink=4, recent=0):
        super().__init__(n_sink, recent)


class NanRank(Selector):
    """Ranks by position (oldest first), but position 5 is NaN and position 6 is -inf."""

    def rank(self, view):
        r = view.positions.astype(mx.float32)
        return mx.where(view.positions == 6, -math.inf, mx.where(view.positions == 5, math.nan, r))


class InfScores(CumulativeAttentionScorer):
    """H2O's scores, but position 7 scores -inf and position 8 +inf."""

    @classmethod
    def from_config(cls, config):
        return cls("proxy")

    def on_append(self, view, new_keys, new_positions):
        s = super().on_append(view, new_keys, new_positions)
        return mx.where(view.positions == 7, -math.inf, mx.where(view.positions == 8, math.inf, s))


class Plugin:
    @hookimpl
    def register_selectors(self, register):
        register("counting", CountingSelector)
        register("nan_rank", NanRank)

    @hookimpl
    def register_scorers(self, register):
        register("inf_scores", InfScores)

    @hookimpl
    def register_methods(self, register):
        register(MethodSpec("counting", PolicyConfig, "cumulative_attention", "counting", "drop"))
        register(MethodSpec("nanrank", PolicyConfig, "cumulative_attention", "nan_rank", "drop"))
        register(MethodSpec("infscores", PolicyConfig, "inf_scores", "lowest_score", "drop"))


@pytest.fixture
def plugin():
    register_plugin(Plugin(), "traitsplugin")
    yield
    unregister_plugin("traitsplugin")


def test_a_subclass_overriding_rank_does_not_inherit_compile_decode():
    assert traits_of(LowestScoreSelector()).compile_decode
    assert not traits_of(CountingSelector()).compile_decode
    assert traits_of(DeclaredAgain()).compile_decode and traits_of(KeepsRank()).compile_decode


def test_a_stateful_subclass_of_a_compiled_selector_is_called_at_every_eviction(plugin):
    cache = PolicyCache("counting:budget=8,n_sink=1,when=stream")
    keys, values = random_kv(S=21)
    feed(cache, keys, values, (8,) + (1,) * 13)  # the 9th token fills the budget's extra slot; then 12 evictions
    assert cache.policy.selector.calls == 12


def ranks_kept(method):
    cache = PolicyCache(f"{method}:budget=8,n_sink=1,recent=0,when=stream")
    keys, values = random_kv(S=12)
    feed(cache, keys, values, (9, 1, 1, 1))  # four decode evictions
    return sorted(np.array(cache.retained()[2])[0, 0].tolist())


def test_a_nan_rank_is_protected_and_a_minus_inf_rank_goes_first(plugin):
    """Position 6 (-inf) leaves at the first eviction; position 5 (NaN) stays; then the oldest (1, 2, 3)."""
    assert ranks_kept("nanrank") == [0, 4, 5, 7, 8, 9, 10, 11]


def test_a_minus_inf_score_is_the_lowest_and_a_plus_inf_score_the_highest(plugin):
    """Scores: -inf reads as float32's lowest (evicted first), +inf as its max (kept)."""
    kept = ranks_kept("infscores")
    assert 7 not in kept and 8 in kept


def test_the_hooks_page_says_what_nan_and_inf_ranks_and_scores_become():
    from pathlib import Path

    text = " ".join((Path(__file__).parents[1] / "docs" / "plugins" / "hooks.md").read_text().split())
    assert "NaN reads as 0, `+inf` as float32's max, `-inf` as its lowest" in text
    assert "overrides `rank` or `dispose` does not inherit `compile_decode`" in text
