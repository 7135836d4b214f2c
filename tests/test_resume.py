"""Policy caches restored in a new process continue bit for bit as the saved ones do, or are refused up front.

Process A (this test process) writes a tiny Gemma 3 (sliding-window and global layers) to disk, runs every
shipped method on it, saves the caches by every route and continues them; process B (``resume_driver.py``,
one new process per route for all methods) loads the same model from disk, restores the caches and
continues: the logits must be exactly A's. Without the attention hook restored with the caches, B's first
step ignores CaM's log-weights and the sliding windows, and its second step raises.
"""

from __future__ import annotations

import copy
import json
import pickle
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import resume_driver as driver
from helpers import feed, random_kv
from mlx_lm.models.cache import save_prompt_cache

from kvpolicy_core import KVCacheBuilder, ModelError, PolicyCache, load_caches, save_caches
from kvpolicy_core.testing.tiny_models import write_model_dir

DRIVER = Path(__file__).with_name("resume_driver.py")


def _run_prompt(model, caches):
    toks, t = driver.tokens(), 0
    for S in driver.PROMPT + (1,) * driver.DECODE:
        model(toks[:, t : t + S], cache=caches)
        t += S


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """{route: (logits from B per method, refusals per method)} and A's references {(route kind, i): logits}."""
    d = tmp_path_factory.mktemp("resume")
    write_model_dir(d / "model", "gemma3_text", layers=4, heads=4, kv_heads=2)
    model = driver.load_model(d)
    want = {}
    for i, method in enumerate(driver.METHODS):
        caches = KVCacheBuilder.for_model(model, method)
        _run_prompt(model, caches)
        assert any(c.n > c.budget for c in caches if isinstance(c, PolicyCache)), "a pending eviction is saved"
        if "min_sim=-1" in method:
            assert any(bool(mx.any(c.log_weights != 0).item()) for c in caches), "log-weights are saved nonzero"
        save_caches(d / f"{i}.caches.safetensors", caches)
        (d / f"{i}.pickle").write_bytes(pickle.dumps(caches))
        want["raw", i] = driver.continuation(model, caches)
        caches = KVCacheBuilder.for_model(model, method)
        _run_prompt(model, caches)
        save_prompt_cache(str(d / f"{i}.prompt.safetensors"), caches)  # settles the caches (A's too)
        driver.save_states(d / f"{i}.states.safetensors", caches)
        want["settled", i] = driver.continuation(model, caches)
    procs = {
        r: subprocess.Popen(
            [sys.executable, str(DRIVER), r, str(d)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        for r in driver.ROUTES
    }
    got = {}
    for route, proc in procs.items():
        output = proc.communicate(timeout=600)[0]
        assert proc.returncode == 0, output[-2000:]
        refused = {int(p.name.split(".")[1]): p.read_text() for p in d.glob(f"{route}.*.refused")}
        got[route] = (dict(np.load(d / f"{route}.npz")), refused)
    return got, want


@pytest.mark.slow
@pytest.mark.parametrize("route", driver.ROUTES)
def test_caches_restored_in_a_new_process_continue_bit_for_bit(resumed, route):
    got, want = resumed
    logits, refused = got[route]
    assert not refused, refused
    kind = "settled" if route in driver.SETTLED else "raw"
    for i, method in enumerate(driver.METHODS):
        assert np.array_equal(logits[str(i)], want[kind, i]), (
            route,
            method,
            float(np.abs(logits[str(i)] - want[kind, i]).max()),
        )


def _without_hook_record(meta_json: str) -> str:
    meta = json.loads(meta_json)
    meta.pop("hook", None)
    meta.pop("attended", None)
    return json.dumps(meta)


def test_a_restored_cache_without_a_hook_record_is_refused_before_its_first_update(llama_model):
    """A state that does not say where the hook was (an older file) cannot run correctly without it: its first
    update is refused, nothing changed; restored with the model, the hook is installed on it and it runs."""
    caches = KVCacheBuilder.for_model(llama_model, "cam:budget=8,n_sink=2")
    toks = mx.random.randint(0, 97, (1, 20), key=mx.random.key(3))
    llama_model(toks[:, :12], cache=caches)
    state = list(caches[0].state)
    state[4] = _without_hook_record(state[4])
    cache = PolicyCache.from_state(state)
    assert cache.attention_hook is None
    before = [np.array(x) for x in cache.state[:4]]
    with pytest.raises(ModelError, match="does not record the attention hook"):
        cache.update_and_fetch(*random_kv(B=1, H=2, S=1, D=16))
    assert cache.offset == 12 and all(np.array_equal(a, np.array(b)) for a, b in zip(before, cache.state[:4]))
    hooked = PolicyCache.from_state(state, model=llama_model)
    assert hooked.attention_hook is not None and hooked.attention_hook.active
    assert hooked.attention_hook.modules == ["mlx_lm.models.llama"]


def test_a_hook_on_a_module_that_cannot_be_imported_is_refused_when_restoring():
    cache = PolicyCache("h2o:budget=8,n_sink=2")
    feed(cache, *random_kv(B=1, H=2, S=6, D=16), (6,))
    state = list(cache.state)
    meta = json.loads(state[4])
    for modules, needle in (
        (["mlx_lm.models.no_such_family"], "cannot import"),
        (["some_plugin.not_imported"], "is not imported"),
        (["json"], "has no"),
    ):
        state[4] = json.dumps({**meta, "hook": modules})
        with pytest.raises(ModelError, match=needle):
            PolicyCache.from_state(state)


def test_restoring_for_another_model_family_is_refused(llama_model, gemma_model):
    caches = KVCacheBuilder.for_model(llama_model, "h2o:budget=8,n_sink=2")
    llama_model(mx.array([[1, 2, 3, 4]]), cache=caches)
    with pytest.raises(ModelError, match="another model family"):
        PolicyCache.from_state(caches[0].state, model=gemma_model)


def test_a_cache_whose_hook_was_removed_refuses_the_next_step(llama_model):
    caches = KVCacheBuilder.for_model(llama_model, "h2o:budget=8,n_sink=2")
    llama_model(mx.array([[1, 2, 3, 4]]), cache=caches)
    caches[0].attention_hook.remove()
    with pytest.raises(ModelError, match="was removed"):
        llama_model(mx.array([[5]]), cache=caches)
    assert caches[0].offset == 4


def test_a_decoding_cache_and_its_copies_refuse_the_next_step_once_the_hook_they_hold_is_removed(llama_model):
    """A cache reads one flag for the hook at a decode step; removing the install clears it in every holder."""
    caches = KVCacheBuilder.for_model(llama_model, "h2o:budget=8,n_sink=2")
    llama_model(mx.array([[1, 2, 3, 4, 5, 6, 7, 8, 9, 10]]), cache=caches)
    for t in (11, 12):
        llama_model(mx.array([[t]]), cache=caches)  # decode steps past the cut, each through the hook
    copies = copy.deepcopy(caches)
    assert copies[0].attention_hook is caches[0].attention_hook
    caches[0].attention_hook.remove()
    for held in (caches, copies):
        with pytest.raises(ModelError, match="was removed"):
            llama_model(mx.array([[13]]), cache=held)
        assert held[0].offset == 12


def test_copies_hold_the_hook_after_the_original_is_gone(llama_model):
    import gc

    caches = KVCacheBuilder.for_model(llama_model, "cam:budget=8,n_sink=2")
    toks = mx.random.randint(0, 97, (1, 16), key=mx.random.key(4))
    llama_model(toks[:, :12], cache=caches)
    restored = pickle.loads(pickle.dumps(caches))
    copies = copy.deepcopy(restored)
    want = [llama_model(toks[:, t : t + 1], cache=caches) for t in range(12, 16)]
    del restored, caches
    gc.collect()
    got = [llama_model(toks[:, t : t + 1], cache=copies) for t in range(12, 16)]
    assert all(mx.array_equal(a, b) for a, b in zip(want, got))


def test_load_caches_with_the_model_installs_the_hook_on_it(tmp_path, llama_model):
    caches = KVCacheBuilder.for_model(llama_model, "h2o:budget=8,n_sink=2")
    llama_model(mx.array([[1, 2, 3, 4, 5]]), cache=caches)
    loaded = load_caches(save_caches(tmp_path / "c.safetensors", caches), model=llama_model)
    assert all(c.attention_hook is not None and c.attention_hook.active for c in loaded)
