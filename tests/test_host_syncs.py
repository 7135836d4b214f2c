"""No host sync on a steady-state decode step of any shipped method, through mlx-lm's own generation loops.

On Apple GPUs every host sync drains the pipeline, and a sync in the cache happens once per layer per
token. :class:`host_syncs.HostSyncs` counts every evaluation and read-back made while kvpolicy code is on
the stack; the prompt and the first decode steps (whose score updates and disposition updates are evaluated on
purpose, inside the transaction) are skipped. No part is trusted: a plugin's parts run the same way.
"""

import mlx.core as mx
import numpy as np
import pytest
from helpers import QUERY_AGNOSTIC_PAIRS, SHIPPED_METHODS, feed, random_kv, tiny_gemma3, tiny_llama, with_fields
from host_syncs import HostSyncs
from mlx_lm.generate import BatchGenerator, generate_step
from mlx_lm.models.cache import KVCache

from kvpolicy_cam.config import CamConfig
from kvpolicy_cam.mass_merge import MassMergeDisposition
from kvpolicy_core import KVCacheBuilder, MethodSpec, PluginError, PolicyCache, attach, detach, hookimpl
from kvpolicy_core.cache.step import CHECKED_DECODE_EVICTIONS, PolicyStep
from kvpolicy_core.parts.base import Disposition
from kvpolicy_core.plugin.discovery import register_plugin, unregister_plugin

PACKAGES = ["kvpolicy_core", "kvpolicy_h2o", "kvpolicy_cam"]
FIELDS = "budget=8,n_sink=2"  # prompts of 20-24 tokens: every decode step evicts
WARM, STEPS = 6, 8  # decode steps skipped, then counted


@pytest.fixture(scope="module", params=["llama", "gemma3"])  # gemma3: sliding-window layers (window-dead slots)
def model(request):
    m = tiny_llama(layers=4, seed=1) if request.param == "llama" else tiny_gemma3(window=6, seed=2)
    yield m
    detach(m)


def single_syncs(model, caches, packages=PACKAGES):
    """Host syncs per decode step of ``generate_step`` over STEPS steps after WARM (a list, one count per step)."""
    prompt = mx.random.randint(0, 97, (24,), key=mx.random.key(3))
    per_step = []
    with HostSyncs(packages) as syncs:
        for i, _ in enumerate(generate_step(prompt, model, max_tokens=WARM + STEPS + 1, prompt_cache=caches)):
            if i >= WARM:
                per_step.append(len(syncs.calls))
            syncs.reset()
    return per_step[:STEPS]


def batch_syncs(model, config):
    """Host syncs per decode step of mlx-lm's BatchGenerator (two rows: BatchPolicyCache's stacked steps)."""
    attach(model, config)
    try:
        gen = BatchGenerator(model, stop_tokens=None)
        prompts = [mx.random.randint(0, 97, (n,), key=mx.random.key(n)).tolist() for n in (20, 24)]
        gen.insert(prompts, [WARM + STEPS + 2] * 2)
        per_step = []
        with HostSyncs(PACKAGES) as syncs:
            for i in range(WARM + STEPS):
                assert gen.next_generated()
                if i >= WARM:
                    per_step.append(len(syncs.calls))
                syncs.reset()
        gen.close()
    finally:
        detach(model)
    return per_step


@pytest.mark.parametrize("method", SHIPPED_METHODS + QUERY_AGNOSTIC_PAIRS)
def test_no_host_sync_on_a_decode_step_of_a_shipped_method(model, method):
    config = with_fields(method, FIELDS)
    caches = KVCacheBuilder.for_model(model, config)
    assert single_syncs(model, caches) == [0] * STEPS
    policy = [c for c in caches if isinstance(c, PolicyCache)]
    assert policy and all(c.offset > c.budget + WARM + STEPS for c in policy)  # evicting at every counted step
    assert batch_syncs(model, config) == [0] * STEPS


@pytest.mark.parametrize("read", ["item", "tolist", "bool", "if", "int", "float", "numpy", "eval", "str"])
def test_the_counter_counts_each_kind_of_read_inserted_on_the_decode_path(monkeypatch, model, read):
    """One read of each kind, made from kvpolicy's decode path (the eviction every cache step runs past its budget),
    is counted once per layer per step; mlx-lm's own read of the sampled token is not (it is outside kvpolicy)."""
    reads = {
        "item": lambda a: a.item(),
        "tolist": lambda a: a.tolist(),
        "bool": bool,
        "if": lambda a: 1 if a else 0,
        "int": int,
        "float": float,
        "numpy": lambda a: np.asarray(a),
        "eval": lambda a: mx.eval(a),
        "str": str,
    }
    real = PolicyStep._decode_steady  # the route a decode step takes past the checked evictions

    def steady(self, *args, **kwargs):
        reads[read](mx.array(1))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(PolicyStep, "_decode_steady", steady)
    caches = KVCacheBuilder.for_model(model, with_fields("h2o", FIELDS))
    layers = sum(isinstance(c, PolicyCache) for c in caches)
    assert single_syncs(model, caches) == [layers] * STEPS


def test_the_counter_sees_mlx_lms_own_read_when_it_watches_mlx_lm(model):
    """The filter is what leaves mlx-lm's own per-token read out: watching mlx_lm, a plain cache shows it."""
    plain = [KVCache() for _ in model.layers]
    assert single_syncs(model, plain, packages=["mlx_lm"]) == [1] * STEPS
    assert single_syncs(model, [KVCache() for _ in model.layers]) == [0] * STEPS


class PluginMass(MassMergeDisposition):
    """A plugin's subclass of CaM's mass merge: the same update, but a plugin's part, so it is checked."""


class OutsideMass(PluginMass):
    """CaM's mass merge with every decode target past the end of the cache."""

    def dispose(self, view, losers, key):
        u = super().dispose(view, losers, key)
        return u if losers.shape[-1] > 1 else u._replace(targets=u.targets + view.scores.shape[-1])


#: a copy of CaM's class posing as it (its name, module and methods): another class, so a plugin's part
CopiedMass = type(
    "MassMergeDisposition",
    (Disposition,),
    {k: v for k, v in vars(MassMergeDisposition).items() if k not in ("__dict__", "__weakref__")},
)


class MassPlugin:
    @hookimpl
    def register_dispositions(self, register):
        register("plugin_mass", PluginMass)
        register("copied_mass", CopiedMass)
        register("outside_mass", OutsideMass)

    @hookimpl
    def register_methods(self, register):
        for name, part in (("plugmass", "plugin_mass"), ("copymass", "copied_mass"), ("outmass", "outside_mass")):
            register(MethodSpec(name, CamConfig, CamConfig.scorer_name.fget, "lowest_score", part))


@pytest.fixture
def mass_plugin():
    register_plugin(MassPlugin(), "mass")
    yield
    unregister_plugin("mass")


@pytest.mark.parametrize("method", ["plugmass", "copymass"])
def test_a_plugins_merge_makes_no_host_sync_at_steady_state_and_gives_cams_tokens(mass_plugin, method):
    """CaM's own merge through a plugin's class (a subclass, and a copy with no engine traits, run eager): no part
    is trusted, every decode update past the first checked ones is guarded on the device, so neither syncs."""
    assert WARM > CHECKED_DECODE_EVICTIONS
    model = tiny_llama(layers=2, seed=1)
    config = f"{method}:{FIELDS},min_sim=-1"
    assert single_syncs(model, KVCacheBuilder.for_model(model, config)) == [0] * STEPS
    tokens = [
        t
        for t, _ in generate_step(
            mx.arange(24), model, max_tokens=12, prompt_cache=KVCacheBuilder.for_model(model, config)
        )
    ]
    cam = [
        t
        for t, _ in generate_step(
            mx.arange(24),
            model,
            max_tokens=12,
            prompt_cache=KVCacheBuilder.for_model(model, f"cam:{FIELDS},min_sim=-1"),
        )
    ]
    assert tokens == cam


def test_a_plugins_merge_target_outside_the_cache_is_refused_then_guarded(mass_plugin):
    """The first decode updates are value-checked: a bad target is a PluginError, and the cache is rolled back.
    Past them, the store's device guard makes the same update write nothing outside the cache."""
    K, V = random_kv(B=1, H=2, S=30, D=8, seed=4)
    cache = PolicyCache(f"outmass:{FIELDS},min_sim=-1,signal=proxy,when=stream")
    feed(cache, K[:, :, :9], V[:, :, :9], [9])  # budget + 1 slots: the next token evicts
    with pytest.raises(PluginError, match="merge targets outside the cache"):
        feed(cache, K[:, :, 9:10], V[:, :, 9:10], [1])
    assert cache.offset == 9 and mx.array_equal(cache.values[..., :9, :], V[:, :, :9])
    cache._step.checked_decode = 0  # as after the checked evictions
    before = np.array(cache.values[..., :9, :])
    feed(cache, K[:, :, 9:10], V[:, :, 9:10], [1])
    after = np.array(cache.values[..., :9, :])
    changed = (before != after).any(axis=-1)  # only the loser's slot took the new token
    assert changed.sum() <= 2 and cache.offset == 10
