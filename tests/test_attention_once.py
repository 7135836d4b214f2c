"""Attention computed once for the observed signal: the same output and the same scores.

The hook's one composed pass (:func:`kvpolicy_core.attention.weights.attention_with_weights`) must give
exactly what mlx-lm's fused attention gives, and the scorer fed its weights exactly what it computed
from its own softmax before: model logits and cache state are compared bit for bit with the previous
path (``before_attention`` + mlx-lm's kernel) for every shipped method, on grouped-query heads,
sliding-window layers and a batch of two.
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest
from helpers import SHIPPED_METHODS, VOCAB, run_chunks, tiny_gemma3, tiny_llama, with_fields

import kvpolicy_core.cache.policy_cache as cache_module
from kvpolicy_core import KVCacheBuilder, PolicyCache
from kvpolicy_core.attention.weights import attention_with_weights


def _inputs(B, Hq, H, S, L, D, dtype, seed=0):
    ks = mx.random.split(mx.random.key(seed), 3)
    q = mx.random.normal((B, Hq, S, D), key=ks[0]).astype(dtype)
    k = mx.random.normal((B, H, L, D), key=ks[1]).astype(dtype)
    v = mx.random.normal((B, H, L, D), key=ks[2]).astype(dtype)
    return q, k, v


def _mask(kind, B, Hq, S, L, dtype):
    """The test masks by name: None and "causal" as they are, "bool" [S, L], "bool4" [B, Hq, S, L] bool,
    "additive4" [B, Hq, S, L] of ``dtype``."""
    if kind == "bool":
        return mx.random.uniform(shape=(S, L), key=mx.random.key(7)) > 0.3
    if kind == "bool4":
        return mx.random.uniform(shape=(B, Hq, S, L), key=mx.random.key(7)) > 0.3
    if kind == "additive4":
        return mx.random.normal((B, Hq, S, L), key=mx.random.key(7)).astype(dtype)
    return kind


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize(
    "shape, mask_kind",
    [
        ((1, 4, 4, 1, 50), None),
        ((2, 8, 2, 1, 50), None),
        ((2, 4, 1, 7, 30), "causal"),
        ((1, 4, 2, 7, 30), "bool"),
        ((2, 4, 2, 7, 30), "additive4"),
        ((2, 4, 2, 1, 30), "bool4"),
        ((2, 4, 2, 1, 30), "additive4"),
        ((1, 4, 1, 1, 30), "causal"),  # decode steps: the compiled graph
    ],
)
def test_one_pass_output_is_mlx_fused_attention_bit_for_bit(dtype, shape, mask_kind):
    B, Hq, H, S, L = shape
    q, k, v = _inputs(B, Hq, H, S, L, 16, dtype)
    mask = _mask(mask_kind, B, Hq, S, L, dtype)
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask=mask)
    out, weights = attention_with_weights(q, k, v, 0.25, mask)
    assert out.dtype == want.dtype and mx.array_equal(out, want)
    out_c, weights_c = attention_with_weights(q, k, v, 0.25, mask, compiled=True)  # a steady-state decode step
    assert mx.array_equal(out_c, want) and mx.array_equal(weights_c, weights)
    assert weights.shape == (B, H, Hq // H, S, L)
    np.testing.assert_allclose(np.array(weights.astype(mx.float32).sum(-1)), 1.0, rtol=1e-2)


def test_a_nan_key_poisons_the_output_as_in_mlx_and_the_scorer_skips_that_row():
    q, k, v = _inputs(1, 4, 2, 1, 12, 8, mx.float32)
    k = k.at[:, 0, 3].add(mx.array(math.nan))
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.3, mask=None)
    out, _ = attention_with_weights(q, k, v, 0.3, None)
    assert mx.array_equal(out, want, equal_nan=True) and bool(mx.isnan(out[:, :2]).all())
    cache = PolicyCache("h2o:budget=32")
    cache.update_and_fetch(k, v)
    out = cache.attend(q, cache.keys[..., : cache.n, :], cache.values[..., : cache.n, :], 0.3, None, None)
    scores = np.array(cache.scores)
    assert np.isfinite(scores).all()
    assert (scores[:, 0] == 0).all() and np.allclose(scores[:, 1].sum(-1), 2.0, rtol=1e-5)  # head 0 poisoned


def _both_paths(monkeypatch, model, method, tokens, chunks):
    """(logits, caches) through the hook's one pass, then through before_attention + mlx-lm's kernel (the
    one pass as the kernel computes it: the grouped product of evicted caches is compared on its own below)."""
    got = []
    real = cache_module.attention_with_weights
    monkeypatch.setattr(cache_module, "attention_with_weights", lambda *a, **k: real(*a, **{**k, "grouped": False}))
    for once in (True, False):
        monkeypatch.setattr(cache_module, "attend_once", lambda n, once=once: once)
        caches = KVCacheBuilder.for_model(model, method)
        got.append((run_chunks(model, caches, tokens, chunks), caches))
    monkeypatch.undo()
    return got


def _assert_same(a, b):
    (la, ca), (lb, cb) = a, b
    assert mx.array_equal(la, lb), float(mx.abs(la - lb).max())
    for x, y in zip(ca, cb):
        for u, w in zip(x.state[:4], y.state[:4]):
            assert mx.array_equal(u, w)
        if getattr(x, "log_weights", None) is not None:
            assert mx.array_equal(x.log_weights, y.log_weights)


@pytest.mark.parametrize("method", SHIPPED_METHODS)
def test_every_shipped_method_gives_the_same_logits_and_caches_through_the_one_pass(monkeypatch, method):
    """Grouped-query heads (4 query heads on 2 KV heads), a batch of 2, prefill chunks and decode steps
    past the budget (evictions, merges, log-weights)."""
    model = tiny_llama(n_kv_heads=2, n_heads=4)
    tokens = mx.random.randint(0, VOCAB, (2, 40), key=mx.random.key(3))
    spec = with_fields(method, "budget=12,n_sink=2")
    _assert_same(*_both_paths(monkeypatch, model, spec, tokens, [16, 5, 1, 1, 1, 7] + [1] * 9))


@pytest.mark.parametrize("method", ["h2o", "cam", "cam:merge=sim_weighted"])
def test_sliding_window_layers_give_the_same_logits_through_the_one_pass(monkeypatch, method):
    model = tiny_gemma3(window=8)
    tokens = mx.random.randint(0, VOCAB, (1, 30), key=mx.random.key(4))
    spec = with_fields(method, "budget=10,n_sink=2")
    _assert_same(*_both_paths(monkeypatch, model, spec, tokens, [12, 1, 1, 1, 5] + [1] * 10))


def test_the_one_pass_is_what_the_hook_runs_for_observed_policies(monkeypatch):
    """The observed scorer gets the weights of the model's pass: no second softmax(q k^T) per step."""
    calls = []
    real = cache_module.attention_with_weights
    monkeypatch.setattr(cache_module, "attention_with_weights", lambda *a, **k: calls.append(1) or real(*a, **k))
    model = tiny_llama()
    tokens = mx.random.randint(0, VOCAB, (1, 20), key=mx.random.key(5))
    run_chunks(model, KVCacheBuilder.for_model(model, "h2o:budget=8"), tokens, [10] + [1] * 10)
    assert len(calls) == 11 * len(model.layers)
    calls.clear()
    run_chunks(model, KVCacheBuilder.for_model(model, "h2o:budget=8,signal=proxy"), tokens, [10] + [1] * 10)
    assert calls == []  # no policy needs the weights: mlx-lm's kernel


def _decode_steps(monkeypatch, option: str) -> list:
    """20 decode steps of an ``h2o:budget=8`` cache through the hook's one pass: (keys attended, the value of
    ``attention_with_weights``'s keyword ``option``) per step."""
    seen = []
    real = cache_module.attention_with_weights
    monkeypatch.setattr(
        cache_module,
        "attention_with_weights",
        lambda q, k, v, *a, **kw: seen.append((k.shape[2], kw.get(option))) or real(q, k, v, *a, **kw),
    )
    cache = PolicyCache("h2o:budget=8")
    keys, values = _inputs(1, 2, 2, 1, 20, 16, mx.float32)[1:]
    q = mx.random.normal((1, 2, 1, 16))
    for i in range(20):
        k, v = cache.update_and_fetch(keys[:, :, i : i + 1], values[:, :, i : i + 1])
        mx.eval(cache.attend(q, k, v, 0.25, None, None))
    return seen


def test_only_a_full_buffers_decode_step_takes_the_compiled_attention(monkeypatch):
    """MLX traces a compiled graph once per shape: a cache that still grows (a new length every step) runs
    the eager ops; once its buffer is full (budget + 1 slots, the steady state) every step is compiled."""
    seen = _decode_steps(monkeypatch, "compiled")
    assert [c for L, c in seen if L < 9] == [False] * 8 and [c for L, c in seen if L == 9] == [True] * 12


@pytest.mark.parametrize("dtype, tol", [(mx.float32, 1e-5), (mx.float16, 2e-3), (mx.bfloat16, 2e-2)])
@pytest.mark.parametrize(
    "shape, mask_kind",
    [
        ((1, 32, 8, 1, 4097, 64), None),  # Llama-3.2-1B's attention at a budget of 4096
        ((2, 8, 2, 1, 50, 16), None),
        ((2, 4, 2, 1, 30, 16), "bool4"),
        ((2, 4, 2, 1, 30, 16), "additive4"),
        ((1, 4, 4, 1, 33, 16), None),  # one query head per KV head
    ],
)
def test_the_grouped_decode_product_is_the_kernels_attention_up_to_rounding(dtype, tol, shape, mask_kind):
    B, Hq, H, S, L, D = shape
    q, k, v = _inputs(B, Hq, H, S, L, D, dtype)
    mask = _mask(mask_kind, B, Hq, S, L, dtype)
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask=mask)
    _, want_w = attention_with_weights(q, k, v, 0.25, mask)
    eager = attention_with_weights(q, k, v, 0.25, mask, grouped=True)
    for compiled in (False, True):
        out, weights = attention_with_weights(q, k, v, 0.25, mask, compiled=compiled, grouped=True)
        # compiled or not (a cache's buffer capacity decides, not its saved state): the same numbers bit for bit
        assert mx.array_equal(out, eager[0]) and mx.array_equal(weights, eager[1])
        assert out.dtype == want.dtype and out.shape == want.shape and weights.shape == want_w.shape
        np.testing.assert_allclose(
            np.array(out.astype(mx.float32)), np.array(want.astype(mx.float32)), rtol=tol, atol=tol
        )
        np.testing.assert_allclose(
            np.array(weights.astype(mx.float32)), np.array(want_w.astype(mx.float32)), rtol=tol, atol=tol
        )
    # prompt chunks (S > 1) never take it: the kernel's numbers exactly
    q7 = _inputs(B, Hq, H, 7, L, D, dtype)[0]
    assert mx.array_equal(
        attention_with_weights(q7, k, v, 0.25, "causal", grouped=True)[0],
        mx.fast.scaled_dot_product_attention(q7, k, v, scale=0.25, mask="causal"),
    )


def test_a_cache_takes_the_grouped_product_once_it_has_evicted(monkeypatch):
    """Until its first eviction a policy cache attends as mlx-lm's kernel does, bit for bit (a cache whose
    budget is never reached reproduces the plain cache: the conformance kit checks it); after, grouped."""
    seen = _decode_steps(monkeypatch, "grouped")
    assert [g for _, g in seen] == [False] * 9 + [True] * 11  # tokens 1..9 all kept (budget + 1 slots), then evictions
