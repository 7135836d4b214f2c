"""Shared fixtures: tiny random-weight mlx-lm models and random K/V streams."""

from __future__ import annotations

from kvpolicy_core.blas import load_optimized_blas

load_optimized_blas(quiet=True)  # before mlx: the real-model tests need a fast BLAS

import mlx.core as mx  # noqa: E402
import pytest  # noqa: E402
from mlx_lm.models import gemma3_text  # noqa: E402
from mlx_lm.models.cache import KVCache  # noqa: E402

from kvpolicy_core import testing as kit  # noqa: E402
from kvpolicy_core.testing import tiny_llama, with_fields  # noqa: E402,F401  (re-exported to the tests)

VOCAB = 97




def tiny_gemma3(window: int = 8, seed: int = 0):
    mx.random.seed(seed)
    args = gemma3_text.ModelArgs(
        model_type="gemma3_text", hidden_size=64, num_hidden_layers=6, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=VOCAB,
        sliding_window=window, sliding_window_pattern=3, query_pre_attn_scalar=16,
    )
    model = gemma3_text.Model(args)
    mx.eval(model.parameters())
    return model


@pytest.fixture(scope="session")
def llama_model():
    return tiny_llama()


@pytest.fixture(scope="session")
def gemma_model():
    return tiny_gemma3()


@pytest.fixture
def tokens():
    return mx.random.randint(0, VOCAB, (2, 40), key=mx.random.key(1))


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
    """A loadable mlx-lm model directory: tiny llama weights, config and a char-level tokenizer."""
    import json

    from mlx.utils import tree_flatten
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders

    path.mkdir(parents=True, exist_ok=True)
    model = tiny_llama(seed=seed)
    config = {
        "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "vocab_size": VOCAB,
        "tie_word_embeddings": True,
    }
    (path / "config.json").write_text(json.dumps(config))
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    chars = [chr(c) for c in range(32, 32 + VOCAB - 3)]
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{ch: i + 3 for i, ch in enumerate(chars)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>",
    }))
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    return write_tiny_model_dir(tmp_path_factory.mktemp("tiny-llama"))

