"""A prompt or cache file is checked field by field when it is restored: NaN or Inf keys or values are refused by
every restore route (mlx-lm's own ``load_prompt_cache`` included, which verifies no checksum), and a file whose
layers do not match the model (a window on a global layer, a layer index out of place) is refused naming the field
and the file, even when its checksum was recomputed after the edit."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest
from helpers import tiny_gemma3
from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

from kvpolicy_core import KVCacheBuilder, PolicyCache
from kvpolicy_core.errors import KVPolicyError
from kvpolicy_core.integration.persistence import CacheFileError, load_caches, save_caches

METHOD = "h2o:budget=8,n_sink=1,recent=2,signal=proxy"


@pytest.fixture(scope="module")
def model():
    return tiny_gemma3(window=8)  # layers 0, 1 sliding (window 8), 2 global, 3, 4 sliding, 5 global


def _filled(model):
    caches = KVCacheBuilder.for_model(model, METHOD)
    model(mx.arange(24)[None] % 32, cache=caches)
    return caches


@pytest.mark.parametrize("name", ["keys", "values"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_mlx_lm_loader_refuses_non_finite_keys_or_values(model, tmp_path, name, bad):
    path = str(tmp_path / "c.safetensors")
    save_prompt_cache(path, _filled(model))
    arrays, meta = mx.load(path, return_metadata=True)
    key = next(
        k
        for k in sorted(arrays)
        if k.startswith("2.") and arrays[k].ndim == 4 and k.endswith(".0" if name == "keys" else ".1")
    )
    arrays[key] = mx.where(mx.arange(arrays[key].shape[-1]) == 0, bad, arrays[key])
    mx.save_safetensors(path, arrays, meta)
    with pytest.raises(KVPolicyError, match=f"layer 2\\): {name} hold NaN or Inf"):
        load_prompt_cache(path)


def _edit_layer_meta(path, layer: int, changes: dict):
    """Change ``changes`` in layer ``layer``'s meta of a save_caches file and sign it again (kvpolicy's digest is
    unkeyed: anyone can recompute it)."""
    from kvpolicy_core.integration.persistence import digest

    arrays, meta = mx.load(str(path), return_metadata=True)
    header = json.loads(meta["kvpolicy"])
    entry = json.loads(header["layers"][layer]["meta"])
    entry.update(changes)
    header["layers"][layer]["meta"] = json.dumps(entry)
    header["sha256"] = digest(arrays, header)
    mx.save_safetensors(str(path), arrays, {"kvpolicy": json.dumps(header)})


@pytest.mark.parametrize(
    "layer, changes, field",
    [
        (2, {"window": 3}, "window"),  # a window on a global layer: attention silently limited to 3 tokens
        (0, {"window": None}, "window"),  # a sliding layer made global
        (1, {"layer": 0}, "layer"),
    ],
)
def test_a_re_signed_file_whose_layer_does_not_match_the_model_is_refused(model, tmp_path, layer, changes, field):
    path = tmp_path / "c.safetensors"
    save_caches(path, _filled(model))
    assert len(load_caches(path, model=model)) == 6
    _edit_layer_meta(path, layer, changes)
    with pytest.raises(CacheFileError, match=f"{path}: layer {layer}: {field} "):
        load_caches(path, model=model)


def test_a_file_that_matches_the_model_loads(model, tmp_path):
    path = tmp_path / "c.safetensors"
    save_caches(path, _filled(model))
    caches = load_caches(path, model=model)
    assert [c.window for c in caches if isinstance(c, PolicyCache)] == [8, 8, None, 8, 8, None]


# ----------------------------------------------------------------------------- prompt files, edited and re-signed
DOCUMENT = "the secret number is 4821. " + "the quick brown fox jumps over the lazy dog. " * 2


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    """A gemma3 prompt file (window-8 layers 0, 1, 3 and a global layer 2), streamed through h2o."""
    import mlx_lm

    from kvpolicy_core.apps.prompt_file import cache_prompt
    from kvpolicy_core.testing.tiny_models import write_model_dir

    d = tmp_path_factory.mktemp("prompt-fields")
    model_dir = write_model_dir(d / "model", "gemma3_text", layers=4)
    model, tok = mlx_lm.load(str(model_dir))
    path = d / "doc.safetensors"
    cache_prompt(
        model, tok, DOCUMENT, "h2o:budget=24,n_sink=2", path, model_path=str(model_dir), compress_once="stream"
    )
    return path, model


def _re_sign(src, dst, layer=None, meta=None, info=None):
    """``src`` with layer ``layer``'s meta JSON updated by ``meta`` and the kvpolicy metadata by ``info`` (a key
    set to ``...`` is removed), its checksum recomputed as kvpolicy computes it."""
    from kvpolicy_core.apps.prompt_file import _FLAT_DIGEST, _file_digest

    arrays, flat = mx.load(str(src), return_metadata=True)
    if meta is not None:
        entry = json.loads("".join(chr(c) for c in arrays[f"{layer}.4"].tolist()))
        entry.update(meta)
        arrays[f"{layer}.4"] = mx.array([ord(c) for c in json.dumps(entry)])
    if info is not None:
        data = json.loads(flat["0.kvpolicy"])
        for k, v in info.items():
            data.pop(k) if v is ... else data.__setitem__(k, v)
        flat["0.kvpolicy"] = json.dumps(data)
    flat[_FLAT_DIGEST] = _file_digest(arrays, flat)
    mx.save_safetensors(str(dst), arrays, flat)
    return dst


def _layer_config(path, layer, **changes):
    arrays, _ = mx.load(str(path), return_metadata=True)
    entry = json.loads("".join(chr(c) for c in arrays[f"{layer}.4"].tolist()))
    config = entry["config"]
    config["policy"].update(changes)
    return {"config": config}


@pytest.mark.parametrize(
    "edit, needle",
    [
        (dict(layer=2, meta={"window": 3}), "layer 2: window 3 in the file, but the model's layer 2 is global"),
        (dict(layer=1, meta={"window": None}), "layer 1: window None in the file"),
        (dict(layer=3, meta={"layer": 1}), "layer 3: layer 1 in the file"),
        (dict(info={"model_fingerprint": ...}), "metadata field model_fingerprint is missing"),
        (dict(info={"model_fingerprint": None}), "metadata field model_fingerprint is null"),
        (dict(info={"document_ids": [1, 2, 3]}), "metadata field document_ids holds 3 tokens, but tokens_seen is"),
        (dict(info={"tokens_kept_per_layer": [1, 1, 1, 1]}), "layer 0: holds"),
    ],
)
def test_a_re_signed_prompt_file_that_does_not_match_the_model_or_method_is_refused(
    prompt_file, tmp_path, edit, needle
):
    from kvpolicy_core.apps.prompt_file import load_prompt_file

    path, model = prompt_file
    load_prompt_file(path, model)  # the file as written loads
    bad = _re_sign(path, tmp_path / "bad.safetensors", **edit)
    with pytest.raises(KVPolicyError) as err:
        load_prompt_file(bad, model)
    assert str(bad) in str(err.value) and needle in str(err.value), err.value


@pytest.mark.parametrize("field, value, needle", [("budget", 100, "budget 100, but"), ("n_sink", 3, "n_sink")])
def test_a_re_signed_layer_config_is_refused(prompt_file, tmp_path, field, value, needle):
    from kvpolicy_core.apps.prompt_file import load_prompt_file

    path, model = prompt_file
    bad = _re_sign(path, tmp_path / "bad.safetensors", layer=2, meta=_layer_config(path, 2, **{field: value}))
    with pytest.raises(KVPolicyError) as err:
        load_prompt_file(bad, model)
    assert str(bad) in str(err.value) and "layer 2: " in str(err.value) and needle in str(err.value), err.value
