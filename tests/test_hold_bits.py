"""``hold_bits``: a held prompt past the budget is stored quantized until its cut, the kept rows decoded back.

What a user relies on: a prompt within the budget is held exactly (bit for bit); past it, the held rows take a
fraction of the bytes; after the cut the cache is the full-precision policy cache it always was (its kept rows the
held ones, decoded); saving mid-prompt, pickling, batching and mlx-lm's ``kv_bits`` keep working."""

from __future__ import annotations

import pickle

import mlx.core as mx
import pytest
from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

from kvpolicy_core.cache.batch import BatchPolicyCache
from kvpolicy_core.cache.policy_cache import PolicyCache
from kvpolicy_core.errors import ConfigError
from kvpolicy_core.integration.builder import KVCacheBuilder
from kvpolicy_core.testing.tiny_models import VOCAB, tiny_model

TOKENS = mx.random.randint(0, VOCAB, (1, 60), key=mx.random.key(11))


@pytest.fixture(scope="module")
def model64():
    return tiny_model("llama", head_dim=64, hidden_size=128, num_attention_heads=4, num_key_value_heads=2)


def prefill(model, caches, tokens, chunk=16):
    for i in range(0, tokens.shape[1], chunk):
        out = model(tokens[:, i : i + chunk], cache=caches)
    return out


def decode(model, caches, tokens):
    return mx.concatenate([model(tokens[:, t : t + 1], cache=caches) for t in range(tokens.shape[1])], axis=1)


def test_the_shipped_cut_holds_a_long_prompt_at_8_bits():
    """The default: ``hold_bits=8`` under ``when="prompt_end"``; ``hold_bits=none`` holds in full precision."""
    assert PolicyCache("cam:budget=16").policy.config.policy.hold_bits == 8
    assert PolicyCache("h2o:budget=16").policy.config.policy.hold_bits == 8
    assert PolicyCache("cam:budget=16,hold_bits=none").policy.config.policy.hold_bits is None


def test_a_prompt_within_the_budget_is_held_exactly(model64):
    """Nothing past the budget: the rows are never re-encoded, the logits are bit for bit those without hold_bits."""
    plain = KVCacheBuilder.for_model(model64, "cam:budget=80,hold_bits=none")
    held = KVCacheBuilder.for_model(model64, "cam:budget=80,hold_bits=4")
    a = mx.concatenate([prefill(model64, plain, TOKENS[:, :48]), decode(model64, plain, TOKENS[:, 48:])], axis=1)
    b = mx.concatenate([prefill(model64, held, TOKENS[:, :48]), decode(model64, held, TOKENS[:, 48:])], axis=1)
    assert mx.array_equal(a, b)
    assert all(c.storage.bits is None and not hasattr(c, "bits") for c in held)


@pytest.mark.parametrize("bits", [8, 4])
def test_past_the_budget_the_prompt_is_held_quantized_and_the_cut_keeps_full_precision_rows(model64, bits):
    caches = KVCacheBuilder.for_model(model64, f"h2o:budget=16,hold_bits={bits}")
    plain = KVCacheBuilder.for_model(model64, "h2o:budget=16,hold_bits=none")
    prefill(model64, caches, TOKENS[:, :48])
    prefill(model64, plain, TOKENS[:, :48])
    for c, p in zip(caches, plain):
        assert (c.storage.bits, c.bits, c.n) == (bits, bits, 48)  # mlx-lm's attention takes its quantized path
        assert c.nbytes < (0.35 if bits == 8 else 0.2) * p.nbytes  # the held prompt's bytes
    logits = decode(model64, caches, TOKENS[:, 48:52])
    ref = decode(model64, plain, TOKENS[:, 48:52])
    for c in caches:
        assert c.storage.bits is None and not hasattr(c, "bits") and c.tokens_kept <= 16
        assert c.keys.dtype == mx.float32
    assert mx.isfinite(logits).all()
    assert mx.abs(logits - ref).max().item() < (0.05 if bits == 8 else 0.5)  # the quantization error only


def test_the_kept_rows_are_the_held_rows_decoded(model64):
    """A cache driven by hand (proxy signal: the cut scores the same with or without hold_bits): the kept keys are
    ``dequantize(quantize(k))`` of the same tokens the full-precision hold keeps."""
    spec = "h2o:budget=20,when=prompt_end,signal=proxy"
    held, plain = PolicyCache(spec + ",hold_bits=8"), PolicyCache(spec + ",hold_bits=none")
    keys = mx.random.normal((1, 2, 50, 64), key=mx.random.key(1))
    for c in (held, plain):
        c.update_and_fetch(keys, keys)
        c.update_and_fetch(keys[:, :, :1], keys[:, :, :1])
    assert mx.array_equal(held.positions[..., : held.n], plain.positions[..., : plain.n])
    k = plain.keys[..., : plain.n, :]
    roundtrip = mx.dequantize(*mx.quantize(k, group_size=64, bits=8), group_size=64, bits=8)
    assert mx.array_equal(held.keys[..., : held.n - 1, :], roundtrip[..., :-1, :])  # the decode token: exact
    assert mx.array_equal(held.keys[..., held.n - 1, :], k[..., -1, :])


def test_a_prompt_saved_while_held_resumes_bit_for_bit(model64, tmp_path):
    caches = KVCacheBuilder.for_model(model64, "cam:budget=16,hold_bits=8")
    prefill(model64, caches, TOKENS[:, :48])
    path = str(tmp_path / "held.safetensors")
    save_prompt_cache(path, caches)
    loaded = load_prompt_cache(path)
    copies = [pickle.loads(pickle.dumps(c)) for c in caches]
    assert all(c.storage.bits == 8 for c in loaded + copies)
    ref = decode(model64, caches, TOKENS[:, 48:52])
    assert mx.array_equal(ref, decode(model64, loaded, TOKENS[:, 48:52]))
    assert mx.array_equal(ref, decode(model64, copies, TOKENS[:, 48:52]))
    assert all(c.storage.bits is None for c in loaded + copies)


def test_batched_rows_hold_their_prompt_as_they_keep_it(model64):
    rows = []
    for r in range(2):
        caches = KVCacheBuilder.for_model(model64, "h2o:budget=16,hold_bits=8")
        prefill(model64, caches, TOKENS[:, : 40 + r])
        rows.append(caches)
    assert rows[0][0].storage.bits == 8
    batch = [BatchPolicyCache.merge([rows[0][i], rows[1][i]]) for i in range(len(model64.layers))]
    assert not hasattr(batch[0], "bits")
    out = model64(mx.concatenate([TOKENS[:, 50:51]] * 2), cache=batch)
    assert mx.isfinite(out).all() and all(r.tokens_kept <= 16 for b in batch for r in b.rows)


def test_mlx_lms_kv_bits_while_a_prompt_is_held_quantizes_the_kept_rows(model64):
    caches = KVCacheBuilder.for_model(model64, "h2o:budget=16,hold_bits=8")
    prefill(model64, caches, TOKENS[:, :48])
    caches = [c.to_quantized(group_size=64, bits=4) for c in caches]
    assert all(c.storage.bits == 4 and c.bits == 4 for c in caches)
    decode(model64, caches, TOKENS[:, 48:50])
    assert all(c.storage.bits == 4 and c.bits == 4 and c.tokens_kept <= 16 for c in caches)


def test_bad_hold_bits_name_the_field():
    with pytest.raises(ConfigError, match="hold_bits"):
        PolicyCache("cam:budget=16,hold_bits=5")
