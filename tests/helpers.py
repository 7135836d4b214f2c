"""Helpers shared by the tests (imported as ``from helpers import ...``; conftest.py holds only fixtures).

:data:`SHIPPED_METHODS` is the one matrix of methods this repository ships: every test that runs
"all methods" uses it (with its own budget fields appended by ``with_fields``).
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from kvpolicy_core.testing import conformance as kit
from kvpolicy_core.testing.conformance import feed, with_fields  # noqa: F401  (re-exported to the tests)
from kvpolicy_core.testing.tiny_models import VOCAB, tiny_llama, tiny_model, write_tiny_llama_dir  # noqa: F401

#: Every shipped method variant, without budget fields (tests append theirs with ``with_fields``).
SHIPPED_METHODS = [
    "h2o:signal=proxy",
    "h2o",  # the default: observed signal, observation window 32, pool 15 (needs the attention hook)
    "cam:merge=sim_weighted,signal=proxy",  # the specification's CaM
    "cam:merge=mean,gate=false,keys=true,signal=proxy",
    "cam:merge=drop,signal=proxy",
    "cam:merge=paper,m=4,signal=proxy",
    "cam",  # the default: mass merge with log-weights, observed signal with the observation window
    "cam:merge=sim_weighted",
    "cam:merge=mass_blend,signal=proxy",
    "random:salt=3",
    "h2o:score=keydiff",  # query-agnostic: key dissimilarity, no attention hook
    "cam:score=expected_attention",  # query-agnostic: expected attention of future queries (hook, layer RoPE)
]
#: The query-agnostic scorers with the other disposition (the host-sync count covers every pair).
QUERY_AGNOSTIC_PAIRS = ["cam:score=keydiff", "h2o:score=expected_attention"]
#: CaM's variants (merge rules, gate, keys).
CAM_METHODS = [m for m in SHIPPED_METHODS if m.startswith("cam")]


def tiny_gemma3(window: int = 8, seed: int = 0):
    """Tiny Gemma 3: 6 layers, every third global, the others sliding-window layers of ``window``."""
    return tiny_model("gemma3_text", seed=seed, num_hidden_layers=6, sliding_window=window, sliding_window_pattern=3)


def run_chunks(model, caches, tokens, chunks):
    """Feed ``tokens`` [B, T] in chunks of the given sizes; returns logits [B, T, V]."""
    outs, i = [], 0
    for c in chunks:
        outs.append(model(tokens[:, i : i + c], cache=caches))
        i += c
    out = mx.concatenate(outs, axis=1)
    mx.eval(out)
    return out


def plain_caches(model):
    return [KVCache() for _ in model.layers]


def random_kv(B=2, H=3, S=10, D=8, seed=0, dtype=mx.float32):
    """The test kit's random K/V with smaller defaults."""
    return kit.random_kv(B=B, H=H, S=S, D=D, seed=seed, dtype=dtype)


def write_tiny_model_dir(path, seed: int = 0):
    """A loadable mlx-lm model directory: :func:`tiny_llama` weights, config and a char-level tokenizer."""
    return write_tiny_llama_dir(path, seed=seed)
