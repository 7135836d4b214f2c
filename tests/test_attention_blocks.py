"""A prompt chunk's attention by blocks of query rows (``kvpolicy_core.attention.blocks``): the logits bit for bit
those of one block on the quantized path (``kv_bits``), within float rounding on a held prompt's decoded rows
(``hold_bits``: mlx-lm's fused kernel); global and sliding-window masks; and a smaller transient."""

from __future__ import annotations

import mlx.core as mx
import pytest

from kvpolicy_core.attention import blocks
from kvpolicy_core.integration.builder import KVCacheBuilder
from kvpolicy_core.testing.tiny_models import VOCAB, tiny_model

TOKENS = mx.random.randint(0, VOCAB, (1, 120), key=mx.random.key(4))


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama", head_dim=64, hidden_size=128, num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture(scope="module")
def gemma():
    return tiny_model(
        "gemma3_text", head_dim=64, hidden_size=128, num_attention_heads=4, num_key_value_heads=1, sliding_window=32
    )


def logits(model, spec, monkeypatch, block_bytes):
    """The logits of a prompt in two chunks and 10 decode steps; ``block_bytes`` None: every chunk in one block."""
    if block_bytes is None:
        monkeypatch.setattr("kvpolicy_core.cache.policy_cache.query_block", lambda *a, **k: None)
    else:
        monkeypatch.setattr(blocks, "BLOCK_BYTES", block_bytes)
    caches = KVCacheBuilder.for_model(model, spec)
    out = [model(TOKENS[:, i : i + 50], cache=caches) for i in (0, 50)]
    out += [model(TOKENS[:, t : t + 1], cache=caches) for t in range(100, 110)]
    return mx.concatenate(out, axis=1)


@pytest.mark.parametrize(
    "spec",
    ["h2o:budget=24,kv_bits=4", "cam:budget=24,hold_bits=8", "snapkv:budget=24,kv_bits=8"],
)
@pytest.mark.parametrize("model_name", ["llama", "gemma"])
def test_blocks_of_query_rows_give_the_same_logits(request, monkeypatch, model_name, spec):
    model = request.getfixturevalue(model_name)
    whole = logits(model, spec, monkeypatch, None)
    monkeypatch.undo()
    calls = []
    original = blocks.by_query_blocks

    def counted(*a, **k):
        calls.append(a[-1])
        return original(*a, **k)

    monkeypatch.setattr("kvpolicy_core.cache.policy_cache.by_query_blocks", counted)
    by_blocks = logits(model, spec, monkeypatch, 16 * 4 * 4 * 100)  # 16 rows a block at ~100 keys
    assert calls, "no layer took the blocks"
    if "hold_bits" in spec:  # decoded rows through mlx-lm's fused kernel: its CPU rows round by block size
        assert mx.allclose(whole, by_blocks, rtol=1e-4, atol=1e-3), mx.abs(whole - by_blocks).max().item()
    else:  # quantized rows: quantized_matmul's rows are independent, bit for bit
        assert mx.array_equal(whole, by_blocks)


def test_a_block_bounds_the_transient():
    """One chunk of 512 queries over 8192 keys, 8 heads, float32: the logits of a 128-row block, not of 512."""
    q = mx.random.normal((1, 8, 512, 64))
    k = mx.random.normal((1, 8, 8192, 64))
    mx.eval(q, k)

    def peak(fn):
        base = mx.get_active_memory()
        mx.reset_peak_memory()
        mx.eval(fn())
        return mx.get_peak_memory() - base

    def attend(qq, m):
        return mx.fast.scaled_dot_product_attention(qq, k, k, scale=0.125, mask=m)

    block = blocks.query_block(512, 8192, 8)
    assert block == 128
    whole = peak(lambda: attend(q, "causal"))
    by_blocks = peak(lambda: blocks.by_query_blocks(attend, q, "causal", 8192, block))
    assert by_blocks < 0.4 * whole


def test_the_held_bytes_cap_a_block():
    """A block's logits [B, Hq, b, L] (float32) take at most the layer's held bytes, never under 16 rows."""
    held = 2 * 8 * 8192 * (64 + 2 * 4)  # 8-bit keys and values of 8192 rows, 8 heads of 64, float32 scales
    assert blocks.query_block(512, 8192, 8) == 128  # BLOCK_BYTES alone
    assert blocks.query_block(512, 8192, 8, held=held) == held // (8 * 8192 * 4) == 36
    assert blocks.query_block(512, 8192, 8, held=1024) == 16
    assert blocks.query_block(512, 8192, 8, held=2**40) == 128  # never above BLOCK_BYTES
    assert blocks.query_block(30, 8192, 8, held=held) is None  # one block holds them


@pytest.mark.parametrize("spec", ["cam:budget=24,hold_bits=8", "h2o:budget=24,kv_bits=4"])
def test_a_layer_blocks_within_its_held_bytes(llama, monkeypatch, spec):
    """Through a model: every chunk's blocks over held or quantized rows are bounded by the bytes attention reads."""
    calls = []
    original = blocks.query_block

    def recorded(S, L, Hq, B=1, held=None):
        calls.append((S, L, Hq, B, held, original(S, L, Hq, B, held=held)))
        return calls[-1][-1]

    monkeypatch.setattr("kvpolicy_core.cache.policy_cache.query_block", recorded)
    monkeypatch.setattr("kvpolicy_core.cache.policy_cache.HELD_BLOCK_FLOOR", 0)  # (a tiny model holds less)
    logits(llama, spec, monkeypatch, 2**40)
    blocked = [c for c in calls if c[-1] is not None]
    assert blocked, calls
    for S, L, Hq, B, held, b in blocked:
        assert held is not None
        assert b == 16 or b * B * Hq * L * 4 <= held


def test_a_held_prompts_blocks_are_never_capped_below_the_floor(llama, monkeypatch):
    """Over a held prompt's decoded rows a block's cap is at least HELD_BLOCK_FLOOR (fewer, larger kernel calls)."""
    caps = []
    original = blocks.query_block

    def recorded(S, L, Hq, B=1, held=None):
        caps.append(held)
        return original(S, L, Hq, B, held=held)

    monkeypatch.setattr("kvpolicy_core.cache.policy_cache.query_block", recorded)
    logits(llama, "cam:budget=24,hold_bits=8", monkeypatch, 2**40)
    assert caps and all(c >= blocks.HELD_BLOCK_FLOOR for c in caps)


def test_rows_of_a_mask():
    assert blocks.rows_of(None, 0, 4, 8, 10) is None
    causal = blocks.rows_of("causal", 2, 4, 8, 10)
    assert causal.shape == (2, 10) and causal[0].tolist() == [True] * 5 + [False] * 5
    arr = mx.ones((1, 1, 8, 10), mx.bool_)
    assert blocks.rows_of(arr, 2, 4, 8, 10).shape == (1, 1, 2, 10)
    with pytest.raises(ValueError, match="causal"):
        blocks.rows_of("sliding", 0, 1, 8, 10)


def test_window_rows_by_blocks_of_queries_and_of_keys_are_the_window_weights(monkeypatch):
    """``observed_rows``: the observation window's weights summed over each KV head's query heads, computed by
    blocks of query rows and (quantized rows) of decoded keys, are the whole pass's numbers (float rounding)."""
    from kvpolicy_core.parts import attention_scorer as a

    q = mx.random.normal((1, 4, 12, 64), key=mx.random.key(1))
    packed = mx.quantize(mx.random.normal((1, 2, 90, 64), key=mx.random.key(2)), group_size=64, bits=4)
    keys = mx.dequantize(*packed, group_size=64, bits=4)
    calls = []

    def key_rows(lo, hi):
        calls.append((lo, hi))
        return mx.dequantize(*[x[..., lo:hi, :] for x in packed], group_size=64, bits=4)

    for mask in (None, "causal", mx.random.uniform(shape=(12, 90), key=mx.random.key(3)) > 0.3):
        whole = a.observed_weights(q, keys, 0.125, mask).sum(axis=2, keepdims=True)
        monkeypatch.setattr(a, "ROWS_BLOCK_BYTES", 4 * 4 * 90 * 5)  # blocks of 5 query rows
        monkeypatch.setattr(a, "KEY_BLOCK", 32)  # keys decoded 32 slots at a time
        calls.clear()
        by_blocks = a.observed_rows(q, keys, 0.125, mask, key_rows)
        assert calls and all(hi - lo <= 32 for lo, hi in calls)
        assert by_blocks.shape == (1, 2, 1, 12, 90)
        assert mx.allclose(by_blocks, whole, rtol=1e-5, atol=1e-6).item()
        assert mx.allclose(a.observed_rows(q, keys, 0.125, mask), whole, rtol=1e-5, atol=1e-6).item()
        monkeypatch.undo()


def test_a_quantized_prompt_is_scored_alike_with_its_keys_decoded_by_blocks(llama, monkeypatch):
    """A held prompt of 4-bit rows scored with its keys decoded 16 slots at a time keeps what the whole pass
    keeps: the same slots and the same logits after the cut (within float rounding)."""
    from kvpolicy_core.parts import attention_scorer as a

    def run():
        caches = KVCacheBuilder.for_model(llama, "cam:budget=24,kv_bits=4")
        out = [llama(TOKENS[:, i : i + 50], cache=caches) for i in (0, 50)]
        out += [llama(TOKENS[:, t : t + 1], cache=caches) for t in range(100, 106)]
        return mx.concatenate(out, axis=1), [mx.sort(c.positions, axis=-1) for c in caches]

    whole, kept = run()
    monkeypatch.setattr(a, "KEY_BLOCK", 16)
    monkeypatch.setattr(a, "ROWS_BLOCK_BYTES", 1024)
    blocked, kept_b = run()
    assert all(mx.array_equal(x, y).item() for x, y in zip(kept, kept_b))
    assert mx.allclose(whole, blocked, rtol=1e-4, atol=1e-4).item()
