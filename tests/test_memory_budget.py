"""Budgets in bytes: ``kv_memory`` becomes the largest token budget whose kept K/V (and slot positions and scores)
fit on the model, and what the caches then keep is within it."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest
from helpers import tiny_gemma3, tiny_llama
from mlx_lm.generate import generate_step

from kvpolicy_core import KVCacheBuilder
from kvpolicy_core.config.parse import parse_config
from kvpolicy_core.errors import ConfigError
from kvpolicy_core.integration.builder import detach, memory_budget


def kept_bytes(caches) -> int:
    """K/V bytes plus 8 per KV head and slot (int32 position, float32 score), as the caches hold them."""
    total = 0
    for c in caches:
        k, v = c.state[:2]
        total += k.nbytes + v.nbytes + k.shape[0] * k.shape[1] * k.shape[2] * 8
    return total


@pytest.mark.parametrize("make", [tiny_llama, tiny_gemma3], ids=["llama", "gemma3-sliding"])
@pytest.mark.parametrize("limit", ["40kB", "0.1MiB"])
def test_kv_memory_sets_the_largest_budget_whose_kept_bytes_fit(make, limit):
    model = make()
    config = parse_config(f"h2o:kv_memory={limit}")
    try:
        caches = KVCacheBuilder.for_model(model, config)
        chosen = memory_budget(model, config, [c.window for c in caches], [True] * len(caches))
        assert chosen.kept_bytes <= config.kv_memory
        bigger = memory_budget(
            model,
            config.replace(kv_memory=chosen.kept_bytes + chosen.bytes_per_token * 2),
            [c.window for c in caches],
            [True] * len(caches),
        )
        assert bigger.budget > chosen.budget  # the largest that fits: one more token per layer would not
        prompt = mx.random.randint(0, 97, (4 * chosen.budget,), key=mx.random.key(0))
        for _ in zip(generate_step(prompt, model, prompt_cache=caches, prefill_step_size=64), range(4)):
            pass
        assert kept_bytes(caches) <= config.kv_memory  # measured on what the caches hold
        assert kept_bytes(caches) >= 0.9 * chosen.kept_bytes
    finally:
        detach(model)


def test_a_limit_below_the_least_cache_is_refused_naming_kv_memory():
    model = tiny_llama()
    with pytest.raises(ConfigError, match="kv_memory: 100 bytes is less than this method's least cache"):
        KVCacheBuilder.for_model(model, "h2o:kv_memory=100")


@pytest.mark.parametrize(
    "text,want", [("512MB", 512 * 10**6), ("1.5GiB", 3 * 2**29), ("2 gb", 2 * 10**9), (4096, 4096)]
)
def test_sizes_are_read_in_si_and_binary_units(text, want):
    assert parse_config({"method": "cam", "kv_memory": text}).kv_memory == want


@pytest.mark.parametrize("bad", ["0", "-1MB", "lots", "5XB", "nan", "inf"])
def test_a_bad_size_names_the_field(bad):
    with pytest.raises(ConfigError, match="kv_memory"):
        parse_config(f"cam:kv_memory={bad}")


def test_generate_with_kv_memory_says_the_budget_it_chose_and_keeps_within_it(capsys, tiny_model_dir):
    from kvpolicy_core.apps.cli import main

    code = main(
        ["generate", "a prompt long enough to evict " * 4, "--model", str(tiny_model_dir)]
        + ["--method", "h2o:n_sink=2", "--kv-memory", "20kB", "--max-tokens", "6", "--json"]
    )
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "[kv-memory 20kB: budget " in err
    summary = json.loads(err.strip().splitlines()[-1])
    assert 0 < summary["kv_bytes_kept"] <= 20_000 and summary["active_memory_bytes"] > 0
    assert main(["generate", "x", "--model", str(tiny_model_dir), "--kv-memory", "20kB", "--budget", "8"]) == 2
    assert "not both" in capsys.readouterr().err


@pytest.mark.parametrize("bits", [None, 8, 4])
def test_kv_memory_is_measured_by_the_allocator_and_quantized_rows_buy_more_tokens(bits):
    """What MLX's allocator holds after a generation, above the model, is the limit (not only the bytes the caches
    account for: within the allocator's rounding of each buffer), and quantized rows fit more tokens in the same
    limit (8 bits: ~3x the float32 tokens, 4 bits: ~5x, at head dim 64 and group size 32)."""
    import gc

    from kvpolicy_core.testing.tiny_models import tiny_model

    model = tiny_model("llama", head_dim=64, hidden_size=128, num_attention_heads=4, num_key_value_heads=2)
    mx.eval(model.parameters())
    spec = "h2o:kv_memory=512kB" + ("" if bits is None else f",kv_bits={bits},kv_group_size=32")
    config = parse_config(spec)
    try:
        gc.collect()
        mx.synchronize()
        base = mx.get_active_memory()
        caches = KVCacheBuilder.for_model(model, config)
        budget = caches[0].budget
        prompt = mx.random.randint(0, 97, (2 * budget,), key=mx.random.key(0))
        for _ in zip(generate_step(prompt, model, prompt_cache=caches, prefill_step_size=256), range(4)):
            pass
        for c in caches:
            c.settle()
        mx.eval([c.state for c in caches])
        gc.collect()
        mx.synchronize()
        held = mx.get_active_memory() - base
        assert caches[0].tokens_kept == budget
        # the allocator rounds each buffer up (pages): a few kB over the kept bytes on caches this small
        assert held <= 1.05 * config.kv_memory, f"{spec}: MLX holds {held} B above the model, limit {config.kv_memory}"
        assert held >= 0.9 * config.kv_memory
        fp = KVCacheBuilder.for_model(model, parse_config("h2o:kv_memory=512kB"))[0].budget
        assert budget >= {None: 1, 8: 3, 4: 5}[bits] * fp
    finally:
        detach(model)
