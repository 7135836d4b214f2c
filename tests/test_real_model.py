"""Integration tests on the embedded default model (Gemma 3 270M, converted once and cached)."""

import math

import mlx.core as mx
import numpy as np
import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_greedy_continuation_is_sensible(default_gemma):
    import mlx_lm

    model, tok = default_gemma
    text = mlx_lm.generate(model, tok, "The capital of France is", max_tokens=20)
    words = text.split()
    assert len(words) >= 8 and len(set(w.lower() for w in words)) >= 6
    assert sum(ch.isalpha() or ch.isspace() for ch in text) / len(text) > 0.8
    assert "France" in text or "Paris" in text


def test_full_budget_policy_cache_matches_mlx_lm_caches(default_gemma):
    from kvpolicy_core import KVCacheBuilder

    model, tok = default_gemma
    ids = mx.array(tok.encode("The history of the Roman Empire begins with the founding of the city"))[None]
    T = ids.shape[1]
    outs = []
    for caches in (model.make_cache(), KVCacheBuilder.for_model(model, "cam:budget=1024")):
        first = model(ids[:, : T - 4], cache=caches)
        rest = [model(ids[:, t : t + 1], cache=caches) for t in range(T - 4, T)]
        outs.append(np.array(mx.concatenate([first] + rest, axis=1).astype(mx.float32)))
    np.testing.assert_allclose(outs[1], outs[0], rtol=1e-4, atol=1e-4)


def test_cam_generation_below_prompt_length_stays_in_budget(default_gemma):
    import mlx_lm

    from kvpolicy_core import attach, detach

    model, tok = default_gemma
    prompt = " ".join(["The quick brown fox jumps over the lazy dog."] * 12)
    assert len(tok.encode(prompt)) > 64
    caches = None
    attach(model, "cam:budget=48,n_sink=4")
    try:
        caches = model.make_cache()
        logprobs = []
        tokens = []
        for r in mlx_lm.stream_generate(model, tok, prompt, max_tokens=16, prompt_cache=caches):
            tokens.append(r.token)
            logprobs.append(r.logprobs)
    finally:
        detach(model)
    assert len(tokens) == 16
    assert all(not mx.isnan(lp).any().item() for lp in logprobs)
    for c in caches:
        assert c.tokens_kept == 48 and c.offset > 64
        assert math.isfinite(c.compression_ratio) and c.compression_ratio > 1
