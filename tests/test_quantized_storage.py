"""Storage as a seam: quantized rows (``kv_bits``) and floating rows in another dtype (``kv_dtype``) under every
policy, bit for bit where a reduction says so (mlx-lm's ``QuantizedKVCache``; ``cam:merge=drop`` = ``h2o``)."""

from __future__ import annotations

import mlx.core as mx
import pytest
from helpers import SHIPPED_METHODS
from mlx_lm.models.cache import QuantizedKVCache, load_prompt_cache, save_prompt_cache

from kvpolicy_core.cache.batch import BatchPolicyCache
from kvpolicy_core.cache.policy_cache import PolicyCache
from kvpolicy_core.errors import ConfigError, KVPolicyError
from kvpolicy_core.integration.builder import KVCacheBuilder
from kvpolicy_core.testing.conformance import run_conformance, with_fields
from kvpolicy_core.testing.equivalence import assert_equivalent
from kvpolicy_core.testing.tiny_models import VOCAB, tiny_model


@pytest.fixture(scope="module")
def model64():
    """A tiny llama whose head dim (64) can be quantized in groups of 32 or 64; 2 query heads per KV head."""
    return tiny_model("llama", head_dim=64, hidden_size=128, num_attention_heads=4, num_key_value_heads=2)


def run(model, caches, tokens, prompt=20):
    out = [model(tokens[:, :prompt], cache=caches)]
    for t in range(prompt, tokens.shape[1]):
        out.append(model(tokens[:, t : t + 1], cache=caches))
    return mx.concatenate(out, axis=1)


TOKENS = mx.random.randint(0, VOCAB, (1, 34), key=mx.random.key(3))


@pytest.mark.parametrize("bits,group", [(4, 64), (8, 64), (4, 32)])
@pytest.mark.parametrize("method", ["h2o", "cam", "snapkv", "streamingllm", "tova"])
def test_a_budget_above_the_sequence_is_mlx_lms_quantized_cache(model64, method, bits, group):
    """Nothing evicted: the logits are QuantizedKVCache(bits, group)'s, bit for bit (the same rows, attention on
    mlx-lm's quantized path, the observed weights from that same pass)."""
    ref = run(model64, [QuantizedKVCache(group, bits) for _ in model64.layers], TOKENS)
    caches = KVCacheBuilder.for_model(model64, f"{method}:budget=100,kv_bits={bits},kv_group_size={group}")
    got = run(model64, caches, TOKENS)
    assert mx.array_equal(ref, got)
    assert all(c.bits == bits and c.group_size == group for c in caches)


def test_cam_with_drop_is_h2o_with_quantized_rows(model64):
    """The equivalence kit (one sequence, then batched rows) with 4-bit rows: evictions, merges off, bit for bit."""
    assert_equivalent("cam:budget=12,merge=drop,kv_bits=4", "h2o:budget=12,kv_bits=4", model=model64)


def test_quantized_rows_stay_close_to_full_precision_and_take_fewer_bytes(model64):
    """The same policy stores ~1/6 of the bytes at 4 bits; its logits move by the quantization error only."""
    full = KVCacheBuilder.for_model(model64, "cam:budget=12")
    q8 = KVCacheBuilder.for_model(model64, "cam:budget=12,kv_bits=8")
    q4 = KVCacheBuilder.for_model(model64, "cam:budget=12,kv_bits=4")
    a, b, c = (run(model64, x, TOKENS) for x in (full, q8, q4))
    assert mx.abs(a - b).max().item() < mx.abs(a - c).max().item() < 1.0
    assert all(x.tokens_kept == y.tokens_kept for x, y in zip(full, q4))
    assert q4[0].nbytes < 0.4 * full[0].nbytes and q4[0].nbytes < q8[0].nbytes < full[0].nbytes


def test_generate_steps_kv_bits_quantizes_policy_caches(model64):
    """mlx-lm's own ``kv_bits`` (generate_step calls ``to_quantized``) stores the rows quantized under the policy,
    as the config field does: the same greedy tokens."""
    from mlx_lm.generate import generate_step

    prompt = mx.array([5, 9, 2, 7, 1, 3, 8, 4, 6, 2, 9, 11, 13])

    def tokens(caches, **kw):
        return [t for (t, _), _ in zip(generate_step(prompt, model64, prompt_cache=caches, **kw), range(12))]

    by_mlx_lm = KVCacheBuilder.for_model(model64, "h2o:budget=10,when=stream")
    by_config = KVCacheBuilder.for_model(model64, "h2o:budget=10,when=stream,kv_bits=4")
    assert tokens(by_mlx_lm, kv_bits=4, kv_group_size=64, quantized_kv_start=0) == tokens(by_config)
    assert all(isinstance(c, PolicyCache) and c.bits == 4 for c in by_mlx_lm)
    with pytest.raises(ValueError, match="kv_bits=4, kv_group_size=64; mlx-lm asks for kv_bits=8"):
        by_config[0].to_quantized(group_size=64, bits=8)


def test_a_quantized_cache_saves_and_resumes_bit_for_bit(model64, tmp_path):
    """mlx-lm's save_prompt_cache/load_prompt_cache: the meta records the storage; the resumed caches continue as
    the saved ones (quantized rows as they were, no re-quantization)."""
    caches = KVCacheBuilder.for_model(model64, "cam:budget=12,kv_bits=4")
    run(model64, caches, TOKENS[:, :26])
    path = str(tmp_path / "q.safetensors")
    save_prompt_cache(path, caches)
    loaded = load_prompt_cache(path)
    assert all(c.bits == 4 and c.group_size == 64 for c in loaded)
    step = TOKENS[:, 26:27]
    assert mx.array_equal(model64(step, cache=caches), model64(step, cache=loaded))
    for a, b in zip(caches, loaded):
        assert all(mx.array_equal(x, y) for x, y in zip(a.keys, b.keys))


def test_a_state_of_other_rows_is_refused(model64):
    q = KVCacheBuilder.for_model(model64, "h2o:budget=12,kv_bits=4")
    f = KVCacheBuilder.for_model(model64, "h2o:budget=12")
    run(model64, q, TOKENS[:, :22])
    run(model64, f, TOKENS[:, :22])
    with pytest.raises(KVPolicyError, match="config differ"):  # kv_bits is part of the config
        q[0].state = f[0].state
    by_mlx_lm = KVCacheBuilder.for_model(model64, "h2o:budget=12")[0].to_quantized(group_size=64, bits=4)
    with pytest.raises(KVPolicyError, match="full-precision rows but this cache stores kv_bits=4"):
        by_mlx_lm.state = f[0].state
    state = list(q[0].state)
    state[0] = (state[0][0].astype(mx.int32), *state[0][1:])
    with pytest.raises(KVPolicyError, match="uint32"):
        PolicyCache.from_state(tuple(state))


def test_batched_rows_with_quantized_storage_decode_each_as_alone(model64):
    """A batch (mlx-lm's server) of quantized rows: each row's logits are those it gets alone."""
    spec = "h2o:budget=10,kv_bits=4"
    toks = mx.random.randint(0, VOCAB, (2, 24), key=mx.random.key(5))
    alone, rows = [], []
    for r in range(2):
        caches = KVCacheBuilder.for_model(model64, spec)
        model64(toks[r : r + 1, : 18 - r], cache=caches)
        rows.append(caches)
        solo = KVCacheBuilder.for_model(model64, spec)
        model64(toks[r : r + 1, : 18 - r], cache=solo)
        alone.append(solo)
    batch = [BatchPolicyCache.merge([rows[0][i], rows[1][i]]) for i in range(len(model64.layers))]
    assert batch[0].bits == 4
    step = toks[:, 20:21]
    got = model64(step, cache=batch)
    for r in range(2):
        assert mx.allclose(got[r : r + 1], model64(step[r : r + 1], cache=alone[r]), atol=1e-4)


def test_bad_storage_settings_are_clear_errors(model64):
    with pytest.raises(ConfigError, match="kv_bits"):
        KVCacheBuilder.for_model(model64, "h2o:kv_bits=7")
    with pytest.raises(ConfigError, match="kv_group_size"):
        KVCacheBuilder.for_model(model64, "h2o:kv_bits=4,kv_group_size=48")
    with pytest.raises(ConfigError, match="kv_group_size: 128 does not divide the model's head dim 64"):
        KVCacheBuilder.for_model(model64, "h2o:kv_bits=4,kv_group_size=128")
    with pytest.raises(ConfigError, match="kv_dtype"):
        KVCacheBuilder.for_model(model64, "h2o:kv_bits=4,kv_dtype=float16")
    with pytest.raises(ConfigError, match="kv_dtype"):
        KVCacheBuilder.for_model(model64, "h2o:kv_dtype=int8")
    cache = PolicyCache("h2o:budget=8,kv_bits=4")  # head dim 16 reaches the cache directly: refused, nothing kept
    with pytest.raises(ValueError, match="kv_group_size=64 does not divide the head dim 16"):
        cache.update_and_fetch(mx.zeros((1, 2, 3, 16)), mx.zeros((1, 2, 3, 16)))
    assert cache.keys is None and cache.offset == 0


def test_memory_budgets_count_the_stored_bytes(model64):
    """kv_memory turns bytes into tokens with the storage's row size: 4-bit rows give ~6x the tokens here."""
    full, q4, f16 = (
        KVCacheBuilder.for_model(model64, f"h2o:kv_memory=100kB{extra}")[0].budget
        for extra in ("", ",kv_bits=4", ",kv_dtype=float16")
    )
    assert f16 > 1.8 * full and q4 > 5 * full


# ------------------------------------------------------------------ the seam shown by a second floating storage
@pytest.mark.parametrize("method", ["h2o:budget=16", "cam:budget=16,merge_after=1"])
def test_float16_rows_under_a_float32_model_pass_the_conformance_kit(method):
    """Rows stored in float16 under a float32 model (decoded back for attention): every conformance check."""
    assert run_conformance(f"{method},kv_dtype=float16")


def test_float16_rows_pass_the_equivalence_kit():
    assert_equivalent("cam:budget=12,merge=drop,kv_dtype=float16", "h2o:budget=12,kv_dtype=float16")


def test_float16_rows_hold_what_float32_rows_hold_rounded():
    caches = [PolicyCache(f"h2o:budget=8{x}") for x in ("", ",kv_dtype=float16")]
    k, v = mx.random.normal((1, 2, 12, 16), key=mx.random.key(0)), mx.random.normal((1, 2, 12, 16))
    outs = [c.update_and_fetch(k, v) for c in caches]
    assert outs[1][0].dtype == mx.float32 and caches[1].keys.dtype == mx.float16
    assert mx.array_equal(outs[1][0], k.astype(mx.float16).astype(mx.float32))
    assert caches[1].nbytes < caches[0].nbytes


def test_kvpolicy_cache_files_keep_quantized_rows_and_resume(model64, tmp_path):
    """save_caches/load_caches (kvpolicy's checksummed files, prompt files): the quantized parts are stored as they
    are, the storage recorded in each layer's meta; the loaded caches continue bit for bit."""
    from kvpolicy_core.integration.persistence import load_caches, save_caches

    caches = KVCacheBuilder.for_model(model64, "h2o:budget=12,kv_bits=8,kv_group_size=32")
    run(model64, caches, TOKENS[:, :27])
    path = save_caches(tmp_path / "q.safetensors", caches)
    loaded = load_caches(path, model=model64)
    assert all(c.bits == 8 and c.group_size == 32 for c in loaded)
    step = TOKENS[:, 27:28]
    assert mx.array_equal(model64(step, cache=caches), model64(step, cache=loaded))


def test_compress_once_keeps_its_cut_in_quantized_rows(model64):
    """Compress once with kv_bits: the kept rows are the full-precision cut's rows, quantized (the same positions;
    the keys those rows dequantize to), and decoding goes on from them."""
    from kvpolicy_core.integration.compress_once import compress_context

    ids = [int(t) for t in mx.random.randint(0, VOCAB, (40,), key=mx.random.key(8))]
    full = compress_context(model64, ids, "h2o:budget=12", scorer="kvzip", chunk=16).caches
    quant = compress_context(model64, ids, "h2o:budget=12,kv_bits=8", scorer="kvzip", chunk=16).caches
    for f, q in zip(full, quant):
        assert q.bits == 8 and mx.array_equal(f.positions, q.positions)
        keys = mx.dequantize(*q.keys, group_size=64, bits=8)
        assert mx.array_equal(keys, mx.dequantize(*mx.quantize(f.keys, group_size=64, bits=8), group_size=64, bits=8))
    assert model64(mx.array([[3]]), cache=quant).shape[1] == 1


@pytest.fixture(scope="module")
def sliding64():
    """A tiny Gemma 3 (sliding-window and global layers, 4 query heads on 1 KV head) of head dim 64."""
    return tiny_model(
        "gemma3_text",
        head_dim=64,
        hidden_size=128,
        num_attention_heads=4,
        num_key_value_heads=1,
        query_pre_attn_scalar=64,
    )


@pytest.mark.parametrize("method", SHIPPED_METHODS)
def test_every_method_runs_on_quantized_rows_of_a_sliding_window_model(sliding64, method):
    """Windowed layers' masks are per KV head (grouped query heads): the quantized attention takes them so; 8-bit
    rows give the full-precision logits up to the quantization error."""
    toks = mx.random.randint(0, VOCAB, (1, 40), key=mx.random.key(0))
    for budget in (64, 12):  # nothing evicted but by the windows; then evictions (the choices may differ)
        spec = with_fields(method, f"budget={budget}")
        full = run(sliding64, KVCacheBuilder.for_model(sliding64, spec), toks)
        caches = KVCacheBuilder.for_model(sliding64, with_fields(spec, "kv_bits=8"))
        got = run(sliding64, caches, toks)
        assert all(c.bits == 8 for c in caches if isinstance(c, PolicyCache)) and mx.isfinite(got).all()
        assert budget < 40 or mx.abs(got - full).max().item() < 0.3  # mlx-lm QuantizedKVCache(8) vs KVCache: 0.22


def test_a_recorded_full_precision_prefill_never_stands_in_for_stored_rows():
    """The retrieval runner replays a recorded one-chunk prefill into fresh caches; quantized or float16 rows change
    every later layer's input, so such caches are always prefilled for real."""
    from kvpolicy_core.eval.tasks.needle import replayable

    assert replayable("cam:budget=8") and replayable("full")
    assert not replayable("cam:budget=8,kv_bits=4") and not replayable("h2o:budget=8,kv_dtype=float16")


def test_the_servers_memory_share_counts_quantized_rows(model64, monkeypatch):
    """``kvpolicy serve --kv-memory``: the same limit holds more tokens per request with 4-bit rows (3.4x here, not
    6x: the prefill chunk's attention logits over each budget token do not shrink), beside the prefill step's own
    memory (measured at start-up; fixed here)."""
    from types import SimpleNamespace

    from kvpolicy_core.apps import serve
    from kvpolicy_core.config.parse import parse_config

    monkeypatch.setattr(serve, "prefill_transient", lambda model, rows, S, decode_rows: 200_000)
    args = SimpleNamespace(decode_concurrency=2, prompt_concurrency=2, prefill_step_size=64)
    provider = SimpleNamespace(cli_args=args, kv_memory=4_000_000)
    kept = {
        bits: serve.request_memory(
            model64, parse_config("cam:when=stream" + (f",kv_bits={bits}" if bits else "")), provider
        )
        for bits in (None, 4)
    }
    per_token = {None: 2 * 2 * (2 * 64 * 4 + 8), 4: 2 * 2 * (2 * (32 + 2 * 4) + 8)}  # layers x heads x row bytes
    a = 2 * 4 * 64 * 4  # P x Hq x S x 4 bytes of chunk logits per budget token
    for bits, c in per_token.items():
        b = (4_000_000 - 200_000 - 4 * 64 * c) / (4 * c + a)
        assert kept[bits] == int(b * c)
    assert kept[4] / per_token[4] > 3 * kept[None] / per_token[None]


def test_the_cli_kv_bits_applies_to_every_policy_and_leaves_other_caches():
    """``--kv-bits`` (generate, eval, serve) sets each policy's storage; ``full`` and ``rotating`` are mlx-lm's own."""
    from types import SimpleNamespace

    from kvpolicy_core.apps.cli import _with_budget, _with_storage

    args = SimpleNamespace(kv_bits=4, kv_group_size=32)
    assert _with_budget(_with_storage("cam:merge=mean", args), 64).to_string() == (
        "cam:budget=64,merge=mean,kv_bits=4,kv_group_size=32"
    )
    assert _with_storage("full", args) == "full" and _with_storage("rotating:budget=8", args) == "rotating:budget=8"
    assert _with_storage("cam", SimpleNamespace(kv_bits=None, kv_group_size=64)) == "cam"


REGISTERED = [
    "cam",
    "chunkkv",
    "h2o",
    "pyramidkv",
    "random",
    "snapkv",
    "squeeze",
    "streamingllm",
    "streamingmerge",
    "tova",
]


@pytest.mark.parametrize("method", REGISTERED)
def test_every_registered_method_evicts_quantized_rows_alone_and_batched(model64, method):
    """Every installed method (the example plugins' too) on 4-bit rows: a prompt, decode steps with evictions, then
    two such rows batched (mlx-lm's server) decoding together; finite logits, rows kept quantized, budgets held."""
    spec = f"{method}:budget=10,kv_bits=4"
    toks = mx.random.randint(0, VOCAB, (2, 30), key=mx.random.key(2))
    rows = []
    for r in range(2):
        caches = KVCacheBuilder.for_model(model64, spec)
        out = run(model64, caches, toks[r : r + 1, : 26 - r], prompt=18 - r)
        assert mx.isfinite(out).all()
        rows.append(caches)
    batch = [BatchPolicyCache.merge([rows[0][i], rows[1][i]]) for i in range(len(model64.layers))]
    for t in range(3):
        assert mx.isfinite(model64(toks[:, 26 + t : 27 + t], cache=batch)).all()
    for c in (batch[0].extract(0), batch[0].extract(1)):
        assert c.bits == 4 and isinstance(c.keys, tuple) and c.n <= c.budget + 1


@pytest.fixture(scope="module")
def model64_dir(tmp_path_factory):
    """A loadable model directory whose head dim (64) quantizes in groups of 32 or 64."""
    from kvpolicy_core.testing.tiny_models import build_model, model_config, save_model_dir

    config = model_config("llama", hidden=128, layers=2, heads=2, kv_heads=1)
    return save_model_dir(tmp_path_factory.mktemp("llama64"), build_model(config), config)


DOC = "The code of the red door is 48213 and the blue door opens with 77. " * 3


def test_the_cli_runs_every_command_on_quantized_rows(capsys, model64_dir, tmp_path):
    """eval (perplexity and its merge count), cache-prompt and generate from the prompt file, with kv_bits: what a
    user runs, end to end (each read a quantized cache's rows as one array before)."""
    import json

    from kvpolicy_core.apps.cli import main

    m = str(model64_dir)
    assert (
        main(
            ["eval", "--model", m, "--method", "cam", "--method", "h2o", "--budget", "16", "--tokens", "48"]
            + ["--kv-bits", "4", "--kv-group-size", "32", "--no-progress", "--json", str(tmp_path / "e.json")]
        )
        == 0
    )
    results = json.loads((tmp_path / "e.json").read_text())["results"]
    assert [r["spec"] for r in results] == [f"{m}:budget=16,kv_bits=4,kv_group_size=32" for m in ("cam", "h2o")]
    assert results[0]["merges_per_eviction"] is not None and all(r["perplexity"] > 0 for r in results)
    doc = tmp_path / "doc.safetensors"
    spec = "cam:budget=32,kv_bits=8,kv_group_size=32"
    assert main(["cache-prompt", DOC, "--model", m, "--method", spec, "--prompt-cache-file", str(doc), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["method"] == "cam" and summary["tokens_kept"] <= 32
    assert main(["generate", "what opens the blue door?", "--prompt-cache", str(doc), "--max-tokens", "3"]) == 0
