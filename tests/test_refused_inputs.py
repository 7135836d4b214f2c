"""Inputs that look almost valid are refused with a message naming the field (or the part) and what it accepts."""

import mlx.core as mx
import numpy as np
import pytest
from helpers import random_kv

from kvpolicy_core import (
    ConfigError,
    MethodSpec,
    PluginError,
    PolicyCache,
    PolicyConfig,
    Scorer,
    hookimpl,
    parse_config,
)
from kvpolicy_core.parts.base import MergeUpdate
from kvpolicy_core.plugin.discovery import register_plugin, unregister_plugin
from kvpolicy_core.testing.conformance import feed


# ----------------------------------------------------------------------------- CaM's similarity threshold
@pytest.mark.parametrize("value", ["2", "1.5", "-1.01", "-3"])
def test_min_sim_outside_the_cosine_range_is_refused(value):
    with pytest.raises(ConfigError, match=r"^cam_min_sim: .*\[-1, 1\].*merge=drop") as e:
        parse_config(f"cam:min_sim={value}")
    assert value in str(e.value)


@pytest.mark.parametrize("value", [-1.0, 0.0, 0.85, 1.0])
def test_min_sim_inside_the_cosine_range_is_accepted(value):
    assert parse_config({"method": "cam", "merge_min_sim": value}).policy.merge_min_sim == value


# ----------------------------------------------------------------------------- numbers in config strings
@pytest.mark.parametrize(
    "text, field",
    [
        ("h2o:budget=１６", "budget"),
        ("cam:min_sim=０.５", "min_sim"),
        ("h2o:budget=16,n_sink=٣", "n_sink"),
        ("h2o:head_dim=１２８", "head_dim"),
        ({"method": "h2o", "budget": "１６"}, "budget"),
    ],
)
def test_config_strings_accept_only_ascii_digits(text, field):
    with pytest.raises(ConfigError, match=rf"^(\w+_)?{field}: .*ASCII digits 0-9"):
        parse_config(text)


def test_ascii_numbers_in_config_strings_still_parse():
    config = parse_config("cam:budget=+16,n_sink=2,min_sim=-0.5,cap=1e1,head_dim=16")
    assert (config.policy.budget, config.policy.merge_min_sim, config.policy.merge_cap, config.head_dim) == (
        16,
        -0.5,
        10.0,
        16,
    )


# ----------------------------------------------------------------------------- head dim of the keys
@pytest.mark.parametrize("method", ["h2o:budget=8,signal=proxy", "cam:budget=8,signal=proxy", "random"])
@pytest.mark.parametrize("dims", [(0, 4), (4, 0), (0, 0)])
def test_a_zero_head_dim_is_refused_when_the_cache_sees_the_keys(method, dims):
    cache = PolicyCache(method)
    with pytest.raises(ValueError, match=r"^layer 0: .*head dim of at least 1.*\(1, 2, 3, 0\)"):
        cache.update_and_fetch(mx.zeros((1, 2, 3, dims[0])), mx.zeros((1, 2, 3, dims[1])))
    assert cache.offset == 0


def test_a_zero_head_dim_in_the_config_is_refused():
    with pytest.raises(ConfigError, match=r"^head_dim: .*greater than or equal to 1"):
        parse_config("h2o:head_dim=0")


# ----------------------------------------------------------------------------- part outputs that are not mx.array
class ForeignScorer(Scorer):
    """Returns its scores as ``ForeignScorer.kind`` (numpy, a list) of the right shape."""

    kind = "numpy"

    @classmethod
    def from_config(cls, config):
        return cls()

    def on_append(self, view, new_keys, new_positions):
        scores = np.zeros(view.scores.shape, np.float32)
        return scores if ForeignScorer.kind == "numpy" else scores.tolist()


class ForeignMerge:
    @classmethod
    def from_config(cls, config):
        return cls()

    def dispose(self, view, losers, key):
        B, H, E = losers.shape
        return MergeUpdate(mx.zeros((B, H, E), mx.int32), None, np.zeros((B, H, E, view.values.shape[-1])), None)


class ForeignPlugin:
    @hookimpl
    def register_scorers(self, register):
        register("foreign", ForeignScorer)

    @hookimpl
    def register_dispositions(self, register):
        register("foreign_merge", ForeignMerge)

    @hookimpl
    def register_methods(self, register):
        register(MethodSpec("foreign", PolicyConfig, "foreign", "lowest_score", "drop"))
        register(MethodSpec("foreignmerge", PolicyConfig, "cumulative_attention", "lowest_score", "foreign_merge"))


@pytest.fixture
def foreign_plugin():
    register_plugin(ForeignPlugin(), "foreign")
    yield
    unregister_plugin("foreign")


@pytest.mark.parametrize("kind, type_name", [("numpy", "numpy.ndarray"), ("list", "list")])
def test_a_scorer_returning_a_non_mlx_array_is_told_to_return_an_mx_array(foreign_plugin, kind, type_name):
    ForeignScorer.kind = kind
    keys, values = random_kv(S=3)
    with pytest.raises(
        PluginError,
        match=rf"scorer 'foreign' .* returned scores as a {type_name}, not an "
        r"mx\.array: it must return an mx\.array of shape \(2, 3, 3\)",
    ) as e:
        PolicyCache("foreign:budget=8,n_sink=1").update_and_fetch(keys, values)
    assert "shape (2, 3, 3), expected" not in str(e.value)


def test_a_disposition_returning_a_numpy_delta_is_told_to_return_an_mx_array(foreign_plugin):
    keys, values = random_kv(S=12)
    cache = PolicyCache("foreignmerge:budget=8,n_sink=1,recent=1")
    feed(cache, keys[:, :, :8], values[:, :, :8], (8,))
    with pytest.raises(PluginError, match=r"returned d_values as a numpy\.ndarray, not an mx\.array"):
        feed(cache, keys[:, :, 8:], values[:, :, 8:], (1,) * 4)
