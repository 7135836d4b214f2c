"""Peer check: the example StreamingLLM plugin against mlx-lm's own RotatingKVCache.

``streamingllm:budget=B,n_sink=k`` and ``RotatingKVCache(max_size=B + 1, keep=k)`` keep the same
tokens: both attend to B retained tokens plus the new one (the rotating cache counts the new
token in ``max_size``). Slot order differs (both rotate in place); compared in temporal order.

One stated difference: for a multi-token chunk with ``offset + N > max_size`` mlx-lm masks the
chunk with a plain sliding window of ``max_size`` (its sinks drop out of view), while kvpolicy lets
the chunk attend to all retained tokens and the whole chunk. They agree token by token and for
chunks that fit (``prefill_step_size=1`` in ``generate_step``).
"""

import mlx.core as mx
import numpy as np
import pytest
from helpers import VOCAB, run_chunks, tiny_llama
from mlx_lm.models.cache import RotatingKVCache

from kvpolicy_core import KVCacheBuilder

pytest.importorskip("kvpolicy_streaming", reason="examples/kvpolicy-streaming is not installed")

B, K = 15, 3


def peer_caches(model):
    return [RotatingKVCache(max_size=B + 1, keep=K) for _ in model.layers]


def temporal(cache: RotatingKVCache):
    return np.array(cache._temporal_order(cache.keys)), np.array(cache._temporal_order(cache.values))


@pytest.mark.parametrize("chunks", [[1] * 40, [10] + [1] * 30, [16] + [1] * 24])
def test_same_logits_and_retained_tokens_on_a_tiny_model(chunks):
    model = tiny_llama(seed=4)
    toks = mx.random.randint(0, VOCAB, (2, 40), key=mx.random.key(9))
    peers = peer_caches(model)
    ours = KVCacheBuilder.for_model(model, f"streamingllm:budget={B},n_sink={K}")
    want = run_chunks(model, peers, toks, chunks)
    got = run_chunks(model, ours, toks, chunks)
    np.testing.assert_allclose(np.array(got), np.array(want), atol=2e-5)
    for peer, mine in zip(peers, ours):
        pk, pv = temporal(peer)
        order = mx.argsort(mine.positions[..., : mine.n], axis=-1)
        mk = np.array(mx.take_along_axis(mine.keys[..., : mine.n, :], order[..., None], axis=2))
        mv = np.array(mx.take_along_axis(mine.values[..., : mine.n, :], order[..., None], axis=2))
        assert mk.shape == pk.shape == (2, 2, B + 1, 16)
        np.testing.assert_array_equal(mk, pk)
        np.testing.assert_array_equal(mv, pv)


def test_same_generated_tokens(tiny_model_dir):
    import mlx_lm

    model, tok = mlx_lm.load(str(tiny_model_dir))
    prompt = "a prompt that is longer than the streaming window of sixteen tokens"
    outs = []
    for caches in (peer_caches(model), KVCacheBuilder.for_model(model, f"streamingllm:budget={B},n_sink={K}")):
        stream = mlx_lm.stream_generate(model, tok, prompt, max_tokens=30, prompt_cache=caches, prefill_step_size=1)
        outs.append([r.token for r in stream])
    assert outs[0] == outs[1]


@pytest.mark.integration
@pytest.mark.slow
def test_same_tokens_on_the_default_model(default_gemma):
    import mlx_lm

    model, tok = default_gemma
    prompt = "The history of the Roman Empire covers the history of ancient Rome from the fall of the Roman Republic"
    outs, logits = [], []
    budget, sinks = 31, 4
    assert len(tok.encode(prompt)) < budget  # one prefill chunk that fits; the evictions happen while decoding
    for caches in (
        [RotatingKVCache(max_size=budget + 1, keep=sinks) for _ in model.layers],
        KVCacheBuilder.for_model(model, f"streamingllm:budget={budget},n_sink={sinks}"),
    ):
        rs = list(mlx_lm.stream_generate(model, tok, prompt, max_tokens=24, prompt_cache=caches))
        outs.append([r.token for r in rs])
        logits.append(np.stack([np.array(r.logprobs) for r in rs]))
    assert outs[0] == outs[1]
    np.testing.assert_allclose(logits[1], logits[0], atol=1e-3)
