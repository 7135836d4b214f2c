"""Prompt-cache files in one process: every file ``cache-prompt`` writes (kvzip's per-layer budgets, kvzip-layerwise,
stream) answers batched requests as each request alone, on GQA and sliding-window models; a damaged or tampered file
(a flipped bit, NaN or Inf values, no checksum, an old format, another model's weights at the recorded path, a
metadata field changed) is refused with an error naming the file, before anything runs on it."""

from __future__ import annotations

import copy
import json
import struct

import mlx.core as mx
import mlx_lm
import pytest
from helpers import with_fields
from mlx_lm.generate import BatchGenerator, generate_step

from kvpolicy_core import KVCacheBuilder
from kvpolicy_core.apps.prompt_file import cache_prompt, document_ids, file_metadata, load_prompt_file
from kvpolicy_core.errors import KVPolicyError
from kvpolicy_core.integration.builder import attach
from kvpolicy_core.integration.compress_once import compress_context, repeat_prompt
from kvpolicy_core.integration.persistence import CacheFileError
from kvpolicy_core.testing.tiny_models import write_model_dir

METHOD = "cam:budget=24,n_sink=2"
DOCUMENT = "the secret number is 4821. " + "the quick brown fox jumps over the lazy dog. " * 2
QUESTIONS = ("what is the number?", "who jumps?")
STEP = 32
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    d = tmp_path_factory.mktemp("prompt-files")
    return {  # GQA (8 query heads on 4 KV heads) and Gemma 3's sliding-window layers (window 8, every third global)
        "llama": write_model_dir(d / "llama", "llama", layers=3),
        "gemma3_text": write_model_dir(d / "gemma3_text", "gemma3_text", layers=4),
    }


def _write(model_dir, path, compress_once="kvzip", method=METHOD):
    model, tok = mlx_lm.load(str(model_dir))
    kw = dict(model_path=str(model_dir), prefill_step_size=STEP, compress_once=compress_once)
    cache_prompt(model, tok, DOCUMENT, method, path, **kw)
    return model, tok


def _in_memory(model, tok, compress_once, method=METHOD):
    """The document's caches made here, as cache-prompt makes them (a fresh in-memory copy)."""
    ids = document_ids(tok, DOCUMENT)
    if compress_once == "stream":  # the method's own streaming eviction (cache-prompt streams with when=stream)
        caches = KVCacheBuilder.for_model(model, with_fields(method, "when=stream"))
        for _ in generate_step(mx.array(ids), model, max_tokens=0, prompt_cache=caches, prefill_step_size=STEP):
            pass
        return caches
    repeat = repeat_prompt(tok)
    return compress_context(model, ids, method, scorer=compress_once, prefill_step=STEP, repeat=repeat).caches


def _alone(model, prompt, caches):
    return [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=MAX_TOKENS, prompt_cache=caches)]


def _batched(model, prompts, caches):
    """Each prompt's tokens, generated together in one mlx-lm BatchGenerator (caches: one list per prompt, or None)."""
    gen = BatchGenerator(model, max_tokens=MAX_TOKENS)
    uids = gen.insert(prompts, caches=caches)
    out = {u: [] for u in uids}
    for _ in range(10 * MAX_TOKENS):
        for r in gen.next()[1]:
            out[r.uid].append(r.token)
    return [out[u] for u in uids]


H2O = "h2o:budget=24,n_sink=2"


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
@pytest.mark.parametrize(
    "compress_once, method",
    [("kvzip", METHOD), ("kvzip", H2O), ("kvzip-layerwise", METHOD), ("stream", METHOD), ("stream", H2O)],
)
def test_batched_requests_from_every_kind_of_file_answer_as_each_alone(dirs, tmp_path, family, compress_once, method):
    """Every shipped attention method's file (cache-prompt's default kvzip, kvzip-layerwise, stream) answers each
    question, batched with others, as a fresh in-memory copy does. kvzip keeps another number of tokens in each
    layer: mlx-lm builds one batch mask from the first layer (before the fix: ``[broadcast_shapes]`` in every
    batched request from a kvzip file, HTTP 500 in the server)."""
    path = tmp_path / "doc.safetensors"
    model, tok = _write(dirs[family], path, compress_once, method)
    attach(model, method)  # as the server does: a request without a stored cache gets the method's fresh caches
    here = _in_memory(model, tok, compress_once, method)
    caches, _, info = load_prompt_file(path, model)
    sizes = {c.size() for c in caches}
    # kvzip shares the tokens out over the layers; a sliding-window layer holds its live window only (a stream
    # file: its budget under the default allocation, reach, caps it at the window and gives the rest to the global)
    layered = compress_once == "kvzip" or family == "gemma3_text"
    assert (len(sizes) > 1) == layered, sizes
    questions = [[int(t) for t in tok.encode(q)] for q in QUESTIONS]
    want = [_alone(model, q, copy.deepcopy(here)) for q in questions]
    fresh = [int(t) for t in tok.encode("hello")]
    got = _batched(model, questions + [fresh], [copy.deepcopy(caches) for _ in questions] + [None])
    assert got[: len(questions)] == want
    assert got[-1] == _alone(model, fresh, KVCacheBuilder.for_model(model, method))


@pytest.fixture(scope="module")
def written(dirs, tmp_path_factory):
    path = tmp_path_factory.mktemp("written") / "doc.safetensors"
    _write(dirs["llama"], path)
    return path


def _tensors(path):
    """(header dict, data start) of a safetensors file."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), 8 + n


def _rewrite(src, dst, change_arrays=None, change_meta=None, sign=True):
    """``src`` written again at ``dst`` with its arrays and flat metadata changed, re-signed unless ``sign`` is False
    (a writer that forges the checksum: the other checks must still hold)."""
    from kvpolicy_core.apps.prompt_file import _file_digest

    arrays, flat = mx.load(str(src), return_metadata=True)
    if change_arrays:
        change_arrays(arrays)
    if change_meta:
        change_meta(flat)
    if sign:
        flat["0.sha256"] = _file_digest(arrays, flat)
    mx.save_safetensors(str(dst), arrays, flat)
    return dst


def test_the_file_loads_and_records_a_checksum_and_the_models_fingerprint(written):
    metadata, info = file_metadata(written)
    assert len(metadata["sha256"]) == 64 and info["model_fingerprint"].startswith("sha256:")
    assert info["format"] == "kvpolicy-prompt-cache/2"
    load_prompt_file(written)


def test_a_flipped_bit_in_a_key_is_refused_naming_the_file(written, tmp_path):
    header, start = _tensors(written)
    begin = start + header["0.0"]["data_offsets"][0]  # layer 0's keys (float32), first element
    raw = bytearray(written.read_bytes())
    raw[begin + 3] ^= 0x40  # an exponent bit
    bad = tmp_path / "flipped.safetensors"
    bad.write_bytes(bytes(raw))
    with pytest.raises(CacheFileError, match=f"{bad}: checksum mismatch"):
        load_prompt_file(bad)


@pytest.mark.parametrize("name, value", [("0.0", float("nan")), ("1.1", float("inf"))])
def test_non_finite_keys_or_values_are_refused_even_with_a_forged_checksum(written, tmp_path, name, value):
    def poison(arrays):
        a = arrays[name]
        arrays[name] = mx.where(mx.arange(a.size).reshape(a.shape) == 0, mx.array(value, a.dtype), a)

    bad = _rewrite(written, tmp_path / "poisoned.safetensors", poison)
    with pytest.raises(CacheFileError, match=f"{bad}: layer [01] holds non-finite (keys|values)"):
        load_prompt_file(bad)


def test_a_file_without_its_checksum_or_of_the_old_format_is_refused(written, tmp_path):
    bad = _rewrite(written, tmp_path / "unsigned.safetensors", change_meta=lambda f: f.pop("0.sha256"), sign=False)
    with pytest.raises(CacheFileError, match=f"{bad}: has no checksum"):
        load_prompt_file(bad)

    def old(flat):
        info = json.loads(flat["0.kvpolicy"])
        flat["0.kvpolicy"] = json.dumps({**info, "format": "kvpolicy-prompt-cache/1"})

    bad = _rewrite(written, tmp_path / "old.safetensors", change_meta=old)
    with pytest.raises(KVPolicyError, match="written without a checksum"):
        file_metadata(bad)


def _serve_error(capsys, *args) -> str:
    from kvpolicy_core.apps.serve import main

    assert main(list(args)) == 2
    return capsys.readouterr().err


def test_tampered_metadata_is_refused_naming_the_file_and_field(written, dirs, tmp_path, capsys):
    def field(**changes):
        def change(flat):
            info = json.loads(flat["0.kvpolicy"])
            flat["0.kvpolicy"] = json.dumps({**info, **changes.pop("kvpolicy", {})})
            flat.update({f"0.{k}": v for k, v in changes.items()})

        return change

    bad = _rewrite(written, tmp_path / "int8.safetensors", change_meta=field(kvpolicy={"dtype": "int8"}))
    err = _serve_error(capsys, "--prompt-cache", str(bad))
    assert f"{bad}: metadata field dtype is 'int8'" in err
    # another family's model at the file's model path: unsigned, the checksum; signed, the model's fingerprint
    other = str(dirs["gemma3_text"])
    bad = _rewrite(written, tmp_path / "gemma.safetensors", change_meta=field(model=other), sign=False)
    assert f"{bad}: checksum mismatch" in _serve_error(capsys, "--prompt-cache", str(bad))
    bad = _rewrite(written, tmp_path / "gemma-signed.safetensors", change_meta=field(model=other))
    assert f"{bad}: metadata field model: the model at {other} is not the one" in _serve_error(
        capsys, "--prompt-cache", str(bad)
    )
    model, _ = mlx_lm.load(other)
    with pytest.raises(KVPolicyError, match="metadata field model"):
        load_prompt_file(bad, model)


def test_other_weights_at_the_recorded_path_are_refused(tmp_path, capsys):
    model_dir = write_model_dir(tmp_path / "model", "llama", layers=2)
    path = tmp_path / "doc.safetensors"
    model, _ = _write(model_dir, path, "stream")
    load_prompt_file(path, model)  # the same weights: fine
    write_model_dir(model_dir, "llama", layers=2, seed=1)  # same config and shapes, other weights
    err = _serve_error(capsys, "--prompt-cache", str(path))
    assert f"{path}: metadata field model: the model at {model_dir} is not the one" in err
    with pytest.raises(KVPolicyError, match="metadata field model"):
        load_prompt_file(path, mlx_lm.load(str(model_dir))[0])


def test_stream_with_a_compress_once_method_is_refused_naming_the_option(dirs, tmp_path):
    model, tok = mlx_lm.load(str(dirs["llama"]))
    with pytest.raises(KVPolicyError, match="--compress-once stream contradicts the method kvzip\\+cam"):
        cache_prompt(
            model, tok, DOCUMENT, "kvzip+" + METHOD, tmp_path / "x.safetensors", model_path=".", compress_once="stream"
        )
    assert not (tmp_path / "x.safetensors").exists()


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_a_kvzip_file_loaded_by_mlx_lm_itself_answers_batched_requests(dirs, tmp_path, family):
    """mlx-lm's own ``load_prompt_cache`` (no kvpolicy loader): the layers keep different numbers of tokens, so the
    restored caches hold the attention hook again (each layer's batch builds its own mask), as the saved ones did."""
    from mlx_lm.models.cache import load_prompt_cache

    path = tmp_path / "doc.safetensors"
    model, tok = _write(dirs[family], path, "kvzip")
    here = _in_memory(model, tok, "kvzip")
    caches = load_prompt_cache(str(path))
    assert len({c.size() for c in caches}) > 1
    assert all(c.attention_hook is not None and c.attention_hook.active for c in caches)
    questions = [[int(t) for t in tok.encode(q)] for q in QUESTIONS]
    want = [_alone(model, q, copy.deepcopy(here)) for q in questions]
    assert _batched(model, questions, [copy.deepcopy(caches) for _ in questions]) == want
