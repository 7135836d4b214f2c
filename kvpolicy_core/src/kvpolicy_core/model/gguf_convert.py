"""Convert a Gemma 3 GGUF file into an mlx-lm ``gemma3_text`` model directory, without torch.

Weights are dequantised with the ``gguf`` package (Q4_K, Q5_0, Q6_K, Q8_0, F32, ...),
renamed to mlx-lm's parameter names, and llama.cpp's Gemma RMSNorm offset is undone
(llama.cpp stores ``w + 1``; mlx-lm computes ``rms_norm(x) * (1 + w)``). The tokenizer is
rebuilt from ``tokenizer.ggml.*`` metadata with transformers' GGUF tokenizer builder
(which needs no torch) and saved as ``tokenizer.json``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, Tuple

import numpy as np

#: GGUF block tensor names -> mlx-lm gemma3_text names (per layer ``N``).
LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")


class ConversionError(ValueError):
    """The GGUF file is not a Gemma 3 text model this converter understands."""


def renamed(gguf_name: str, layer_names: Dict[str, str], top_names: Dict[str, str]) -> str:
    """``blk.N.<part>.<kind>`` -> ``model.layers.N.<layer_names[part]>.<kind>``, ``<base>.<kind>`` ->
    ``<top_names[base]>.<kind>``; any other name is a :class:`ConversionError`."""
    m = _BLOCK.match(gguf_name)
    if m:
        layer, part, kind = m.groups()
        if part not in layer_names:
            raise ConversionError(f"unknown GGUF tensor {gguf_name!r}")
        return f"model.layers.{layer}.{layer_names[part]}.{kind}"
    base, _, kind = gguf_name.rpartition(".")
    if base in top_names:
        return f"{top_names[base]}.{kind}"
    raise ConversionError(f"unknown GGUF tensor {gguf_name!r}")


def mlx_name(gguf_name: str) -> str:
    """``blk.3.ffn_norm.weight`` -> ``model.layers.3.pre_feedforward_layernorm.weight``."""
    return renamed(gguf_name, LAYER_NAMES, TOP_NAMES)


def is_gemma_norm(mlx_param: str) -> bool:
    return mlx_param.endswith("norm.weight")


def _field(reader, key: str):
    f = reader.fields.get(key)
    if f is None:
        return None
    return f.contents()


def arch_fields(reader, arch: str) -> Callable[..., Any]:
    """``g(key, default=None)``: the GGUF field ``<arch>.<key>`` (``default`` where absent), once the file's
    ``general.architecture`` is ``arch`` (else a :class:`ConversionError`)."""
    got = _field(reader, "general.architecture")
    if got != arch:
        raise ConversionError(f"expected a {arch} GGUF file, got architecture {got!r}")
    return lambda k, d=None: _field(reader, f"{arch}.{k}") if _field(reader, f"{arch}.{k}") is not None else d


def read_config(reader) -> Dict:
    """mlx-lm ``config.json`` for ``gemma3_text`` from the GGUF metadata."""
    g = arch_fields(reader, "gemma3")
    head_dim = int(g("attention.key_length"))
    tokens = reader.fields["tokenizer.ggml.tokens"]
    return {
        "model_type": "gemma3_text",
        "hidden_size": int(g("embedding_length")),
        "num_hidden_layers": int(g("block_count")),
        "intermediate_size": int(g("feed_forward_length")),
        "num_attention_heads": int(g("attention.head_count")),
        "num_key_value_heads": int(g("attention.head_count_kv")),
        "head_dim": head_dim,
        "rms_norm_eps": float(g("attention.layer_norm_rms_epsilon", 1e-6)),
        "vocab_size": len(tokens.data),
        "rope_theta": float(g("rope.freq_base", 1e6)),
        "rope_local_base_freq": 10000.0,
        "query_pre_attn_scalar": head_dim,
        "sliding_window": int(g("attention.sliding_window", 512)),
        "sliding_window_pattern": 6,
        "max_position_embeddings": int(g("context_length", 32768)),
        "tie_word_embeddings": True,
    }


def dequantized(reader) -> Iterator[Tuple[str, np.ndarray]]:
    """(GGUF name, float32 array) for every tensor, dequantised, its shape in mlx-lm's (row-major) order."""
    from gguf.quants import dequantize

    for t in reader.tensors:
        arr = dequantize(t.data, t.tensor_type)
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))
        yield t.name, np.asarray(arr, dtype=np.float32).reshape(shape)


def iter_weights(reader, dtype=np.float32) -> Iterator[Tuple[str, np.ndarray]]:
    """(mlx-lm name, dequantised array) for every tensor, norms shifted back by -1."""
    for gguf_name, arr in dequantized(reader):
        name = mlx_name(gguf_name)
        if is_gemma_norm(name):
            arr = arr - 1.0
        yield name, arr.astype(dtype)


def tokenizer_builders(*names: str) -> tuple:
    """The functions ``names`` of transformers' GGUF tokenizer builder (``gguf_tokenizer_mapping``)."""
    import importlib

    try:
        mapping = importlib.import_module("transformers.integrations.gguf.gguf_tokenizer_mapping")
        return tuple(getattr(mapping, name) for name in names)
    except (ImportError, AttributeError) as exc:  # pragma: no cover - depends on the installed transformers
        raise ConversionError(
            f"rebuilding the tokenizer needs transformers>=5.7 (installed with mlx-lm): {exc}"
        ) from exc


def build_tokenizer(reader, out_dir: Path) -> None:
    """Rebuild the SentencePiece-style tokenizer from GGUF metadata; save it to ``out_dir``."""
    add_gguf_special_tokens, gemma_tokenizer = tokenizer_builders("add_gguf_special_tokens", "gemma_tokenizer")
    arr = lambda k: _field(reader, f"tokenizer.ggml.{k}")  # noqa: E731
    tokens = list(arr("tokens"))
    tdict = {
        "tokenizer_type": arr("model"),
        "pre_tokenizer_type": arr("pre"),
        "tokens": tokens,
        "scores": list(arr("scores")),
        "token_type": list(arr("token_type")),
    }
    tok = add_gguf_special_tokens(gemma_tokenizer(tdict), tdict)
    apply_special_tokens(tok, arr, tokens)
    tok.add_eos_token = bool(arr("add_eos_token"))
    tok.save_pretrained(str(out_dir))


def apply_special_tokens(tok, arr, tokens) -> None:
    """Set bos/eos/unk/pad from the GGUF's ``tokenizer.ggml.*_token_id`` keys (``arr(key)`` reads one)."""
    special = {}
    for name, key in (
        ("bos_token", "bos_token_id"),
        ("eos_token", "eos_token_id"),
        ("unk_token", "unknown_token_id"),
        ("pad_token", "padding_token_id"),
    ):
        idx = arr(key)
        if idx is not None:
            special[name] = tokens[int(idx)]
    tok.add_special_tokens(special)
    tok.add_bos_token = bool(arr("add_bos_token"))


def convert(gguf_path, out_dir, dtype: str = "float32") -> Path:
    """Write ``config.json``, ``model.safetensors`` and the tokenizer to ``out_dir``."""
    return write_converted(gguf_path, out_dir, dtype, read_config, iter_weights, build_tokenizer)


def write_converted(gguf_path, out_dir, dtype, read_config, iter_weights, build_tokenizer) -> Path:
    """Convert with one architecture's three readers: ``read_config(reader) -> dict``,
    ``iter_weights(reader, np_dtype) -> (mlx name, array)``, ``build_tokenizer(reader, out_dir)``."""
    import mlx.core as mx
    from gguf import GGUFReader

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    reader = GGUFReader(str(gguf_path))
    config = read_config(reader)
    np_dtype = {"float32": np.float32, "float16": np.float16, "bfloat16": np.float32}[dtype]
    weights = {}
    for name, arr in iter_weights(reader, np_dtype):
        w = mx.array(arr)
        weights[name] = w.astype(mx.bfloat16) if dtype == "bfloat16" else w
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    build_tokenizer(reader, out)
    return out
