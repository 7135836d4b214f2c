"""The cache's surface is explicit: counters through stats() and named properties, the method's config through
``cache.config``; no config field or counter becomes an attribute of the cache (mlx-lm reads attributes such as
``bits`` to decide how to attend)."""

import mlx.core as mx
import pytest
from pydantic import Field

from kvpolicy_core import KVCacheBuilder, MethodSpec, PolicyCache, hookimpl, parse_config
from kvpolicy_core.config.attention_config import AttentionPolicyConfig
from kvpolicy_core.plugin.discovery import register_plugin, unregister_plugin


class QuantishConfig(AttentionPolicyConfig):
    """A plugin config with fields named like mlx-lm's quantized-cache attributes."""

    bits: int = Field(4, description="bits a quantizing policy would use")
    group_size: int = Field(64, description="quantization group")


class QuantishPlugin:
    @hookimpl
    def register_methods(self, register):
        register(MethodSpec("quantish", QuantishConfig, "cumulative_attention", "lowest_score", "drop"))


@pytest.fixture
def quantish():
    register_plugin(QuantishPlugin(), "quantish")
    yield
    unregister_plugin("quantish")


def test_a_config_field_named_bits_is_not_a_cache_attribute(quantish, llama_model, tokens):
    caches = KVCacheBuilder.for_model(llama_model, parse_config("quantish:budget=8,n_sink=2"))
    assert not hasattr(caches[0], "bits") and not hasattr(caches[0], "group_size")
    assert caches[0].config.bits == 4
    logits = llama_model(tokens[:1, :20], cache=caches)  # mlx-lm takes its unquantized path: no crash
    mx.eval(logits)
    assert logits.shape[1] == 20 and bool(mx.isfinite(logits).all())
    with pytest.raises(AttributeError, match="cache.config.bits"):
        caches[0].bits


def test_counters_and_the_specifications_names_are_properties(llama_model, tokens):
    caches = KVCacheBuilder.for_model(llama_model, parse_config("cam:budget=8,n_sink=2,merge=mean,gate=false"))
    for t in range(24):
        llama_model(tokens[:1, t % 40 : t % 40 + 1], cache=caches)
    c = caches[0]
    assert (c.merge_mode, c.merge_gate, c.n_sink) == ("mean", False, 2)
    assert c.merges == c.stats()["merges"] > 0 and c.gate_draws == c.stats().get("gate_draws", 0)
    assert c.config.budget == 8 and c.budget == 8
    with pytest.raises(AttributeError, match=r"cache.stats\(\)\['merges'\]|cache.config"):
        c.merge_min_sim  # a config field: cache.config.merge_min_sim


def test_a_method_without_merges_reports_drop_and_zero():
    c = PolicyCache(parse_config("h2o:budget=8"))
    assert (c.merge_mode, c.merge_gate, c.merges, c.gate_draws) == ("drop", False, 0, 0)
    assert not hasattr(c, "signal") and c.config.signal == "observed"
