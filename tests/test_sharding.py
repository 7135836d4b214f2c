"""Caches on one rank's share of a sharded model, in one process: head slices, layouts, rank files, modes.

The real two-rank runs (``mlx.launch``) are in ``test_distributed.py``; these check the same
properties without launching, so a failure points at the part that broke.
"""

import mlx.core as mx
import numpy as np
import pytest
from helpers import SHIPPED_METHODS, random_kv, tiny_llama, with_fields

from kvpolicy_cam.gated_merge import bernoulli
from kvpolicy_core import KVCacheBuilder
from kvpolicy_core.cache.policy_cache import PolicyCache
from kvpolicy_core.config.policy import step_key
from kvpolicy_core.errors import KVPolicyError, ModelError
from kvpolicy_core.integration.persistence import CacheFileError, load_caches, save_caches
from kvpolicy_core.parts.random_score import hash01
from kvpolicy_core.plugin.discovery import get_registry
from kvpolicy_core.runtime.distributed import choose_mode, rank_path
from kvpolicy_core.runtime.sharding import ShardLayout, shard_layout
from kvpolicy_core.testing.conformance import feed
from kvpolicy_core.testing.tiny_models import write_model_dir

CHUNKS = (12, 1, 1, 9, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1)  # 40 tokens, budget 10
FIELDS = "budget=10,n_sink=2,when=stream"  # CHUNKS evict at prompt chunks too
#: the shipped matrix, plus every other installed method (e.g. the example plugin's) at its defaults
#: gated mass merges (the shipped mass merges are ungated): each loser merging on its key cosine draws the gate
GATED_MASS = ["cam:merge=mass,gate=true,min_sim=-1", "cam:merge=mass_blend,gate=true,min_sim=-1"]
METHODS = [with_fields(m, FIELDS) for m in SHIPPED_METHODS + GATED_MASS] + [
    with_fields(name, FIELDS) for name in sorted(get_registry().methods()) if name not in {"h2o", "cam", "random"}
]


def split_run(method, keys, values, layer=3):
    """Retained (positions, values) of one whole cache and of two half-head shards, heads concatenated."""
    whole = PolicyCache(method, layer=layer)
    feed(whole, keys, values, CHUNKS)
    H = keys.shape[1] // 2
    parts = []
    for r in range(2):
        c = PolicyCache(method, layer=layer, head_shard=(r, 2))
        feed(c, keys[:, r * H : (r + 1) * H], values[:, r * H : (r + 1) * H], CHUNKS)
        parts.append(c.retained())
    _, v, pos, _ = whole.retained()
    cat = lambda i: np.concatenate([np.array(p[i]) for p in parts], axis=1)  # noqa: E731
    return (np.array(pos), np.array(v)), (cat(2), cat(1)), whole


@pytest.mark.parametrize("method", METHODS)
def test_two_head_shards_keep_what_one_cache_keeps(method):
    """A rank holding heads 2..3 of 4 evicts and merges exactly as heads 2..3 of the whole cache."""
    keys, values = random_kv(B=2, H=4, S=40, D=8, seed=11)
    (pos, v), (pos_s, v_s), whole = split_run(method, keys, values)
    assert pos.shape[:2] == (2, 4) and pos.shape[2] <= 10  # fewer after whole-chunk evictions
    np.testing.assert_array_equal(pos_s, pos)
    np.testing.assert_allclose(v_s, v, rtol=1e-6, atol=1e-6)
    if whole.policy.config.method == "cam" and whole.merge_gate and whole.merge_mode != "drop":
        assert whole.gate_draws > 0 and 0 < whole.merges < whole.gate_draws  # the draws decided something


# cam with a gated merge (its default mass merge draws nothing)
@pytest.mark.parametrize(
    "method",
    ["random:budget=10,n_sink=2", "cam:budget=10,n_sink=2,merge=sim_weighted"]
    + [with_fields(m, FIELDS) for m in GATED_MASS],
)
def test_without_the_head_offset_the_second_shard_draws_differently(method):
    """The keying is what makes the shards agree: heads 2..3 told they are heads 0..1 diverge."""
    keys, values = random_kv(B=2, H=4, S=40, D=8, seed=11)
    whole = PolicyCache(method)
    feed(whole, keys, values, CHUNKS)
    wrong = PolicyCache(method)  # unsharded: believes its heads are 0..1
    feed(wrong, keys[:, 2:], values[:, 2:], CHUNKS)
    got = (np.array(wrong.retained()[2]), np.array(wrong.retained()[1]))
    want = (np.array(whole.retained()[2])[:, 2:], np.array(whole.retained()[1])[:, 2:])
    assert not (np.array_equal(got[0], want[0]) and np.allclose(got[1], want[1]))


def test_draws_are_a_function_of_the_global_head():
    p = mx.full((2, 6, 3), 0.5)
    key = step_key(0, 4, 17)
    full = np.array(bernoulli(p, key))
    assert (full == np.array(bernoulli(p, key, 0, 6))).all()  # unsharded draws are unchanged
    for offset in (0, 2, 4):
        np.testing.assert_array_equal(
            np.array(bernoulli(p[:, offset : offset + 2], key, offset, 6)), full[:, offset : offset + 2]
        )
    pos = mx.broadcast_to(mx.arange(20, dtype=mx.int32), (2, 6, 20))
    whole = np.array(hash01(pos, 5))
    np.testing.assert_array_equal(np.array(hash01(pos[:, 3:5], 5, head_offset=3)), whole[:, 3:5])


def test_head_shard_is_validated_and_survives_state_round_trips():
    for bad in ((2, 2), (-1, 2), (0, 0), (1.0, 2)):
        with pytest.raises(ValueError, match="head_shard"):
            PolicyCache("cam:budget=8", head_shard=bad)
    c = PolicyCache("cam:budget=8", layer=5, head_shard=(1, 2))
    feed(c, *random_kv(S=20), (12, 1, 1, 6))
    back = PolicyCache.from_state(c.state)
    assert back.head_shard == (1, 2) and back.layer == 5
    assert '"head_shard"' not in PolicyCache("cam:budget=8").meta_state[0]  # unsharded meta unchanged


def test_an_unsharded_model_has_the_trivial_layout_and_caches():
    model = tiny_llama()
    assert shard_layout(model) == ShardLayout() and ShardLayout().mode == "none"
    caches = KVCacheBuilder.for_model(model, "cam:budget=8")
    assert [(c.layer, c.head_shard) for c in caches] == [(0, (0, 1)), (1, (0, 1))]
    assert ShardLayout(2, (0, 2), (0, 1)).mode == "pipeline" and ShardLayout(0, (0, 1), (1, 2)).mode == "tensor"


# ----------------------------------------------------------------------------- per-rank files
def test_rank_files_are_written_per_rank_and_refused_elsewhere(tmp_path):
    caches = [PolicyCache("cam:budget=8", head_shard=(r, 2)) for r in range(2)]
    for r, c in enumerate(caches):
        feed(c, *random_kv(H=1, S=20, seed=r), (20,))
    base = tmp_path / "run.safetensors"
    paths = [save_caches(base, [caches[r]], shard=(r, 2)) for r in range(2)]
    assert [p.name for p in paths] == ["run.rank0-of-2.safetensors", "run.rank1-of-2.safetensors"]
    assert rank_path(base, (0, 1)) == base and rank_path(paths[1], (0, 2)) == paths[1]
    for r in range(2):
        got = load_caches(base, shard=(r, 2))[0]
        np.testing.assert_array_equal(np.array(got.state[2]), np.array(caches[r].state[2]))
        assert got.head_shard == (r, 2)
    with pytest.raises(CacheFileError, match=r"saved by rank 1 of 2, but this is rank 0 of 2"):
        load_caches(paths[1], shard=(0, 2))  # another rank's file, named explicitly
    with pytest.raises(CacheFileError, match=r"saved by rank 0 of 2, but this is a single process"):
        load_caches(paths[0])  # one process (this test's world) loading a rank's file
    with pytest.raises(
        CacheFileError,
        match=r"no such cache file for rank 0 of 4 \(files of this name: "
        r"run.rank0-of-2.safetensors, run.rank1-of-2.safetensors\)",
    ):
        load_caches(base, shard=(0, 4))  # another world size
    with pytest.raises(CacheFileError, match="no such cache file for a single process"):
        load_caches(base)
    one = save_caches(tmp_path / "one.safetensors", [caches[0]])
    assert one.name == "one.safetensors"
    renamed = one.rename(tmp_path / "one.rank1-of-2.safetensors")  # a one-process file posing as a rank's
    with pytest.raises(CacheFileError, match="saved by one process, but this is rank 1 of 2"):
        load_caches(renamed, shard=(1, 2))
    with pytest.raises(KVPolicyError, match="shard"):
        save_caches(base, [caches[0]], shard=(2, 2))


# ----------------------------------------------------------------------------- choosing a parallelism
@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {t: write_model_dir(root / t, t, layers=2) for t in ("llama", "qwen2", "gemma3_text")}


def test_the_parallelism_is_chosen_or_refused_clearly(model_dirs):
    assert choose_mode(model_dirs["llama"], "auto", 2) == "tensor"
    assert choose_mode(model_dirs["qwen2"], "auto", 2) == "tensor"
    assert choose_mode(model_dirs["qwen2"], "pipeline", 2) == "pipeline"
    with pytest.raises(ModelError, match="'gemma3_text' model supports neither tensor nor pipeline parallelism"):
        choose_mode(model_dirs["gemma3_text"], "auto", 2)
    with pytest.raises(
        ModelError, match=r"'llama' model does not support pipeline parallelism \(it supports: tensor\)"
    ):
        choose_mode(model_dirs["llama"], "pipeline", 2)
    with pytest.raises(ModelError, match=r"num_key_value_heads \(4\) divisible by 3"):
        choose_mode(model_dirs["llama"], "tensor", 3)
    with pytest.raises(ModelError, match=r"at least 3 layers \(has 2\)"):
        choose_mode(model_dirs["qwen2"], "pipeline", 3)
    (model_dirs["qwen2"] / "model.safetensors.index.json").rename(model_dirs["qwen2"] / "index.bak")
    try:
        with pytest.raises(ModelError, match="pipeline loading needs model.safetensors.index.json"):
            choose_mode(model_dirs["qwen2"], "pipeline", 2)
    finally:
        (model_dirs["qwen2"] / "index.bak").rename(model_dirs["qwen2"] / "model.safetensors.index.json")
