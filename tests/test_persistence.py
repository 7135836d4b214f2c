"""Policy caches saved and loaded, through kvpolicy's cache files and mlx-lm's prompt-cache files, continue as
the saved ones do (refused files and restored states: test_restore_checks.py)."""

import mlx.core as mx
import numpy as np
import pytest
from helpers import VOCAB, plain_caches, run_chunks, tiny_llama

from kvpolicy_core import KVCacheBuilder, PolicyCache, load_caches, save_caches


@pytest.mark.parametrize("method", ["cam:budget=12,n_sink=2", "h2o:budget=12,signal=observed", "cam:budget=64"])
def test_save_and_load_continue_bit_for_bit(tmp_path, method):
    model = tiny_llama(seed=6)
    toks = mx.random.randint(0, VOCAB, (2, 50), key=mx.random.key(6))
    whole = KVCacheBuilder.for_model(model, method)
    want = run_chunks(model, whole, toks, [20] + [1] * 30)
    first = KVCacheBuilder.for_model(model, method)
    run_chunks(model, first, toks[:, :27], [20] + [1] * 7)
    path = save_caches(tmp_path / "caches.safetensors", first, metadata={"note": "x"})
    resumed = load_caches(path)
    got = run_chunks(model, resumed, toks[:, 27:], [1] * 23)
    assert mx.array_equal(got, want[:, 27:])
    assert [c.offset for c in resumed] == [50, 50] and resumed[0].merges == whole[0].merges


def test_a_cache_saved_between_prompt_chunks_continues_the_run(tmp_path):
    """Saved between two chunks of a prompt that fits the budget (a run in progress), the loaded caches
    score the next chunk as part of the same run: the same logits as never saving."""
    model = tiny_llama(seed=7)
    toks = mx.random.randint(0, VOCAB, (1, 40), key=mx.random.key(7))
    whole = KVCacheBuilder.for_model(model, "h2o:budget=16,n_sink=2")
    want = run_chunks(model, whole, toks, [6, 8] + [1] * 26)
    first = KVCacheBuilder.for_model(model, "h2o:budget=16,n_sink=2")
    run_chunks(model, first, toks[:, :6], [6])
    resumed = load_caches(save_caches(tmp_path / "mid-run.safetensors", first))
    got = run_chunks(model, resumed, toks[:, 6:], [8] + [1] * 26)
    assert mx.array_equal(got, want[:, 6:])


def test_mlx_lm_caches_and_mixed_sets_round_trip(tmp_path, gemma_model):
    toks = mx.random.randint(0, VOCAB, (1, 30), key=mx.random.key(8))
    caches = KVCacheBuilder.for_model(gemma_model, "cam:budget=12,layers=unbounded")
    run_chunks(gemma_model, caches, toks[:, :20], [14] + [1] * 6)
    loaded = load_caches(save_caches(tmp_path / "mixed.safetensors", caches))
    assert [type(c).__name__ for c in loaded] == [type(c).__name__ for c in caches]
    a = run_chunks(gemma_model, caches, toks[:, 20:], [1] * 10)
    b = run_chunks(gemma_model, loaded, toks[:, 20:], [1] * 10)
    assert mx.array_equal(a, b)
    plain = plain_caches(tiny_llama(seed=1))
    assert load_caches(save_caches(tmp_path / "empty.safetensors", plain))[0].keys is None


def test_mlx_lm_save_and_load_prompt_cache_work_with_policy_caches(tmp_path, llama_model):
    from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

    caches = KVCacheBuilder.for_model(llama_model, "cam:budget=10,merge=mean")
    toks = mx.random.randint(0, VOCAB, (1, 30), key=mx.random.key(2))
    run_chunks(llama_model, caches, toks[:, :20], [20])
    save_prompt_cache(str(tmp_path / "p.safetensors"), caches)
    loaded = load_prompt_cache(str(tmp_path / "p.safetensors"))
    assert [type(c).__name__ for c in loaded] == ["PolicyCache", "PolicyCache"]
    assert loaded[0].policy.config == caches[0].policy.config and loaded[0].offset == 20
    a = run_chunks(llama_model, caches, toks[:, 20:], [1] * 10)
    b = run_chunks(llama_model, loaded, toks[:, 20:], [1] * 10)
    np.testing.assert_allclose(np.array(a), np.array(b), atol=1e-5)


def test_mlx_lm_round_trip_of_fresh_policy_caches(tmp_path):
    from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

    model = tiny_llama()
    caches = KVCacheBuilder.for_model(model, "cam:budget=8")
    save_prompt_cache(str(tmp_path / "p.safetensors"), caches)
    back = load_prompt_cache(str(tmp_path / "p.safetensors"))
    assert len(back) == len(caches) and all(isinstance(c, PolicyCache) and c.offset == 0 for c in back)
    assert back[0].policy.config == caches[0].policy.config
