"""The ``hybrid`` allocation: on a model with sliding-window and global layers the global layers get what the
sliding layers give up, the total holds, a model without sliding layers is unchanged bit for bit, and a fact
stated beyond the window survives at 8x where ``reach`` loses it."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from helpers import VOCAB, tiny_gemma3

from kvpolicy_core import KVCacheBuilder, MethodSpec, PolicyConfig
from kvpolicy_core.config.policy import layer_budgets
from kvpolicy_core.parts.allocation import LayerInfo, ReachAllocation, UniformAllocation
from kvpolicy_core.parts.base import Needs, Scorer
from kvpolicy_core.parts.hybrid_allocation import DEFAULT_SLIDE_SHARE, HybridAllocation
from kvpolicy_core.plugin.discovery import register_plugin, unregister_plugin
from kvpolicy_core.plugin.hookspecs import hookimpl
from kvpolicy_core.testing.tiny_models import tiny_llama

GEMMA3_270M = [LayerInfo(i, 18, None if i % 6 == 5 else 512) for i in range(18)]  # 15 sliding of 512, 3 global


def test_the_global_layers_get_what_the_sliding_layers_give_up():
    b = HybridAllocation(0.5).budgets(187, GEMMA3_270M)
    assert [b[i] for i in range(18) if i % 6 != 5] == [94] * 15  # round(0.5 * 187)
    assert [b[i] for i in range(18) if i % 6 == 5] == [652] * 3  # 187 + 15 * (187 - 94) / 3
    assert ReachAllocation().budgets(187, GEMMA3_270M) == [187] * 18  # the old rule: nothing moves below the window
    # at a budget of w / s or more a sliding layer keeps its whole window, as under reach
    assert HybridAllocation(0.5).budgets(1024, GEMMA3_270M) == ReachAllocation().budgets(1024, GEMMA3_270M)


@pytest.mark.parametrize("share", [0.1, 0.25, DEFAULT_SLIDE_SHARE, 0.8, 1.0])
@pytest.mark.parametrize("budget", [9, 64, 100, 187, 511, 513, 2000])
def test_the_total_is_n_times_the_budget_and_no_global_layer_gets_less(share, budget):
    layers = [LayerInfo(i, 7, [None, 64, 512, None, 512, 512, 64][i]) for i in range(7)]
    b = HybridAllocation(share, floor=5).budgets(budget, layers)
    assert sum(b) == 7 * budget
    assert all(isinstance(x, int) and x >= 1 for x in b)
    assert min(b[0], b[3]) >= budget and abs(b[0] - b[3]) <= 1  # the global layers share the rest evenly
    for i in (1, 2, 4, 5, 6):
        assert b[i] == min(layers[i].window, max(5, round(share * budget)))


def test_through_the_config_the_layers_of_a_tiny_sliding_window_model_get_the_rule():
    model = tiny_gemma3(window=64)  # 6 layers, every third global
    reach = [c.budget for c in KVCacheBuilder.for_model(model, "h2o:budget=32")]
    hybrid = [c.budget for c in KVCacheBuilder.for_model(model, "h2o:budget=32,when=stream,allocation=hybrid")]
    assert reach == [32] * 6
    assert hybrid == [16, 16, 64, 16, 16, 64] and sum(hybrid) == sum(reach)
    # under the end-of-prompt cut (the default schedule): reach's budgets until a prompt is cut, then the rule's
    caches = KVCacheBuilder.for_model(model, "h2o:budget=32,allocation=hybrid")
    assert [c.budget for c in caches] == reach
    tokens = mx.array(np.random.default_rng(2).integers(0, VOCAB, size=(1, 100)))
    model(tokens[:, :-1], cache=caches)
    model(tokens[:, -1:], cache=caches)
    assert [c.budget for c in caches] == hybrid
    # the builder raises no budget: the floor (n_sink + recent + 1) is inside the rule, so the total holds
    layers = [LayerInfo(i, 6, 64 if i % 3 != 2 else None) for i in range(6)]
    assert layer_budgets("h2o:budget=32,recent=12,when=stream,allocation=hybrid", layers) == [17, 17, 62, 17, 17, 62]


def test_a_model_without_sliding_layers_is_unchanged_bit_for_bit():
    layers = [LayerInfo(i, 30, None) for i in range(30)]
    for budget in (8, 100, 187, 4096):
        assert HybridAllocation().budgets(budget, layers) == UniformAllocation().budgets(budget, layers)
    model = tiny_llama(layers=3)
    tokens = mx.array(np.random.default_rng(0).integers(0, VOCAB, size=(1, 96)))
    logits = {}
    for spec in ("h2o:budget=24", "h2o:budget=24,allocation=hybrid"):
        caches = KVCacheBuilder.for_model(model, spec)
        assert [c.budget for c in caches] == [24] * 3
        out = [model(tokens[:, i : i + 8], cache=caches) for i in range(0, 96, 8)]
        logits[spec] = np.array(mx.concatenate(out, axis=1))
    a, b = logits.values()
    assert np.array_equal(a, b)


def test_every_layer_sliding_falls_back_to_reach():
    layers = [LayerInfo(i, 4, 64) for i in range(4)]
    assert HybridAllocation().budgets(200, layers) == ReachAllocation().budgets(200, layers) == [64] * 4


@pytest.mark.parametrize("share", [0, -0.5, 1.5, "half", True])
def test_a_bad_share_is_refused_naming_the_field(share):
    with pytest.raises(ValueError, match="slide_share"):
        HybridAllocation(share)


# -- a fact stated beyond the window, at 8x -----------------------------------------------------------------------

FACT = range(200, 280)  # 80 positions, far beyond a 128-token window from the prompt's end


class _FactScorer(Scorer):
    """Scores the fact's positions 1, every other token 0: the scorer any method would be at its best."""

    needs = Needs(batch_rows=True, trim_exact=True)

    def on_append(self, view, new_keys, new_positions):
        p = view.positions
        fact = ((p >= FACT.start) & (p < FACT.stop)).astype(mx.float32)
        return mx.where(p >= new_positions[..., :1], fact, view.scores)


class _FactPlugin:
    @hookimpl
    def register_scorers(self, register):
        register("fact_oracle", _FactScorer)

    @hookimpl
    def register_methods(self, register):
        register(MethodSpec("fact_oracle", PolicyConfig, "fact_oracle", "lowest_score", "drop"))


@pytest.fixture
def fact_method():
    register_plugin(_FactPlugin(), "fact-oracle")
    try:
        yield "fact_oracle"
    finally:
        unregister_plugin("fact-oracle")


def _fact_kept(model, spec, prompt):
    """Per layer: whether every fact position is still in the layer's cache after the prompt and one step."""
    caches = KVCacheBuilder.for_model(model, spec)
    model(prompt[:, :-1], cache=caches)
    model(prompt[:, -1:], cache=caches)  # the first decode step
    kept = []
    for c in caches:
        pos = np.array(c.retained()[2])[0, 0]
        kept.append(set(FACT) <= set(pos.tolist()))
    return kept, [c.window for c in caches]


def test_a_fact_beyond_the_window_survives_at_8x_where_reach_loses_it(fact_method):
    """A 1024-token prompt at 8x (budget 128) on a model whose sliding layers see 128 tokens: a sliding layer cannot
    attend the fact at decode whatever it keeps, so only a global layer can carry it. The budget is not above the
    window, so ``reach`` moves nothing: a global layer keeps 128 (4 sinks, 64 recent: room for 60 of the fact's
    80 tokens); under ``hybrid`` 256 (the sliding layers 64 each), and the fact stays whole."""
    model = tiny_gemma3(window=128)
    prompt = mx.array(np.random.default_rng(1).integers(0, VOCAB, size=(1, 1025)))
    for when in ("stream", "prompt_end"):
        old, windows = _fact_kept(model, f"{fact_method}:budget=128,when={when}", prompt)
        new, _ = _fact_kept(model, f"{fact_method}:budget=128,when={when},allocation=hybrid", prompt)
        glob = [i for i, w in enumerate(windows) if w is None]
        assert glob == [2, 5]
        assert not any(old[i] for i in glob), when  # the old rule loses it in every layer that could carry it
        assert all(new[i] for i in glob), when


# -- the conformance kit checks an allocation's total on a hybrid model ---------------------------------------------


def test_the_hybrid_allocation_passes_the_conformance_kit():
    from kvpolicy_core.testing.conformance import run_conformance

    assert "test_allocation_holds_its_total_on_a_hybrid_model" in run_conformance(
        "h2o:budget=16,n_sink=2,allocation=hybrid"
    )


class _Greedy(ReachAllocation):
    """Gives the global layers the window's spare tokens and keeps the sliding layers' too: more than the total."""

    def budgets(self, budget, layers, stats=None):
        return [budget if info.window is not None else 4 * budget for info in layers]


class _GreedyPlugin:
    @hookimpl
    def register_allocations(self, register):
        register("greedy_alloc", _Greedy)


def test_the_conformance_kit_refuses_an_allocation_over_its_total_on_a_hybrid_model():
    from kvpolicy_core.testing.conformance import PolicyConformance

    register_plugin(_GreedyPlugin(), "greedy-alloc")
    try:
        kit = PolicyConformance()
        kit.method = "h2o:budget=16,n_sink=2,allocation=greedy_alloc"
        with pytest.raises(AssertionError, match="greedy_alloc.*on a hybrid model"):
            kit.test_allocation_holds_its_total_on_a_hybrid_model()
        kit.test_each_layer_gets_its_allocated_budget_and_keeps_it()  # the global-only check cannot see it
    finally:
        unregister_plugin("greedy-alloc")


def test_pyramidkv_takes_hybrid_budgets_when_asked_and_explicit_budgets_override_them():
    """The allocation field takes one name: ``pyramidkv:allocation=hybrid`` gets the hybrid split
    (docs/configuration.md); explicit ``budgets=`` win over any allocation."""
    model = tiny_gemma3(window=64)
    want = [16, 16, 64, 16, 16, 64]
    assert [
        c.budget for c in KVCacheBuilder.for_model(model, "pyramidkv:budget=32,when=stream,allocation=hybrid")
    ] == want
    assert [c.budget for c in KVCacheBuilder.for_model(model, "h2o:budget=32,allocation=hybrid", budgets=[20] * 6)] == [
        20
    ] * 6


# -- under the end-of-prompt cut the hybrid budgets are taken at the cut ------------------------------------------


def test_at_the_cut_hybrid_is_its_static_budgets_and_without_a_prompt_it_is_reach():
    """Under ``when="prompt_end"``: a prompt then decode steps give bit for bit the logits of caches built with the
    hybrid budgets from the start; decode-only streaming (perplexity token by token: no prompt is ever cut) gives
    bit for bit ``reach``'s, whose sliding layers keep the local context their quality needs."""
    from mlx_lm.generate import generate_step

    from kvpolicy_core.config.parse import parse_config
    from kvpolicy_core.eval.perplexity import perplexity
    from kvpolicy_core.integration.builder import detach, layer_infos
    from kvpolicy_core.parts.hybrid_allocation import HybridAllocation

    model = tiny_gemma3(window=32)
    prompt = mx.array(np.random.default_rng(3).integers(0, VOCAB, size=(200,)))
    spec = "h2o:budget=24,n_sink=2"
    try:
        config = parse_config(spec)
        windows = [c.window for c in KVCacheBuilder.for_model(model, spec)]
        static = HybridAllocation.from_config(parse_config(spec + ",when=stream").policy).budgets(
            24, layer_infos(model, windows)
        )
        runs = []
        for caches in (
            KVCacheBuilder.for_model(model, spec + ",allocation=hybrid"),
            KVCacheBuilder.for_model(model, config, budgets=static),
        ):
            runs.append([lg for (_, lg), _ in zip(generate_step(prompt, model, prompt_cache=caches), range(5))])
            assert [c.budget for c in caches] == static
        for a, b in zip(*runs):
            assert mx.array_equal(a, b)
        ids = prompt.tolist()[:120]
        hybrid = perplexity(model, ids, spec + ",allocation=hybrid", progress=False)
        reach = perplexity(model, ids, spec, progress=False)
    finally:
        detach(model)
    assert np.array_equal(hybrid["nll"], reach["nll"])
