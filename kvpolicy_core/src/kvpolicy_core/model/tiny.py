"""Small random-weight mlx-lm model directories that load offline (tests, distributed runs, benchmarks).

:func:`write_model_dir` writes what ``mlx_lm.load`` and ``mlx_lm.utils.sharded_load`` read:
``config.json``, ``model.safetensors`` with ``model.safetensors.index.json`` (pipeline loading
needs the index) and a character-level tokenizer (``tokenizer.json`` built with the
``tokenizers`` package, no download). Architectures: ``llama`` and ``qwen3`` (tensor parallel),
``qwen2`` (tensor and pipeline parallel), ``gemma3_text`` (neither).
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any, Dict

ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3_text")
SPECIALS = ("<pad>", "<s>", "</s>")


def model_config(model_type: str, *, hidden: int = 64, layers: int = 4, heads: int = 8, kv_heads: int = 4,
                 intermediate: int = 128, vocab: int = 97) -> Dict[str, Any]:
    """The ``config.json`` of a small ``model_type`` model (head_dim = hidden / heads)."""
    if model_type not in ARCHITECTURES:
        raise ValueError(f"model_type must be one of {', '.join(ARCHITECTURES)} (got {model_type!r})")
    if hidden % heads or heads % kv_heads:
        raise ValueError(f"hidden ({hidden}) must divide by heads ({heads}) and heads by kv_heads ({kv_heads})")
    config = {
        "model_type": model_type, "hidden_size": hidden, "num_hidden_layers": layers,
        "intermediate_size": intermediate, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
        "rms_norm_eps": 1e-5, "vocab_size": vocab, "tie_word_embeddings": True, "rope_theta": 10000.0,
        "max_position_embeddings": 4096, "bos_token_id": 1, "eos_token_id": 2,
    }
    if model_type in ("qwen3", "gemma3_text"):
        config["head_dim"] = hidden // heads
    if model_type == "gemma3_text":
        config.update(sliding_window=8, sliding_window_pattern=3, query_pre_attn_scalar=hidden // heads)
    return config


def build_model(config: Dict[str, Any], seed: int = 0, weight_scale: float = 3.0):
    """The mlx-lm model for ``config`` with random weights drawn from ``seed``, evaluated.

    The projection weights (``*_proj``) are multiplied by ``weight_scale``: at mlx-lm's default
    initialisation (scale 1) greedy decoding repeats one token whatever the cache holds; at 3
    the text varies and depends on which tokens a policy keeps, which is what tests need.
    """
    import mlx.core as mx
    from mlx.utils import tree_map_with_path

    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    args = module.ModelArgs.from_dict(config)
    mx.random.seed(seed)
    model = module.Model(args)
    if weight_scale != 1.0:
        model.update(tree_map_with_path(lambda p, w: w * weight_scale if "_proj." in p else w, model.parameters()))
    mx.eval(model.parameters())
    return model


def write_tokenizer(path: Path, vocab: int) -> None:
    """A character-level tokenizer over ``vocab - 3`` printable characters plus <pad>, <s>, </s>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    chars = [chr(c) for c in range(32, 32 + vocab - len(SPECIALS))]
    table = {**{s: i for i, s in enumerate(SPECIALS)}, **{ch: i + len(SPECIALS) for i, ch in enumerate(chars)}}
    tok = Tokenizer(models.WordLevel(table, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>",
    }))


def write_model_dir(path, model_type: str = "llama", seed: int = 0, weight_scale: float = 3.0, **sizes) -> Path:
    """Write a loadable mlx-lm model directory at ``path``; ``sizes`` go to :func:`model_config`."""
    from mlx_lm.utils import save_config, save_model

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = model_config(model_type, **sizes)
    save_model(path, build_model(config, seed, weight_scale))
    save_config(dict(config), path / "config.json")
    write_tokenizer(path, config["vocab_size"])
    return path
