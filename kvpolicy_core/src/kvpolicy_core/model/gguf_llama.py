"""Convert a llama-architecture GGUF (e.g. SmolLM2) into an mlx-lm ``llama`` model directory, without torch.

GGUF stores ``attn_q``/``attn_k`` permuted for GGML's interleaved RoPE (pairs
``(x_2i, x_2i+1)``); mlx-lm's ``nn.RoPE(traditional=True)`` rotates the same pairs, so the
weights are kept as stored and the config says ``rope_traditional: true``. Weights are
dequantised with the ``gguf`` package (Q4_1, Q8_0, F32, ...). The byte-level BPE tokenizer
is rebuilt from ``tokenizer.ggml.tokens``/``merges`` with transformers' GGUF builder; the
``smollm`` pre-tokenizer (llama.cpp: every digit its own piece, then GPT-2's split) is set
explicitly.
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict, Iterator, Tuple

import numpy as np

from .gguf_convert import (
    ConversionError,
    _field,
    apply_special_tokens,
    arch_fields,
    dequantized,
    renamed,
    tokenizer_builders,
    write_converted,
)

LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def mlx_name(gguf_name: str) -> str:
    """``blk.3.ffn_norm.weight`` -> ``model.layers.3.post_attention_layernorm.weight``."""
    return renamed(gguf_name, LAYER_NAMES, TOP_NAMES)


def read_config(reader) -> Dict:
    """mlx-lm ``config.json`` for ``llama`` from the GGUF metadata."""
    g = arch_fields(reader, "llama")
    heads = int(g("attention.head_count"))
    hidden = int(g("embedding_length"))
    names = {t.name for t in reader.tensors}
    return {
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": int(g("block_count")),
        "intermediate_size": int(g("feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(g("attention.head_count_kv", heads)),
        "head_dim": int(g("rope.dimension_count", hidden // heads)),
        "rms_norm_eps": float(g("attention.layer_norm_rms_epsilon", 1e-5)),
        "vocab_size": len(reader.fields["tokenizer.ggml.tokens"].data),
        "rope_theta": float(g("rope.freq_base", 10000.0)),
        "rope_traditional": True,
        "max_position_embeddings": int(g("context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in names,
    }


def iter_weights(reader, dtype=np.float32) -> Iterator[Tuple[str, np.ndarray]]:
    for gguf_name, arr in dequantized(reader):
        yield mlx_name(gguf_name), arr.astype(dtype)


def build_tokenizer(reader, out_dir: Path) -> None:
    """Rebuild the byte-level BPE tokenizer (vocab + merges) from GGUF metadata; save it."""
    add_gguf_special_tokens, byte_level_tokenizer = tokenizer_builders(
        "add_gguf_special_tokens", "byte_level_tokenizer"
    )
    from tokenizers import pre_tokenizers  # a dependency of transformers' GGUF builder: there once it loaded

    arr = lambda k: _field(reader, f"tokenizer.ggml.{k}")  # noqa: E731
    if arr("model") != "gpt2":
        raise ConversionError(f"expected a byte-level BPE ('gpt2') tokenizer, got {arr('model')!r}")
    tokens = list(arr("tokens"))
    tdict = {
        "tokenizer_type": "gpt2",
        "tokens": tokens,
        "merges": list(arr("merges")),
        "token_type": list(arr("token_type")),
    }
    tok = add_gguf_special_tokens(byte_level_tokenizer(tdict), tdict)
    if arr("pre") == "smollm":
        tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    apply_special_tokens(tok, arr, tokens)
    tok.save_pretrained(str(out_dir))


def convert(gguf_path, out_dir, dtype: str = "float32") -> Path:
    """Write ``config.json``, ``model.safetensors`` and the tokenizer to ``out_dir``."""
    return write_converted(gguf_path, out_dir, dtype, read_config, iter_weights, build_tokenizer)
