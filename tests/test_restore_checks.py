"""Every restore route checks the restored state against its meta, and cache files are written like files.

A file re-signed after an edit passes the checksum, so what it holds is checked as a state: each case here
loaded before and failed (or ran silently wrong) at a later step.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import resource
import stat
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest
from helpers import VOCAB, feed, random_kv, run_chunks, tiny_llama
from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

from kvpolicy_core import CacheFileError, KVCacheBuilder, KVPolicyError, PolicyCache, load_caches, save_caches
from kvpolicy_core.integration.persistence import _digest


def _resign(path, edit):
    """Apply ``edit(arrays, header)`` to a cache file and sign it again (a valid checksum over the edit)."""
    arrays, meta = mx.load(str(path), return_metadata=True)
    header = json.loads(meta["kvpolicy"])
    edit(arrays, header)
    header["sha256"] = _digest(arrays, header)
    mx.save_safetensors(str(path), arrays, metadata={"kvpolicy": json.dumps(header)})
    return path


@pytest.fixture
def saved(tmp_path, llama_model):
    caches = KVCacheBuilder.for_model(llama_model, "h2o:budget=8,n_sink=2")
    run_chunks(llama_model, caches, mx.random.randint(0, VOCAB, (1, 14), key=mx.random.key(2)), [10, 1, 1, 1, 1])
    return save_caches(tmp_path / "c.safetensors", caches)


def _set(name, fn):
    def edit(arrays, header):
        arrays[name] = fn(arrays[name])

    return edit


@pytest.mark.parametrize(
    "edit, needle",
    [
        (_set("0.positions", lambda p: p[..., :-1]), "positions must be int32"),
        (_set("0.scores", lambda s: mx.concatenate([s, s[..., :1]], axis=-1)), "scores must be float32"),
        (_set("0.keys", lambda k: (k * 100).astype(mx.int32)), "keys must have a floating dtype"),
        (_set("0.positions", lambda p: mx.concatenate([p, p], axis=0)), "positions must be int32"),
        (_set("0.positions", lambda p: p + 1000), "positions must be in \\[0, offset\\)"),
        (_set("0.positions", lambda p: mx.zeros_like(p)), "positions repeat"),
        (_set("0.positions", lambda p: p.astype(mx.int64)), "positions must be int32"),
    ],
)
def test_a_re_signed_file_with_a_bad_state_is_refused_when_loaded(saved, edit, needle):
    with pytest.raises(CacheFileError, match=needle):
        load_caches(_resign(saved, edit))


def test_a_re_signed_file_mixing_batch_sizes_is_refused(saved):
    def edit(arrays, header):
        for f in ("keys", "values", "positions", "scores"):
            arrays[f"1.{f}"] = mx.concatenate([arrays[f"1.{f}"]] * 2)

    with pytest.raises(CacheFileError, match="different batch sizes"):
        load_caches(_resign(saved, edit))


def test_a_re_signed_file_claiming_another_offset_is_refused(saved):
    def edit(arrays, header):
        meta = json.loads(header["layers"][0]["meta"])
        header["layers"][0]["meta"] = json.dumps({**meta, "offset": 3})

    with pytest.raises(CacheFileError, match="offset 3 is below"):
        load_caches(_resign(saved, edit))


def test_load_caches_with_the_model_checks_heads_and_head_dims(tmp_path):
    two_heads, one_head = tiny_llama(n_kv_heads=2), tiny_llama(n_kv_heads=1)
    caches = KVCacheBuilder.for_model(two_heads, "h2o:budget=8,n_sink=2")
    two_heads(mx.array([[1, 2, 3, 4]]), cache=caches)
    path = save_caches(tmp_path / "c.safetensors", caches)
    with pytest.raises(
        CacheFileError,
        match=r"layer 0 holds \(kv heads, key dim, value dim\) \(2, 16, 16\), but "
        r"the model's layer 0 has \(1, 16, 16\)",
    ):
        load_caches(path, model=one_head)
    assert [c.offset for c in load_caches(path, model=two_heads)] == [4, 4]


def _fed(config="h2o:budget=16,n_sink=2,signal=proxy", S=20):
    cache = PolicyCache(config)
    feed(cache, *random_kv(B=1, H=2, S=S, D=8), (S,))
    return cache


def test_a_state_without_its_meta_is_refused():
    cache, state = PolicyCache("h2o:budget=16,n_sink=2,signal=proxy"), _fed().state
    with pytest.raises(KVPolicyError, match="meta JSON carries the offset"):
        cache.state = state[:4]
    assert cache.keys is None and cache.offset == 0


@pytest.mark.parametrize(
    "config, needle",
    [
        ("cam:budget=16,n_sink=2,signal=proxy", "made by h2o .* but this cache is cam"),
        ("h2o:budget=8,n_sink=2,signal=proxy", "budget 16.* this cache is h2o \\(budget 8"),
    ],
)
def test_the_state_setter_refuses_a_state_of_another_policy(config, needle):
    target = _fed(config, S=6)
    before = [np.array(x) for x in target.state[:4]]
    with pytest.raises(KVPolicyError, match=needle):
        target.state = _fed().state
    assert target.offset == 6 and all(np.array_equal(a, np.array(b)) for a, b in zip(before, target.state[:4]))


def test_a_state_holding_more_than_the_budget_is_refused():
    big = _fed("h2o:budget=16,n_sink=2,signal=proxy,when=stream", S=40)
    state = list(big.state)
    meta = json.loads(state[4])
    meta["config"]["policy"]["budget"] = 8
    state[4] = json.dumps(meta)
    with pytest.raises(KVPolicyError, match="holds 16 tokens, more than this cache's budget 8"):
        PolicyCache.from_state(state)


def test_an_unpickled_cache_is_checked():
    cache = _fed()
    cache._slots.positions = mx.zeros_like(cache._slots.positions)
    with pytest.raises(KVPolicyError, match="positions repeat"):
        pickle.loads(pickle.dumps(cache))


def test_mlx_lm_round_trip_between_prompt_chunks_continues_exactly(tmp_path, llama_model):
    """Saved through mlx-lm between two prompt chunks (a run of chunks in progress), the loaded caches score
    the next chunk as part of the same run: the same evictions and logits as never saving."""
    config = "h2o:budget=16,n_sink=2"
    toks = mx.random.randint(0, VOCAB, (1, 40), key=mx.random.key(7))
    want = run_chunks(llama_model, KVCacheBuilder.for_model(llama_model, config), toks, [6, 8] + [1] * 26)
    first = KVCacheBuilder.for_model(llama_model, config)
    run_chunks(llama_model, first, toks[:, :6], [6])
    save_prompt_cache(str(tmp_path / "p.safetensors"), first)
    resumed = load_prompt_cache(str(tmp_path / "p.safetensors"))
    got = run_chunks(llama_model, resumed, toks[:, 6:], [8] + [1] * 26)
    assert mx.array_equal(got, want[:, 6:])


def test_mlx_lm_prompt_cache_of_a_batch_loads_back(tmp_path, llama_model):
    from kvpolicy_core.cache.batch import BatchPolicyCache

    rows = []
    for seed in (1, 2):
        caches = KVCacheBuilder.for_model(llama_model, "h2o:budget=8,n_sink=2")
        llama_model(mx.random.randint(0, VOCAB, (1, 10), key=mx.random.key(seed)), cache=caches)
        rows.append(caches)
    batch = [BatchPolicyCache.merge([r[j] for r in rows]) for j in range(2)]
    save_prompt_cache(str(tmp_path / "b.safetensors"), batch)
    back = load_prompt_cache(str(tmp_path / "b.safetensors"))
    assert [type(c).__name__ for c in back] == ["BatchPolicyCache"] * 2
    x = mx.random.randint(0, VOCAB, (2, 1), key=mx.random.key(5))
    assert mx.array_equal(llama_model(x, cache=batch), llama_model(x, cache=back))


def test_damaged_files_are_rejected(tmp_path):
    cache = PolicyCache("cam:budget=8")
    feed(cache, *random_kv(S=20), (20,))
    path = save_caches(tmp_path / "c.safetensors", [cache])
    data = bytearray(path.read_bytes())
    (tmp_path / "trunc.safetensors").write_bytes(bytes(data[: len(data) // 2]))
    with pytest.raises(CacheFileError, match="truncated or corrupted"):
        load_caches(tmp_path / "trunc.safetensors")
    data[-5] ^= 0xFF
    (tmp_path / "tamper.safetensors").write_bytes(bytes(data))
    with pytest.raises(CacheFileError, match="checksum mismatch"):
        load_caches(tmp_path / "tamper.safetensors")
    mx.save_safetensors(str(tmp_path / "other.safetensors"), {"a": mx.zeros(2)})
    with pytest.raises(CacheFileError, match="not a kvpolicy cache file"):
        load_caches(tmp_path / "other.safetensors")
    with pytest.raises(CacheFileError, match="no such cache file"):
        load_caches(tmp_path / "missing.safetensors")
    with pytest.raises(CacheFileError, match="must end in .safetensors"):
        save_caches(tmp_path / "c.bin", [cache])


def test_the_checksum_covers_the_header(tmp_path):
    cache = PolicyCache("h2o:budget=8")
    feed(cache, *random_kv(S=18), (18,))
    path = save_caches(tmp_path / "c.safetensors", [cache])
    data = path.read_bytes()
    j = re.search(rb'offset[\\"]+: 18', data).end() - 2  # the layer's offset in the (escaped) header JSON
    path.write_bytes(data[:j] + b"19" + data[j + 2 :])  # the same length: only the header's offset changes
    with pytest.raises(CacheFileError, match="checksum"):
        load_caches(path)


def test_a_cache_file_for_another_model_is_refused(tmp_path):
    two, three = tiny_llama(layers=2), tiny_llama(layers=3)
    caches = KVCacheBuilder.for_model(two, "h2o:budget=8")
    two(mx.array([[1, 2, 3, 4]]), cache=caches)
    save_caches(tmp_path / "c.safetensors", caches)
    with pytest.raises(CacheFileError, match="2 layers, but the model has 3"):
        load_caches(tmp_path / "c.safetensors", model=three)
    with pytest.raises(CacheFileError, match="2 layers, but the model has 3"):
        load_caches(tmp_path / "c.safetensors", expect_layers=3)
    assert [c.offset for c in load_caches(tmp_path / "c.safetensors", model=two)] == [4, 4]


def test_from_state_with_bad_meta_is_a_clear_error():
    import json

    from kvpolicy_core import KVPolicyError

    cache = PolicyCache("h2o:budget=8")
    feed(cache, *random_kv(S=5), (5,))
    state = list(cache.state)
    for garbage in ("{garbage", "[1, 2]", "{}", json.dumps({**json.loads(state[4]), "offset": "x"})):
        with pytest.raises(KVPolicyError, match="meta state"):
            PolicyCache.from_state((*state[:4], garbage))
    meta = json.loads(state[4])
    meta["offset"] = 2
    with pytest.raises(KVPolicyError, match="offset 2 is below the 5 tokens held"):
        PolicyCache.from_state((*state[:4], json.dumps(meta)))
    assert PolicyCache.from_state(tuple(state)).offset == 5


# ----------------------------------------------------------------------------- writing the file
def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_a_new_file_gets_the_umask_mode_and_a_replaced_file_keeps_its_mode(tmp_path):
    cache = _fed()
    old = os.umask(0o022)
    try:
        path = save_caches(tmp_path / "c.safetensors", [cache])
    finally:
        os.umask(old)
    assert _mode(path) == 0o644
    os.chmod(path, 0o640)
    save_caches(path, [cache])
    assert _mode(path) == 0o640 and load_caches(path)[0].offset == 20


def test_saving_through_a_symlink_replaces_its_target(tmp_path):
    (tmp_path / "real").mkdir()
    target = tmp_path / "real" / "c.safetensors"
    link = tmp_path / "link.safetensors"
    link.symlink_to(target)
    save_caches(link, [_fed()])  # a dangling link: the target is created
    save_caches(link, [_fed(S=30)])
    assert link.is_symlink() and target.is_file() and load_caches(link)[0].offset == 30
    assert sorted(p.name for p in (tmp_path / "real").iterdir()) == ["c.safetensors"]


def test_saving_into_a_missing_directory_is_a_clear_error(tmp_path):
    with pytest.raises(CacheFileError, match="does not exist; create it first"):
        save_caches(tmp_path / "no" / "such" / "c.safetensors", [_fed()])
    assert not (tmp_path / "no").exists()


@pytest.mark.slow
def test_a_failed_save_keeps_the_previous_file_and_says_why(tmp_path):
    path = tmp_path / "c.safetensors"
    script = f"""
import signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
from kvpolicy_core import CacheFileError, PolicyCache, save_caches
from kvpolicy_core.testing.conformance import feed, random_kv
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
    run = lambda arg, **kw: subprocess.run(
        [sys.executable, "-c", script, arg], capture_output=True, text=True, timeout=120, **kw
    )  # noqa: E731
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
