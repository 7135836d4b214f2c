"""Issue 13: defects a hostile tester found; each test failed before its fix."""

import math
import re
import resource
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest

from helpers import random_kv, tiny_llama
from kvpolicy_core import (
    CacheFileError, KVCacheBuilder, MergeUpdate, MethodSpec, PluginError, PolicyCache, PolicyConfig,
    attach, detach, hookimpl, load_caches, save_caches,
)
from kvpolicy_core.parts.base import Scorer, Selector
from kvpolicy_core.plugins import register_plugin, unregister_plugin
from kvpolicy_core.testing import feed


# ----------------------------------------------------------------------------- 8: trim(-n)
def test_trim_rejects_a_negative_count_and_leaves_the_cache_usable():
    cache = PolicyCache("h2o:budget=16")
    feed(cache, *random_kv(S=10), (10,))
    with pytest.raises(ValueError, match="trim"):
        cache.trim(-2)
    assert cache.n == cache.offset == 10 and cache.scores.shape[-1] == 10
    feed(cache, *random_kv(S=1, seed=2), (1,))
    assert cache.offset == 11


# ----------------------------------------------------------------------------- 3: +inf scores
class InfScorer(Scorer):
    def on_append(self, view, new_keys, new_positions):
        return mx.full(view.scores.shape, math.inf)


class InfPlugin:
    @hookimpl
    def register_scorers(self, register):
        register("all_inf", InfScorer)

    @hookimpl
    def register_methods(self, register):
        register(MethodSpec("allinf", PolicyConfig, "all_inf", "lowest_score", "drop"))


def test_infinite_scores_never_evict_sinks():
    register_plugin(InfPlugin(), "inf")
    try:
        cache = PolicyCache("allinf:budget=8,n_sink=2,recent=1")
        feed(cache, *random_kv(S=30), (10,) + (1,) * 20)
        pos = np.array(cache.retained()[2])
        assert (pos[..., :2] == [0, 1]).all() and (pos[..., -1] == 29).all()
    finally:
        unregister_plugin("inf")


# ----------------------------------------------------------------------------- 4: one NaN key
def test_one_non_finite_key_does_not_zero_the_other_tokens_scores():
    keys, values = random_kv(B=1, H=2, S=12, D=8, seed=5)
    k = np.array(keys)
    k[:, :, 3] = np.nan
    cache = PolicyCache("h2o:budget=32")
    feed(cache, mx.array(k), values, (12,))
    scores = np.array(cache.scores)
    finite = [j for j in range(12) if j != 3]
    # proxy scores: every earlier finite token receives mass from each later finite key
    assert (scores[..., [0, 1, 2, 4, 5]] > 0).all(), scores
    clean = PolicyCache("h2o:budget=32")
    feed(clean, keys, values, (12,))
    assert np.isfinite(scores[..., finite]).all()


# ----------------------------------------------------------------------------- 5, 6: files
def test_the_checksum_covers_the_header(tmp_path):
    cache = PolicyCache("h2o:budget=8")
    feed(cache, *random_kv(S=18), (18,))
    path = save_caches(tmp_path / "c.safetensors", [cache])
    data = path.read_bytes()
    j = re.search(rb'offset[\\"]+: 18', data).end() - 2  # the layer's offset in the (escaped) header JSON
    path.write_bytes(data[:j] + b"19" + data[j + 2 :])  # the same length: only the header's offset changes
    with pytest.raises(CacheFileError, match="checksum"):
        load_caches(path)


def test_a_failed_save_keeps_the_previous_file_and_says_why(tmp_path):
    path = tmp_path / "c.safetensors"
    script = f"""
import signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
from kvpolicy_core import CacheFileError, PolicyCache, save_caches
from kvpolicy_core.testing import feed, random_kv
cache = PolicyCache("h2o:budget=64")
feed(cache, *random_kv(B=1, H=2, S=60, D=32), (60,))
if sys.argv[1] == "good":
    save_caches({str(path)!r}, [cache]); sys.exit(0)
feed(cache, *random_kv(B=1, H=2, S=4, D=32, seed=9), (4,))
try:
    save_caches({str(path)!r}, [cache])
except CacheFileError as exc:
    print(exc); sys.exit(0)
sys.exit(3)
"""
    run = lambda arg, **kw: subprocess.run([sys.executable, "-c", script, arg], capture_output=True, text=True, timeout=120, **kw)  # noqa: E731
    assert run("good").returncode == 0
    good = path.read_bytes()
    limit = lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))  # noqa: E731
    bad = run("bad", preexec_fn=limit)  # a disk that fills up part-way through the write
    assert bad.returncode == 0, ("the failed save must raise CacheFileError", bad.returncode, bad.stderr[-400:])
    assert path.read_bytes() == good and load_caches(path)[0].offset == 60
    assert [p.name for p in tmp_path.iterdir()] == ["c.safetensors"]  # no temporary file left behind


def test_saving_onto_a_directory_is_a_clear_error(tmp_path):
    (tmp_path / "d.safetensors").mkdir()
    with pytest.raises(CacheFileError, match="directory"):
        save_caches(tmp_path / "d.safetensors", [PolicyCache("h2o:budget=8")])


# ----------------------------------------------------------------------------- 7: mlx-lm files of fresh caches
def test_mlx_lm_round_trip_of_fresh_policy_caches(tmp_path):
    from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

    model = tiny_llama()
    caches = KVCacheBuilder.for_model(model, "cam:budget=8")
    save_prompt_cache(str(tmp_path / "p.safetensors"), caches)
    back = load_prompt_cache(str(tmp_path / "p.safetensors"))
    assert len(back) == len(caches) and all(isinstance(c, PolicyCache) and c.offset == 0 for c in back)
    assert back[0].policy.config == caches[0].policy.config


# ----------------------------------------------------------------------------- 9, 10: attach / detach
def test_detach_restores_the_models_own_make_cache():
    from mlx_lm.models.cache import RotatingKVCache

    model = tiny_llama()
    custom = lambda: [RotatingKVCache(max_size=32, keep=4) for _ in model.layers]  # noqa: E731
    model.make_cache = custom
    attach(model, "h2o:budget=16")
    detach(model)
    assert model.make_cache is custom


def test_one_users_detach_does_not_break_another_users_observed_caches():
    model = tiny_llama(seed=6)
    mine = KVCacheBuilder.for_model(model, "h2o:budget=8,signal=observed")
    KVCacheBuilder.for_model(model, "h2o:budget=8")
    detach(model)  # someone else's detach
    tokens = mx.random.randint(0, 97, (1, 20), key=mx.random.key(2))
    model(tokens[:, :12], cache=mine)
    model(tokens[:, 12:13], cache=mine)  # still observed: no ModelError
    assert all(c.offset == 13 for c in mine)


# ----------------------------------------------------------------------------- 1, 2: part outputs
class BadSelector(Selector):
    mode = "big"

    def select(self, view, n_evict):
        B, H, L = view.scores.shape
        base = mx.broadcast_to(mx.arange(n_evict, dtype=mx.int32), (B, H, n_evict))
        return {"big": base + 10**6, "neg": base - 1, "dup": base * 0 + 2, "float": base.astype(mx.float32) + 2,
                "list": [[[0]]]}[BadSelector.mode]


class BadMerge:
    mode = "big"

    @classmethod
    def from_config(cls, config):
        return cls()

    def dispose(self, view, losers, key):
        B, H, E = losers.shape
        t = mx.full((B, H, E), view.scores.shape[-1] + 3 if BadMerge.mode == "big" else 0, mx.int32)
        dv = mx.zeros((B, H, E, view.values.shape[-1] + (1 if BadMerge.mode == "shape" else 0)))
        return {"dict": {"targets": t}}.get(BadMerge.mode, MergeUpdate(t, None, dv, None))


class BadPlugin:
    @hookimpl
    def register_selectors(self, register):
        register("bad_sel", BadSelector)

    @hookimpl
    def register_dispositions(self, register):
        register("bad_merge", BadMerge)

    @hookimpl
    def register_methods(self, register):
        register(MethodSpec("badsel", PolicyConfig, "cumulative_attention", "bad_sel", "drop"))
        register(MethodSpec("badmerge", PolicyConfig, "cumulative_attention", "lowest_score", "bad_merge"))


@pytest.fixture
def bad_plugin():
    register_plugin(BadPlugin(), "bad")
    yield
    unregister_plugin("bad")


@pytest.mark.parametrize("mode, needle", [("big", "outside the cache"), ("neg", "outside the cache"),
                                          ("dup", "distinct"), ("float", "dtype float32"), ("list", "shape")])
@pytest.mark.parametrize("chunks", [(12, 1), (12, 6)])  # the decode write and the chunked compaction
def test_bad_loser_indices_are_a_plugin_error_and_the_cache_stays_usable(bad_plugin, mode, needle, chunks):
    BadSelector.mode = mode
    keys, values = random_kv(S=20)
    cache = PolicyCache("badsel:budget=8,n_sink=1,recent=1")
    feed(cache, keys[:, :, :12], values[:, :, :12], chunks[:1])
    with pytest.raises(PluginError, match=needle):
        feed(cache, keys[:, :, 12:], values[:, :, 12:], chunks[1:])
    assert cache.offset == 12 and cache.n == 12  # rolled back: nothing half-applied, nothing corrupted
    assert mx.array_equal(cache.keys[..., :12, :], keys[:, :, :12]) and cache.scores.shape[-1] == 12


@pytest.mark.parametrize("mode, needle", [("big", "merge targets outside"), ("shape", "d_values of shape"),
                                          ("dict", "expected a MergeUpdate")])
def test_bad_merge_updates_are_a_plugin_error(bad_plugin, mode, needle):
    BadMerge.mode = mode
    keys, values = random_kv(S=20)
    cache = PolicyCache("badmerge:budget=8,n_sink=1,recent=1")
    feed(cache, keys[:, :, :12], values[:, :, :12], (12,))
    with pytest.raises(PluginError, match=needle):
        feed(cache, keys[:, :, 12:13], values[:, :, 12:13], (1,))
    assert cache.offset == 12


# ----------------------------------------------------------------------------- weaker spots
def test_a_window_below_one_is_rejected():
    for bad in (-3, 0, True, 2.5):
        with pytest.raises(ValueError, match="window"):
            PolicyCache("h2o:budget=8", window=bad)


def test_zero_new_tokens_is_a_clear_error_not_a_part_failure():
    for method in ("h2o:budget=8", "random:budget=8"):
        cache = PolicyCache(method)
        with pytest.raises(ValueError, match="S=0"):
            cache.update_and_fetch(mx.zeros((1, 2, 0, 8)), mx.zeros((1, 2, 0, 8)))
        assert cache.offset == 0 and cache.keys is None


def test_the_same_field_twice_is_an_error_not_last_wins():
    from kvpolicy_core import ConfigError, parse_config

    for bad in ("cam:budget=8,cam_budget=9", {"method": "cam", "budget": 8, "cam_budget": 9}):
        with pytest.raises(ConfigError, match="given twice"):
            parse_config(bad)
