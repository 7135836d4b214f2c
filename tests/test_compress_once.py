"""Compress once (KVzip): the reconstruction score as documented, exactly budget tokens kept per head with the sinks,
decoding continuing exactly from the kept set, a prompt-cache file that continues bit for bit in a new process,
the long-context suite running it, and clear errors."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import mlx.core as mx
import mlx_lm.models.llama as llama_module
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache

from kvpolicy_core.errors import ConfigError
from kvpolicy_core.integration import reconstruction
from kvpolicy_core.integration.compress_once import RepeatPrompt, compress_context, split_spec
from kvpolicy_core.integration.reconstruction import ReconstructionCache, repeat_chunks
from kvpolicy_core.testing.tiny_models import tiny_llama, tiny_model

L = 60
IDS = [int(t) for t in np.random.RandomState(3).randint(1, 90, size=L)]
REPEAT = RepeatPrompt(first=(7, 8, 9), later=(10, 11), suffix=(12,), tail=3)
CHUNK = 25  # three reconstruction chunks
EXACT = "h2o:budget=20,n_sink=3,pool=1"  # the reconstruction score itself decides the cut (no pooling)


@pytest.fixture(scope="module")
def model():
    return tiny_llama(n_kv_heads=2, n_heads=4, layers=2, seed=1)


@pytest.fixture(scope="module")
def compressed(model):
    return compress_context(model, IDS, EXACT, scorer="kvzip-layerwise", prefill_step=128, repeat=REPEAT, chunk=CHUNK)


def _record_attention(monkeypatch, module) -> list:
    """Record (queries, keys, scale, mask) of every attention call of ``module``'s model from now on."""
    seen = []
    original = module.scaled_dot_product_attention

    def record(queries, keys, values, cache, scale, mask, *a, **k):
        seen.append((queries, keys, scale, mask))
        return original(queries, keys, values, cache=cache, scale=scale, mask=mask)

    monkeypatch.setattr(module, "scaled_dot_product_attention", record)
    return seen


def _float64(seen) -> list:
    """(queries, keys, scale) of recorded calls as float64 NumPy arrays."""
    return [(np.array(q.astype(mx.float32), np.float64), np.array(k, np.float64), scale) for q, k, scale, _ in seen]


def _causal_softmax(q: np.ndarray, k: np.ndarray, scale: float) -> np.ndarray:
    """softmax(scale q k^T) over causal positions: q [1, Hq, T, D], k [1, H, T, D] -> [1, Hq, T, T]."""
    T, G = q.shape[2], q.shape[1] // k.shape[1]
    logits = scale * np.einsum("bhtd,bhsd->bhts", q, np.repeat(k, G, axis=1))
    logits = np.where(np.tril(np.ones((T, T), bool)), logits, -np.inf)
    w = np.exp(logits - logits.max(-1, keepdims=True))
    return w / w.sum(-1, keepdims=True)


def _reference_scores(model, monkeypatch, n_sink=None) -> list:
    """NumPy: each reconstruction chunk fed after the context in one causal pass; softmax of the recorded queries
    and keys; the max over query heads of a group and the chunk's rows of the weights on each context key. With
    ``n_sink``, kvpress's normalisation: chunk c scores only its span, its weights renormalised over the sinks,
    the span and the repeat tokens."""
    seen = _record_attention(monkeypatch, llama_module)
    best = None
    for c, chunk in enumerate(repeat_chunks(IDS, REPEAT.first, REPEAT.later, REPEAT.suffix, CHUNK, REPEAT.tail)):
        a, b = c * CHUNK, min(L, (c + 1) * CHUNK)
        seen.clear()
        caches = [KVCache() for _ in model.layers]
        mx.eval(model(mx.array(IDS + chunk, dtype=mx.uint32)[None], cache=caches))
        per_layer = []
        for q, k, scale in _float64(seen):
            _, Hq, T, _ = q.shape
            H = k.shape[1]
            w = _causal_softmax(q, k, scale)[:, :, L:]
            if n_sink is not None:
                keep = np.zeros(T, bool)
                keep[: min(n_sink, a)] = keep[a:b] = keep[L:] = True
                w = np.where(keep, w / (w * keep).sum(-1, keepdims=True), 0.0)
                w[..., :L][..., ~((np.arange(L) >= a) & (np.arange(L) < b))] = 0.0
            per_layer.append(w[..., :L].reshape(1, H, Hq // H, T - L, L).max(axis=(2, 3)))
        best = per_layer if best is None else [np.maximum(a, b) for a, b in zip(best, per_layer)]
    return best


def test_reconstruction_score_matches_a_numpy_reference(model, compressed, monkeypatch):
    want = _reference_scores(model, monkeypatch)
    monkeypatch.undo()
    monkeypatch.setattr(ReconstructionCache, "rows", 7)  # query rows in blocks (a chunk has 25-30 rows)
    monkeypatch.setattr(reconstruction, "ROWS", 7)  # and the prefill's chunks (16-128 rows) by blocks too
    blocked = compress_context(model, IDS, EXACT, prefill_step=128, repeat=REPEAT, chunk=CHUNK)
    for got, ref in zip(blocked.scores, want):
        np.testing.assert_allclose(got, ref, atol=2e-5, rtol=1e-4)
    assert len(compressed.scores) == len(want) == 2
    for got, ref in zip(compressed.scores, want):
        assert got.shape == ref.shape == (1, 2, L)
        np.testing.assert_allclose(got, ref, atol=2e-5, rtol=1e-4)
        assert ref.max() > 0.05  # the reconstruction attends the context (not an all-zero match)


def test_row_blocks_on_any_number_of_streams_give_the_same_scores(model, monkeypatch):
    """The prefill's and the reconstruction's row blocks alternate over CPU streams (one per core): how many
    streams there are changes where blocks run, never the scores or the kept tokens (bit for bit)."""
    monkeypatch.setattr(ReconstructionCache, "rows", 7)
    monkeypatch.setattr(reconstruction, "ROWS", 7)
    runs = []
    for n in (1, 3):
        streams = [mx.default_stream(mx.cpu)] + [mx.new_stream(mx.cpu) for _ in range(n - 1)]
        monkeypatch.setattr(reconstruction, "row_streams", lambda s=streams: s)
        runs.append(compress_context(model, IDS, EXACT, prefill_step=128, repeat=REPEAT, chunk=CHUNK))
    one, three = runs
    for a, b in zip(one.scores, three.scores):
        np.testing.assert_array_equal(a, b)
    assert [k.tolist() for k in one.kept] == [k.tolist() for k in three.kept]


def test_per_chunk_normalisation_matches_kvpress_rule_in_a_numpy_reference(model, monkeypatch):
    want = _reference_scores(model, monkeypatch, n_sink=3)
    monkeypatch.undo()
    monkeypatch.setattr(ReconstructionCache, "rows", 7)
    got = compress_context(model, IDS, EXACT, prefill_step=128, repeat=REPEAT, chunk=CHUNK, normalise="chunk")
    for g, ref in zip(got.scores, want):
        np.testing.assert_allclose(g, ref, atol=2e-5, rtol=1e-4)
    # one pass gives both: the whole-context scores ride along with the per-chunk ones
    from kvpolicy_core.integration.compress_once import prefill_full
    from kvpolicy_core.integration.reconstruction import reconstruction_scores

    contexts = prefill_full(model, IDS, 128)
    chunks = repeat_chunks(IDS, REPEAT.first, REPEAT.later, REPEAT.suffix, CHUNK, REPEAT.tail)
    whole = []
    spans = [(a, min(L, a + CHUNK)) for a in range(0, L, CHUNK)]
    per_chunk = reconstruction_scores(model, contexts, chunks, spans, 3, whole=whole)
    for g, w, c, ref in zip(got.scores, whole, per_chunk, _reference_scores(model, monkeypatch)):
        np.testing.assert_allclose(np.array(c), g, atol=2e-5, rtol=1e-4)
        np.testing.assert_allclose(np.array(w), ref, atol=2e-5, rtol=1e-4)
    monkeypatch.undo()
    with pytest.raises(ConfigError, match="normalise must be one of 'context', 'chunk'"):
        compress_context(model, IDS, "h2o:budget=20", normalise="span")


def _window_reference(model, monkeypatch, W: int) -> list:
    """NumPy: the context in one causal pass; per layer the max over a group's query heads and the last W query
    rows of the softmax weights on each context key."""
    seen = _record_attention(monkeypatch, llama_module)
    mx.eval(model(mx.array(IDS, dtype=mx.uint32)[None], cache=[KVCache() for _ in model.layers]))
    monkeypatch.undo()
    out = []
    for q, k, scale in _float64(seen):
        _, Hq, T, _ = q.shape
        H = k.shape[1]
        w = _causal_softmax(q, k, scale)
        out.append(w[:, :, T - W :].reshape(1, H, Hq // H, W, T).max(axis=(2, 3)))
    return out


def test_an_observation_window_adds_the_last_queries_attention_to_the_cut(model, monkeypatch):
    W = 6
    window = _window_reference(model, monkeypatch, W)
    kvzip = _reference_scores(model, monkeypatch)
    monkeypatch.undo()
    got = compress_context(model, IDS, EXACT + f",obs_window={W}", prefill_step=16, repeat=REPEAT, chunk=CHUNK)
    for g, ref_zip, ref_win in zip(got.scores, kvzip, window):
        assert (ref_win > ref_zip + 1e-3).any()  # the window raises some scores: the test can tell the two apart
        np.testing.assert_allclose(g, np.maximum(ref_zip, ref_win), atol=2e-5, rtol=1e-4)
    # kept: the top of the combined score (sinks first), a fresh cut without the window keeps another set
    plain = compress_context(model, IDS, EXACT, prefill_step=16, repeat=REPEAT, chunk=CHUNK)
    assert any(not np.array_equal(a, b) for a, b in zip(got.kept, plain.kept))
    with pytest.raises(ConfigError, match="obs_window=0"):
        compress_context(model, IDS, EXACT + ",obs_window=0", repeat=REPEAT, chunk=CHUNK)


def test_the_window_of_one_query_is_that_querys_attention_on_sliding_window_layers_too(monkeypatch):
    """Gemma 3 (global and sliding-window layers): W = 1 gives the last query's own attention weights, as the
    model computed them with a plain cache (its window mask included), max over each KV head's query heads."""
    import mlx_lm.models.gemma3_text as gemma_module
    from helpers import tiny_gemma3

    from kvpolicy_core.integration.compress_once import prefill_full
    from kvpolicy_core.integration.reconstruction import window_scores

    gemma = tiny_gemma3(window=8)
    caches = [KVCache() for _ in gemma.layers]
    mx.eval(gemma(mx.array(IDS[:-1], dtype=mx.uint32)[None], cache=caches))
    seen = _record_attention(monkeypatch, gemma_module)
    mx.eval(gemma(mx.array(IDS[-1:], dtype=mx.uint32)[None], cache=caches))
    monkeypatch.undo()
    got = window_scores(gemma, prefill_full(gemma, IDS, 16, extra=1), IDS, 1)
    windowed = 0
    for g, (q, k, scale, mask) in zip(got, seen):
        Hq, H = q.shape[1], k.shape[1]
        logits = scale * (q.astype(mx.float32) @ mx.repeat(k.astype(mx.float32), Hq // H, axis=1).swapaxes(-1, -2))
        if isinstance(mask, mx.array):
            windowed += 1
            logits = mx.where(mask, logits, -math.inf) if mask.dtype == mx.bool_ else logits + mask
        w = mx.softmax(logits, axis=-1)[:, :, 0].reshape(1, H, Hq // H, L).max(axis=2)
        np.testing.assert_allclose(np.array(g), np.array(w), atol=2e-5, rtol=1e-4)
    assert windowed == 4  # the sliding-window layers: they see only the last 8 positions
    for g, (_, _, _, mask) in zip(got, seen):
        if isinstance(mask, mx.array):
            assert (np.array(g)[..., : L - 8] == 0).all()


def test_each_head_keeps_exactly_budget_tokens_the_sinks_and_the_top_scores(compressed):
    for layer, (cache, s) in enumerate(zip(compressed.caches, compressed.scores)):
        assert cache.offset == L and cache.n == 20
        keys, _, positions, scores, _ = cache.state
        assert keys.shape[2] == 20
        pos = np.array(positions)
        for h in range(2):
            rest = np.argsort(-s[0, h, 3:], kind="stable")[:17] + 3
            want = np.sort(np.concatenate([[0, 1, 2], rest]))
            assert pos[0, h].tolist() == want.tolist(), (layer, h)
            np.testing.assert_array_equal(np.array(scores)[0, h], s[0, h, want].astype(np.float32))
        assert not np.array_equal(pos[0, 0], pos[0, 1]) or layer  # heads choose their own tokens


def test_a_pooled_cut_keeps_the_top_of_the_max_pooled_scores(model, compressed):
    pooled = compress_context(
        model, IDS, "h2o:budget=20,n_sink=3,pool=5", scorer="kvzip-layerwise", prefill_step=128, repeat=REPEAT,
        chunk=CHUNK,
    )  # fmt: skip
    for raw, cache, s in zip(compressed.scores, pooled.caches, pooled.scores):
        want_s = np.stack(
            [[[raw[b, h, max(0, j - 2) : j + 3].max() for j in range(L)] for h in range(2)] for b in range(1)]
        )
        np.testing.assert_allclose(s, want_s, rtol=1e-6)
        pos = np.array(cache.state[2])
        for h in range(2):
            rest = np.argsort(-s[0, h, 3:], kind="stable")[:17] + 3
            assert pos[0, h].tolist() == np.sort(np.concatenate([[0, 1, 2], rest])).tolist()


class _Kept:
    """A plain cache of given keys/values at a given offset (new tokens appended): the hand-built reference."""

    def __init__(self, keys, values, offset):
        self.keys, self.values, self.offset = keys, values, offset

    def update_and_fetch(self, k, v):
        self.keys = mx.concatenate([self.keys, k], axis=2)
        self.values = mx.concatenate([self.values, v], axis=2)
        self.offset += k.shape[2]
        return self.keys, self.values

    def make_mask(self, N, window_size=None, return_array=False):
        return None


def test_next_decode_step_equals_a_cache_built_by_hand_from_the_kept_set(model, compressed):
    full = [KVCache() for _ in model.layers]
    model(mx.array(IDS[:-1], dtype=mx.uint32)[None], cache=full)
    model(mx.array(IDS[-1:], dtype=mx.uint32)[None], cache=full)

    def hand(offset):
        out = []
        for c, kept in zip(full, compressed.kept):
            idx = mx.array(kept)[..., None]
            keys, values = (mx.take_along_axis(x[..., :L, :], idx, 2) for x in (c.keys, c.values))
            out.append(_Kept(keys, values, offset))
        return out

    tok = mx.array([[42]], dtype=mx.uint32)
    got = model(tok, cache=compressed.caches)
    assert all(c.offset == L + 1 for c in compressed.caches)
    want = model(tok, cache=hand(L))  # the next query is rotated to position L
    np.testing.assert_array_equal(np.array(got), np.array(want))
    # the same kept set at another offset gives other logits: the positions matter
    assert not np.allclose(np.array(model(tok, cache=hand(20))), np.array(want), atol=1e-4)


def test_kvzip_shares_the_models_budget_out_over_the_layers_by_one_ranking(model):
    out = compress_context(model, IDS, EXACT, prefill_step=128, repeat=REPEAT, chunk=CHUNK)
    budgets = [c.budget for c in out.caches]
    assert abs(sum(budgets) - 20 * len(budgets)) <= len(budgets) and len(set(budgets)) > 1
    ranked = [np.where(np.arange(L) < 3, np.inf, s[0]) for s in out.scores]  # sinks first
    entries = sorted(((-x, l) for l, r in enumerate(ranked) for x in r.reshape(-1)), key=lambda e: e[0])
    share = np.bincount([l for _, l in entries[: 2 * 20 * len(budgets)]], minlength=len(budgets))
    for cache, s, kept, n in zip(out.caches, out.scores, out.kept, share):
        assert cache.n == cache.budget == kept.shape[-1] and cache.offset == L
        assert cache.budget == round(n / 2)  # its share of the model's (layers x heads x budget) best keys, per head
        for h in range(2):  # and within the layer, its own best keys
            rest = np.argsort(-s[0, h, 3:], kind="stable")[: cache.budget - 3] + 3
            assert kept[0, h].tolist() == np.sort(np.concatenate([[0, 1, 2], rest])).tolist()


def test_a_layer_share_guarantees_each_layer_part_of_the_budget_and_ranks_the_rest():
    from kvpolicy_core.integration.compress_once import model_budgets

    rng = np.random.default_rng(0)
    high, low = rng.random((1, 2, 64)) + 10, rng.random((1, 2, 64))  # layer 0's keys outrank layer 1's
    window = rng.random((1, 2, 64)) + 20
    window[..., :40] = -np.inf  # a window layer: 24 live positions
    keys = [high, low, window]
    assert model_budgets(keys, 16, 3, 64) == [24, 3, 24]  # one ranking: 48 per head; the floor of 3 for layer 1
    # share 0.5: every layer's own best 8 first, then the best 48 of the rest: the window layer's 16 others, 8 more
    assert model_budgets(keys, 16, 3, 64, share=0.5) == [16, 8, 24]
    assert model_budgets(keys, 16, 3, 64, share=1.0) == [16, 16, 16]
    window[..., :56] = -np.inf  # 8 live positions: the window layer is guaranteed those, the rest goes elsewhere
    assert model_budgets(keys, 16, 3, 64, share=0.5) == [32, 8, 8]
    assert all(np.array_equal(k, np.where(np.arange(64) < 56, -np.inf, k)) for k in [window])  # inputs unchanged


def test_the_cut_pools_over_three_positions_unless_the_method_gives_its_pool(model, compressed):
    from kvpolicy_core.integration.compress_once import CUT_POOL, pooled_scores

    assert CUT_POOL == 3
    default = compress_context(model, IDS, "h2o:budget=20,n_sink=3", scorer="kvzip-layerwise", prefill_step=128,
                               repeat=REPEAT, chunk=CHUNK)  # fmt: skip
    for raw, s in zip(compressed.scores, default.scores):  # compressed: pool=1, the raw scores
        np.testing.assert_array_equal(s, pooled_scores(raw, 3))
        assert not np.array_equal(s, pooled_scores(raw, 15))


def test_one_scoring_cut_to_several_budgets_is_each_budgets_own_compression(model):
    from kvpolicy_core.config.parse import parse_config
    from kvpolicy_core.integration.compress_once import cut, score_context

    contexts, scores = score_context(model, IDS, 3, prefill_step=128, repeat=REPEAT, chunk=CHUNK, normalise="context")
    for budget in (12, 20):
        spec = f"cam:budget={budget},n_sink=3"
        alone = compress_context(model, IDS, spec, prefill_step=128, repeat=REPEAT, chunk=CHUNK).caches
        shared = cut(model, parse_config(spec), contexts, scores, L).caches
        for a, b in zip(alone, shared):
            assert a.budget == b.budget and a.offset == b.offset == L
            for x, y in zip(a.state[:4], b.state[:4]):
                np.testing.assert_array_equal(np.array(x), np.array(y))


def test_window_layers_never_keep_more_than_their_live_window():
    gemma = tiny_model("gemma3_text")  # window 8 on layers 0 and 2
    out = compress_context(gemma, IDS, "cam:budget=20,n_sink=2", prefill_step=128, chunk=CHUNK)
    for cache, kept in zip(out.caches, out.kept):
        if cache.window is not None:  # the sinks and the live window at most: the rest goes to global layers
            assert cache.n <= 2 + cache.window - 1 and set(kept[0, 0].tolist()) <= {0, 1, *range(L - 7, L)}
        else:
            assert cache.n > 20
    logits = gemma(mx.array([[5]], dtype=mx.uint32), cache=out.caches)
    assert np.isfinite(np.array(logits)).all()


def test_window_layers_get_no_budget_beyond_their_live_window_when_the_global_layers_cannot_take_it_all():
    """Budget 100 of 200 tokens on three window-8 layers and one global layer: the model's 4 x 100 tokens per head
    exceed the 200 + 3 x 7 live ones; the rest is not handed to a window layer (before: layer 0 kept 186 tokens,
    179 of them outside every future query's window)."""
    from kvpolicy_core.config.parse import parse_config
    from kvpolicy_core.integration.compress_once import min_budget

    gemma = tiny_model("gemma3_text", sliding_window_pattern=4)  # layers 0-2: window 8; layer 3: global
    ids = [int(t) for t in np.random.RandomState(5).randint(1, 90, size=200)]
    method = "cam:budget=100,n_sink=2"
    out = compress_context(gemma, ids, method, prefill_step=128, chunk=64)
    floor = min_budget(parse_config(method))
    windows = [c for c in out.caches if c.window is not None]
    assert len(windows) == 3
    for cache, kept in zip(out.caches, out.kept):
        if cache.window is not None:
            assert cache.n <= max(floor, cache.window - 1), (cache.layer, cache.n)
            assert set(range(200 - cache.window + 1, 200)) <= set(kept[0, 0].tolist())  # every live token kept
        else:
            assert cache.n == 200 - 1 or cache.n >= 100
    logits = gemma(mx.array([[5]], dtype=mx.uint32), cache=out.caches)
    assert np.isfinite(np.array(logits)).all()


def test_window_layers_keep_their_live_window():
    gemma = tiny_model("gemma3_text")  # window 8 on layers 0 and 2
    out = compress_context(
        gemma, IDS, "cam:budget=20,n_sink=2", scorer="kvzip-layerwise", prefill_step=128, chunk=CHUNK
    )
    for cache, kept in zip(out.caches, out.kept):
        if cache.window is not None:  # the positions the next query can see are all kept, and only those
            assert cache.offset == L and cache.n == cache.window - 1 and cache.budget == 20
            assert set(range(L - cache.window + 1, L)) == set(kept[0, 0].tolist())
        else:
            assert cache.offset == L and cache.n == 20
            assert {0, 1} <= set(kept[0, 0].tolist())
    logits = gemma(mx.array([[5]], dtype=mx.uint32), cache=out.caches)
    assert np.isfinite(np.array(logits)).all()


@pytest.mark.parametrize("window, mask_kind", [(None, "causal"), (None, "array"), (40, "array")])
def test_blocked_attention_is_the_one_call_attention(monkeypatch, window, mask_kind):
    """Blocks of rows, each over the keys it can see (causal frontier, window start), give the model's attention
    of the whole chunk: GQA, queries at the end of the keys, a causal or a windowed mask."""
    from mlx_lm.models.base import scaled_dot_product_attention
    from mlx_lm.models.cache import create_causal_mask

    monkeypatch.setattr(reconstruction, "ROWS", 16)
    rng = np.random.RandomState(0)
    S, T = 70, 110
    q, k, v = (mx.array(rng.randn(*shape).astype(np.float32)) for shape in ((1, 4, S, 8), (1, 2, T, 8), (1, 2, T, 8)))
    mask = create_causal_mask(S, T - S, window_size=window)
    if mask_kind == "causal":  # what mlx-lm's KVCache hands a chunk (a window mask is always an array)
        mask = "causal"
    got = reconstruction.blocked_attention(q, k, v, 0.3, mask, scaled_dot_product_attention, window)
    want = scaled_dot_product_attention(q, k, v, None, 0.3, mask)
    np.testing.assert_allclose(np.array(got), np.array(want), atol=1e-5, rtol=1e-5)


def test_window_layers_hold_their_window_and_score_as_if_they_held_the_whole_context(monkeypatch):
    """A sliding-window layer's prefill holds its last ``w + extra`` keys only (what mlx-lm's RotatingKVCache
    attends): its K/V, reconstruction scores (both normalisations) and observation-window scores equal those of
    a plain cache holding every position (whose earlier positions the window gives weight 0)."""
    from kvpolicy_core.integration.compress_once import prefill_full
    from kvpolicy_core.integration.reconstruction import Context, reconstruction_scores, window_scores

    monkeypatch.setattr(reconstruction, "ROWS", 5)  # the prefill's chunks and the repeat chunks' rest by blocks
    gemma = tiny_model("gemma3_text")  # window 8 on layers 0 and 2
    caches = [KVCache() for _ in gemma.layers]
    for a, b in ((0, 16), (16, 32), (32, 48), (48, L - 1), (L - 1, L)):  # prefill_full's chunks of 16
        mx.eval(gemma(mx.array(IDS[a:b], dtype=mx.uint32)[None], cache=caches))
    everything = [Context(c.keys[..., :L, :], c.values[..., :L, :]) for c in caches]
    held = prefill_full(gemma, IDS, 16, extra=3)
    assert [c.start for c in held] == [L - 11, 0, L - 11, 0]  # window 8 + 3 window queries
    for h, e in zip(held, everything):
        np.testing.assert_allclose(np.array(h.keys), np.array(e.keys[..., h.start :, :]), atol=1e-5, rtol=1e-5)
    chunks = repeat_chunks(IDS, REPEAT.first, REPEAT.later, REPEAT.suffix, CHUNK, REPEAT.tail)
    spans = [(a, min(L, a + CHUNK)) for a in range(0, L, CHUNK)]
    for sp in (None, spans):
        for h, e in zip(*(reconstruction_scores(gemma, c, chunks, sp, 2) for c in (held, everything))):
            np.testing.assert_allclose(np.array(h), np.array(e), atol=2e-6, rtol=1e-4)
    for h, e in zip(window_scores(gemma, held, IDS, 3), window_scores(gemma, everything, IDS, 3)):
        np.testing.assert_allclose(np.array(h), np.array(e), atol=2e-6, rtol=1e-4)
    with pytest.raises(ValueError, match="does not hold the 3 window queries"):
        window_scores(gemma, prefill_full(gemma, IDS, 16, extra=1), IDS, 3)


def test_bad_input_is_refused_with_the_field_named(model):
    with pytest.raises(ConfigError, match="budget"):
        compress_context(model, IDS, "h2o:budget=60,n_sink=3")
    with pytest.raises(ConfigError, match="scorer must be one of kvzip"):
        compress_context(model, IDS, "h2o:budget=20", scorer="snapkv")
    with pytest.raises(ConfigError, match="chunk"):
        compress_context(model, IDS, "h2o:budget=20", chunk=0)
    with pytest.raises(ConfigError, match="SCORER\\+METHOD"):
        split_spec("zip+h2o:budget=20")
    assert split_spec("h2o:budget=20") is None
    from kvpolicy_core.eval.perplexity import make_caches

    with pytest.raises(ConfigError, match="long-context suite"):
        make_caches(model, "kvzip+h2o:budget=20")


_CONTINUE = """
from kvpolicy_core.runtime.blas import load_optimized_blas
load_optimized_blas(quiet=True)  # the BLAS this test process runs with (conftest)
import sys, mlx.core as mx, numpy as np, mlx_lm
from kvpolicy_core.apps.prompt_file import load_prompt_file
model, tok = mlx_lm.load(sys.argv[1])
caches, _, info = load_prompt_file(sys.argv[2], model)
ids = mx.array([int(t) for t in sys.argv[3].split(",")], dtype=mx.uint32)[None]
np.save(sys.argv[4], np.array(model(ids, cache=caches)[0, -1]))
"""


def test_prompt_file_continues_bit_for_bit_in_a_new_process(tiny_model_dir, tmp_path):
    import mlx_lm

    from kvpolicy_core.apps.prompt_file import cache_prompt, document_ids, file_metadata
    from kvpolicy_core.integration.compress_once import repeat_prompt

    model, tok = mlx_lm.load(str(tiny_model_dir))
    doc = "the secret number is 4821. " + "the quick brown fox jumps over the lazy dog. " * 3
    path = tmp_path / "doc.safetensors"
    summary = cache_prompt(
        model, tok, doc, "h2o:budget=40,n_sink=2", path, model_path=str(tiny_model_dir), compress_once="kvzip"
    )
    ids = document_ids(tok, doc)
    here = compress_context(model, ids, "h2o:budget=40,n_sink=2", repeat=repeat_prompt(tok)).caches
    assert summary["compress_once"] == "kvzip" and summary["max_tokens_kept"] == max(c.n for c in here)
    assert summary["tokens_kept"] == sum(c.n for c in here) / len(here) == 40  # the budget: per layer on average
    assert len({c.budget for c in here}) > 1  # per-layer budgets, each restored with its layer
    assert file_metadata(path)[1]["compress_once"] == "kvzip"
    question = [int(t) for t in tok.encode("what is the number?")]
    want = np.array(model(mx.array(question, dtype=mx.uint32)[None], cache=here)[0, -1])
    out = tmp_path / "logits.npy"
    proc = subprocess.run(
        [sys.executable, "-c", _CONTINUE, str(tiny_model_dir), str(path), ",".join(map(str, question)), str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    np.testing.assert_array_equal(np.load(out), want)


def test_cache_prompt_cli_compresses_once(tiny_model_dir, tmp_path, capsys):
    from kvpolicy_core.apps.cli import main

    doc = tmp_path / "doc.txt"
    doc.write_text("the secret number is 4821. " * 6)
    path = tmp_path / "c.safetensors"
    args = ["cache-prompt", "--model", str(tiny_model_dir), "--file", str(doc), "--prompt-cache-file", str(path)]
    assert main(args + ["--method", "cam:budget=32,n_sink=2", "--compress-once", "kvzip-layerwise", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["compress_once"] == "kvzip-layerwise" and summary["tokens_kept"] == 32
    assert summary["tokens_seen"] > 100
    assert main(args + ["--method", "kvzip+h2o:budget=30,n_sink=2", "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    per_layer = s["kv_bytes_kept"] / (s["kv_bytes_full"] / s["tokens_seen"])  # tokens kept per layer, on average
    assert s["compress_once"] == "kvzip" and abs(per_layer - 30) <= 1


def test_cache_prompt_cli_compresses_once_by_default_and_streams_on_request(tiny_model_dir, tmp_path, capsys):
    from kvpolicy_core.apps.cli import main

    doc = tmp_path / "doc.txt"
    doc.write_text("the secret number is 4821. " * 6)
    path = tmp_path / "c.safetensors"
    args = ["cache-prompt", "--model", str(tiny_model_dir), "--file", str(doc), "--prompt-cache-file", str(path)]
    runs = {}
    for extra in ([], ["--compress-once", "stream"], ["--budget", "1000"]):
        assert main(args + ["--method", "cam:budget=32,n_sink=2", "--json"] + extra) == 0
        runs[tuple(extra)] = json.loads(capsys.readouterr().out)
    assert runs[()]["compress_once"] == "kvzip"  # the default: the measured better choice for a document
    assert (
        runs[("--compress-once", "stream")]["compress_once"] == ""
        and runs[("--compress-once", "stream")]["tokens_kept"] == 32
    )
    short = runs[("--budget", "1000")]  # a document within the budget: nothing to cut, every token kept
    assert short["compress_once"] == "" and short["tokens_kept"] == short["tokens_seen"] < 1000
    assert main(args + ["--method", "kvzip-layerwise+h2o:budget=30,n_sink=2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["compress_once"] == "kvzip-layerwise"  # the method's own scorer


def test_ruler_runner_asks_every_question_of_one_compressed_cache(tiny_model_dir):
    import mlx_lm

    from kvpolicy_core.eval.tasks.ruler import TaskParams, build_suite
    from kvpolicy_core.eval.tasks.ruler_runner import format_table, run_suite, summarize

    model, tok = mlx_lm.load(str(tiny_model_dir))
    params = {"niah_multikey": TaskParams(keys=3, questions=2, digits=4)}
    suite = build_suite(tok, ["niah_multikey"], [640], ["noise"], [0], params=params)
    specs = ["full", "h2o:budget=160,n_sink=2", "kvzip+h2o:budget=160,n_sink=2"]
    rows = run_suite(model, tok, suite, specs, ["query-agnostic", "question-in-prompt"], prefill_step=128)
    ours = [r for r in rows if r["method"] == "kvzip+h2o:budget=160,n_sink=2"]
    assert len(ours) == 2 * len(suite[0].questions)
    assert all(r["kv_bytes_kept"] < r["kv_bytes_full"] for r in ours)
    agnostic = [r for r in ours if r["protocol"] == "query-agnostic"]
    assert len({r["prefill_seconds"] for r in agnostic}) == 1  # one compression for every question
    assert "kvzip+h2o" in format_table(summarize(rows), ["niah_multikey"])
