"""A long prompt prefilled in chunks by a streaming cache (``when="stream"``) holds memory bounded by the budget, not
by the prompt (``when="prompt_end"`` holds the prompt, as mlx-lm's KVCache does: tests/test_schedule.py).

mlx-lm's ``generate_step`` feeds a prompt ``prefill_step_size`` tokens at a time and evaluates each cache's
``state`` after every chunk; whatever a policy cache keeps alive beyond that (a lazy graph over earlier chunks'
keys, buffers that only grow) would grow with the prompt and defeat the point of a budget.
"""

from __future__ import annotations

import gc

import mlx.core as mx
import pytest
from helpers import SHIPPED_METHODS, tiny_llama, with_fields
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step

from kvpolicy_core.integration.builder import KVCacheBuilder
from kvpolicy_core.testing.tiny_models import tiny_model

CHUNK, CHUNKS, BUDGET = 48, 10, 16


def _active_after_each_chunk(model, caches, prompt):
    """MLX active memory (bytes) after each prefill chunk of ``generate_step``, then one token generated."""
    seen = []

    def progress(done, total):
        if 0 < done < total:
            gc.collect()
            seen.append(mx.get_active_memory())

    gen = generate_step(
        prompt, model, prompt_cache=caches, max_tokens=1, prefill_step_size=CHUNK, prompt_progress_callback=progress
    )
    next(gen)
    gen.close()
    return seen


@pytest.mark.parametrize("method", SHIPPED_METHODS)
def test_active_memory_after_each_prefill_chunk_stays_flat_over_a_long_prompt(method):
    model = tiny_llama(layers=2)
    caches = KVCacheBuilder.for_model(model, with_fields(method, f"budget={BUDGET},when=stream"))
    prompt = mx.random.randint(0, 97, (CHUNK * CHUNKS + 1,), key=mx.random.key(3))
    seen = _active_after_each_chunk(model, caches, prompt)
    assert len(seen) == CHUNKS
    # one chunk's keys and values over all layers: what a leak of one chunk per chunk would add each time
    a = model.args
    chunk_kv = 2 * len(model.layers) * a.num_key_value_heads * (a.hidden_size // a.num_attention_heads) * CHUNK * 4
    growth = seen[-1] - seen[1]  # from the second chunk on the cache is at its steady size (budget + evictions)
    assert growth < chunk_kv / 4, f"{method}: active memory grew by {growth} B over {CHUNKS - 2} chunks"


def test_a_prefill_chunk_whose_output_is_never_read_does_not_compute_its_attention():
    """mlx-lm evaluates only the caches' state after a prefill chunk, so the last layer's attention output is never
    read: an observation-window scorer needs the attention of the chunk's last W queries only, and the [S, L]
    weights of all S queries (what the output needs) must not be computed for it. Measured by the peak memory of
    evaluating the state: S x L weights per query head would be far above the window's W x L."""
    model = tiny_llama(layers=1, n_heads=4, n_kv_heads=2)
    S, W = 2048, 32
    caches = KVCacheBuilder.for_model(model, f"h2o:budget=64,obs_window={W}")
    tokens = mx.random.randint(0, 97, (1, S), key=mx.random.key(1))
    gc.collect()
    mx.synchronize()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    model(tokens, cache=caches)  # the output (logits) is dropped, as generate_step drops a prefill chunk's
    mx.eval([c.state for c in caches])
    all_rows = 4 * S * S * 4  # float32 weights of every query row of 4 query heads
    assert mx.get_peak_memory() - base < all_rows / 4


@pytest.mark.parametrize("method", ["h2o", "cam"])
def test_a_held_prompt_fed_by_a_loop_that_reads_only_the_logits_keeps_no_graph_of_earlier_chunks(method):
    """A loop of its own (not ``generate_step``) that evaluates only each chunk's logits: the held prompt's scores
    and the observation window's rows feed no output until the cut, so left lazy each chunk's graph would keep its
    attention rows (and what they were computed from) alive. Memory then grows by the chunk's keys and values and
    the window's rows over the new keys, nothing more."""
    model = tiny_llama(layers=2)
    caches = KVCacheBuilder.for_model(model, f"{method}:budget={BUDGET},obs_window=8")
    prompt = mx.random.randint(0, 97, (1, CHUNK * CHUNKS), key=mx.random.key(5))
    seen = []
    for i in range(CHUNKS):
        mx.eval(model(prompt[:, i * CHUNK : (i + 1) * CHUNK], cache=caches))
        gc.collect()
        mx.synchronize()
        seen.append(mx.get_active_memory())
    a = model.args
    H, D = a.num_key_value_heads, a.hidden_size // a.num_attention_heads
    layers = len(model.layers)
    held = 2 * layers * H * D * CHUNK * 4  # a chunk's keys and values, float32
    state = layers * H * (8 + 4) * CHUNK * 4  # the window's 8 rows, scores, positions, norms over the chunk's keys
    growth = (seen[-1] - seen[1]) / (CHUNKS - 2)
    assert growth < 1.5 * (held + state), f"{method}: {growth:.0f} B per chunk, held K/V and state {held + state} B"


@pytest.mark.parametrize("fields", ["", "kv_bits=4"])
def test_nothing_a_cache_held_outlives_it(fields):
    """Once a generation's caches are dropped, MLX's active memory is back where it was: no compiled call, trace
    or module keeps a layer's buffers alive (a closure over the first call's arrays once kept one layer's keys and
    values for the life of the process)."""
    model = tiny_model("llama", head_dim=64, hidden_size=128, num_attention_heads=4, num_key_value_heads=2)
    mx.eval(model.parameters())
    prompt = mx.random.randint(0, 100, (CHUNK * 4,), key=mx.random.key(1))
    mx.eval(prompt)
    gc.collect()
    base = mx.get_active_memory()
    spec = with_fields("cam", f"budget={BUDGET}" + (f",{fields}" if fields else ""))
    caches = KVCacheBuilder.for_model(model, spec)
    gen = generate_step(prompt, model, prompt_cache=caches, max_tokens=12, prefill_step_size=CHUNK)
    for _ in zip(gen, range(12)):
        pass
    gen.close()
    held = sum(int(a.nbytes) for c in caches for _, a in tree_flatten(list(c.state)[:2]))
    assert held > 0
    del caches, gen
    gc.collect()
    assert mx.get_active_memory() - base < 4096
