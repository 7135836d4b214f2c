"""A data-driven allocation's state (each layer's statistics of the prompt and its budget) lives in the caches' state:
saved and restored (``save_caches``, mlx-lm's ``save_prompt_cache``, in a new process too), pickled, copied,
merged into a batch and extracted from it; the allocations keep a sliding layer within its window as the default
allocation does, so ``squeeze:strength=0`` and a flat pyramid are ``h2o`` on a model with sliding-window layers."""

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
from helpers import tiny_gemma3
from mlx_lm.generate import batch_generate, generate_step
from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

from kvpolicy_core import KVCacheBuilder, KVPolicyError, PolicyCache, attach, detach, load_caches, save_caches
from kvpolicy_core.config.policy import layer_budgets
from kvpolicy_core.parts.allocation import LayerInfo, LayerStats
from kvpolicy_core.testing.equivalence import assert_equivalent
from kvpolicy_core.testing.tiny_models import tiny_llama, write_model_dir

SQUEEZE = "squeeze:budget=12,n_sink=2,strength=1"
PROMPT = (20, 19)  # prompt chunks; the first decode step cuts
DECODE = 6


def _tokens():
    return mx.random.randint(3, 97, (1, sum(PROMPT) + DECODE), key=mx.random.key(7))


def _prefill(model, caches):
    toks, t = _tokens(), 0
    for S in PROMPT:
        model(toks[:, t : t + S], cache=caches)
        t += S


def _decode(model, caches) -> np.ndarray:
    """Logits [1, DECODE, V] of the decode steps after the prompt (the first one cuts)."""
    toks, start = _tokens(), sum(PROMPT)
    out = mx.concatenate([model(toks[:, t : t + 1], cache=caches) for t in range(start, start + DECODE)], axis=1)
    mx.eval(out)
    return np.array(out)


def _budgets(caches):
    return [c.budget for c in caches if isinstance(c, PolicyCache)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("squeeze-resume")
    write_model_dir(d / "model", "llama", layers=6, heads=4, kv_heads=2)
    return d


@pytest.fixture(scope="module")
def model(model_dir):
    from mlx_lm.utils import load_model

    return load_model(model_dir / "model")[0]


@pytest.fixture(scope="module")
def uninterrupted(model):
    """(budgets after the cut, logits of the decode steps) of squeeze run without a break."""
    caches = KVCacheBuilder.for_model(model, SQUEEZE)
    _prefill(model, caches)
    logits = _decode(model, caches)
    budgets = _budgets(caches)
    assert len(set(budgets)) > 1 and sum(budgets) == 12 * len(budgets)  # the allocation acted, the mean kept
    return budgets, logits


def _saved(model, route: str, path: Path):
    caches = KVCacheBuilder.for_model(model, SQUEEZE)
    _prefill(model, caches)  # saved after the prompt, before its cut
    if route == "save_caches":
        save_caches(path, caches)
    elif route == "prompt_cache":
        save_prompt_cache(str(path), caches)
    else:
        path.write_bytes(pickle.dumps(caches))
    return caches


def _restored(route: str, path: Path, model=None):
    if route == "save_caches":
        return load_caches(path, model=model)
    if route == "prompt_cache":
        return load_prompt_cache(str(path))
    return pickle.loads(path.read_bytes())


ROUTES = {"save_caches": "caches.safetensors", "prompt_cache": "prompt.safetensors", "pickle": "caches.pickle"}


@pytest.mark.parametrize("route", list(ROUTES))
def test_squeeze_saved_before_its_cut_cuts_as_the_uninterrupted_run(model, uninterrupted, tmp_path, route):
    """Saved after the prompt and before the first decode step: the restored caches cut with the budgets of the
    uninterrupted run (not uniform ones) and give its logits bit for bit."""
    path = tmp_path / ROUTES[route]
    _saved(model, route, path)
    restored = _restored(route, path, model)
    logits = _decode(model, restored)
    assert _budgets(restored) == uninterrupted[0]
    assert np.array_equal(logits, uninterrupted[1])


CHILD = """
import pickle, sys
from pathlib import Path
from kvpolicy_core.runtime.blas import load_optimized_blas
load_optimized_blas(quiet=True)  # before mlx, as the test process (conftest.py): the same matmul results
import numpy as np
sys.path.insert(0, sys.argv[2])
import test_layer_stats_state as t
from mlx_lm.utils import load_model
d = Path(sys.argv[1])
model = load_model(d / "model")[0]
out = {}
for route, name in t.ROUTES.items():
    caches = t._restored(route, d / name, model)
    out[route] = t._decode(model, caches)
    out[route + ".budgets"] = np.array(t._budgets(caches))
np.savez(d / "resumed.npz", **out)
"""


def test_squeeze_saved_before_its_cut_resumes_in_a_new_process_bit_for_bit(model, model_dir, uninterrupted):
    for route, name in ROUTES.items():
        _saved(model, route, model_dir / name)
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(model_dir), str(Path(__file__).parent)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = np.load(model_dir / "resumed.npz")
    for route in ROUTES:
        assert got[route + ".budgets"].tolist() == uninterrupted[0], route
        assert np.array_equal(got[route], uninterrupted[1]), route


def test_squeeze_caches_pickle_and_deep_copy_with_their_group(model, uninterrupted):
    caches = KVCacheBuilder.for_model(model, SQUEEZE)
    _prefill(model, caches)
    pickled = pickle.loads(pickle.dumps(caches))
    copied = copy.deepcopy(caches)
    assert pickled[0].group is pickled[-1].group and pickled[0].group is not caches[0].group
    for restored in (pickled, copied, caches):  # each is its own sequence: cutting one leaves the others held
        assert np.array_equal(_decode(model, restored), uninterrupted[1])
        assert _budgets(restored) == uninterrupted[0]


def test_a_restored_group_meta_is_checked_naming_the_field(model):
    caches = KVCacheBuilder.for_model(model, SQUEEZE)
    _prefill(model, caches)
    state = caches[1].state
    meta = json.loads(state[4])
    assert meta["group"]["budget"] == 12 and [1, 6, None] in meta["group"]["layers"]
    meta["group"]["layers"] = [[0, 6, None]]  # not this layer's group
    with pytest.raises(KVPolicyError, match=r"group\.layers"):
        PolicyCache.from_state((*state[:4], json.dumps(meta), *state[5:]))


def test_squeeze_on_unbounded_layers_allocates_among_the_layers_it_replaces():
    """``layers=unbounded`` on a model with sliding layers: they keep mlx-lm's cache; the global layers' budgets are
    set from their statistics at the cut, their mean ``budget``."""
    model = tiny_gemma3()
    caches = KVCacheBuilder.for_model(model, "squeeze:budget=16,n_sink=2,strength=1,layers=unbounded")
    assert _budgets(caches) == [16, 16]
    prompt = mx.random.randint(0, 97, (60,), key=mx.random.key(3))
    for _ in zip(generate_step(prompt, model, prompt_cache=caches), range(3)):
        pass
    budgets = _budgets(caches)
    assert budgets != [16, 16] and sum(budgets) == 32
    assert all(c.tokens_kept == c.budget for c in caches if isinstance(c, PolicyCache))


@pytest.mark.parametrize("config, floor", [("squeeze:budget=4,n_sink=0,strength=1", 1), (SQUEEZE, 3)])
def test_squeeze_keeps_every_layer_its_floor_and_the_mean_at_strength_1(config, floor):
    """A layer whose share rounds below one token (or below the sinks and one evictable token) keeps that floor,
    and the others give it up: the mean stays ``budget`` exactly (the cut no longer refuses a small budget)."""
    budget = int(config.split("budget=")[1].split(",")[0])
    infos = [LayerInfo(i, 6, None) for i in range(6)]
    stats = [LayerStats(c, 128) for c in (0.001, 0.9, 1.0, 1.2, 0.02, 2.0)]
    budgets = layer_budgets(config, infos, stats)
    assert min(budgets) == floor and sum(budgets) == budget * 6
    assert budgets[5] == max(budgets)  # still in the order of the layers' change


def test_squeeze_with_a_small_budget_cuts_through_mlx_lm():
    model = tiny_llama(layers=6, seed=2)
    caches = KVCacheBuilder.for_model(model, "squeeze:budget=4,n_sink=0,strength=1")
    prompt = mx.random.randint(0, 97, (40,), key=mx.random.key(5))
    for _ in zip(generate_step(prompt, model, prompt_cache=caches), range(2)):
        pass
    assert min(_budgets(caches)) >= 1 and sum(_budgets(caches)) == 4 * 6


class _Tok:  # batch_generate needs only eos ids and decode
    eos_token_ids = []

    @staticmethod
    def decode(ids):
        return " ".join(map(str, ids))


def test_squeeze_rows_of_a_batch_cut_with_the_budgets_they_get_alone():
    """Under ``batch_generate`` (mlx-lm's BatchGenerator, as ``kvpolicy serve``) each row measures its own prompt in
    the batched prefill and cuts with the budgets it gets alone, the same tokens too."""
    model = tiny_llama(layers=4, seed=1)
    config = "squeeze:budget=16,n_sink=2,strength=1"
    prompts = [mx.random.randint(0, 97, (n,), key=mx.random.key(40 + n)).tolist() for n in (60, 45, 52)]
    alone = []
    for p in prompts:
        caches = KVCacheBuilder.for_model(model, config)
        tokens = [t for t, _ in zip(generate_step(mx.array(p), model, prompt_cache=caches, max_tokens=4), range(4))]
        alone.append((_budgets(caches), [int(t) for t, _ in tokens]))
    assert len({tuple(b) for b, _ in alone}) > 1 and all(len(set(b)) > 1 for b, _ in alone)
    attach(model, config)
    try:
        out = batch_generate(model, _Tok, prompts, max_tokens=4, return_token_ids=True, return_prompt_caches=True)
    finally:
        detach(model)
    for r, (budgets, tokens) in enumerate(alone):
        assert _budgets(out.caches[r]) == budgets, f"row {r}"
        assert out.token_ids[r] == tokens, f"row {r}"


def test_rows_merged_after_their_prefill_keep_their_groups_and_extract_with_them():
    model = tiny_llama(layers=4, seed=1)
    config = "squeeze:budget=16,n_sink=2,strength=1"
    rows = []
    for n in (60, 45):
        caches = KVCacheBuilder.for_model(model, config)
        model(mx.random.randint(0, 97, (1, n), key=mx.random.key(n)), cache=caches)
        rows.append(caches)
    alone = copy.deepcopy(rows)
    for caches in alone:
        model(mx.array([[5]]), cache=caches)
    batch = [rows[0][i].merge([r[i] for r in rows]) for i in range(4)]
    model(mx.array([[5], [5]]), cache=batch)
    for r in range(2):
        extracted = [c.extract(r) for c in batch]
        assert _budgets(extracted) == _budgets(alone[r])
        assert extracted[0].group is extracted[3].group and extracted[0].group is not alone[r][0].group


@pytest.mark.parametrize(
    "a, b",
    [
        ("squeeze:budget=12,n_sink=2,strength=0", "h2o:budget=12,n_sink=2,when=prompt_end"),
        ("pyramidkv:budget=12,n_sink=2,pyramid_beta=1", "h2o:budget=12,n_sink=2"),
    ],
    ids=["strength=0 is h2o", "a flat pyramid is h2o"],
)
def test_the_equivalences_hold_on_a_model_with_sliding_window_layers(a, b):
    assert_equivalent(a, b, model=tiny_gemma3())


def test_the_sliding_window_equivalences_are_not_vacuous():
    model = tiny_gemma3()
    assert [c.budget for c in KVCacheBuilder.for_model(model, "h2o:budget=12,n_sink=2")] == [8, 8, 20, 8, 8, 20]
    for a, b in [
        ("squeeze:budget=12,n_sink=2,strength=1", "h2o:budget=12,n_sink=2,when=prompt_end"),
        ("pyramidkv:budget=12,n_sink=2,pyramid_beta=4", "h2o:budget=12,n_sink=2"),
    ]:
        with pytest.raises(AssertionError):
            assert_equivalent(a, b, model=model)


def test_allocations_keep_sliding_layers_within_their_window_and_the_mean():
    """Gemma 3 270M's shape at budget 1024 (windows of 512): the pyramid's and squeeze's sliding layers keep at most
    512, the global layers share what that frees, the total 18 * 1024."""
    gemma = [LayerInfo(i, 18, None if i % 6 == 5 else 512) for i in range(18)]
    pyramid = layer_budgets("pyramidkv:budget=1024", gemma)
    squeeze = layer_budgets("squeeze:budget=1024", gemma, [LayerStats(1 + (i % 5) / 4, 64) for i in range(18)])
    for budgets in (pyramid, squeeze):
        assert all(b <= 512 for b, i in zip(budgets, gemma) if i.window) and sum(budgets) == 18 * 1024


def test_a_restored_layer_statistic_is_checked_naming_it(model):
    caches = KVCacheBuilder.for_model(model, SQUEEZE)
    _prefill(model, caches)
    state = caches[1].state
    assert "kvpolicy_layer_change" in state[-1]
    bad = {**state[-1], "kvpolicy_layer_change": mx.array([float("nan")])}
    with pytest.raises(KVPolicyError, match="kvpolicy_layer_change"):
        PolicyCache.from_state((*state[:-1], bad))
