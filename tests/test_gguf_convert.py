"""GGUF -> mlx-lm conversion on a tiny synthetic Gemma 3 GGUF written by the test."""

import json

import mlx.core as mx
import numpy as np
import pytest

gguf = pytest.importorskip("gguf", reason="the [model] extra (gguf) is not installed")

from kvpolicy_core.model.gguf_convert import ConversionError, convert, mlx_name  # noqa: E402

HIDDEN, FFN, HEADS, KV, HD, LAYERS = 32, 64, 2, 1, 16, 6
CHARS = list("abcdefghijklmnopqrstuvwxyz")
TOKENS = ["<pad>", "<eos>", "<bos>", "<unk>"] + ["\u2581"] + CHARS + ["\u2581t", "th", "\u2581th", "he", "\u2581the"]


def write_gguf(path, rng):
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_block_count(LAYERS)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV)
    w.add_key_length(HD)
    w.add_value_length(HD)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1e6)
    w.add_sliding_window(4)
    w.add_context_length(128)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(TOKENS)
    w.add_token_scores([0.0] * len(TOKENS))
    w.add_token_types([3, 3, 3, 2] + [1] * (len(TOKENS) - 4))
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.add_pad_token_id(0)
    w.add_add_bos_token(True)
    tensors = {"token_embd.weight": (len(TOKENS), HIDDEN), "output_norm.weight": (HIDDEN,)}
    for i in range(LAYERS):
        b = f"blk.{i}."
        tensors.update(
            {
                b + "attn_q.weight": (HEADS * HD, HIDDEN),
                b + "attn_k.weight": (KV * HD, HIDDEN),
                b + "attn_v.weight": (KV * HD, HIDDEN),
                b + "attn_output.weight": (HIDDEN, HEADS * HD),
                b + "attn_q_norm.weight": (HD,),
                b + "attn_k_norm.weight": (HD,),
                b + "ffn_gate.weight": (FFN, HIDDEN),
                b + "ffn_up.weight": (FFN, HIDDEN),
                b + "ffn_down.weight": (HIDDEN, FFN),
                b + "attn_norm.weight": (HIDDEN,),
                b + "post_attention_norm.weight": (HIDDEN,),
                b + "ffn_norm.weight": (HIDDEN,),
                b + "post_ffw_norm.weight": (HIDDEN,),
            }
        )
    arrays = {}
    for name, shape in tensors.items():
        a = (rng.standard_normal(shape) * 0.1).astype(np.float32)
        if name.endswith("norm.weight"):
            a = a + 1.0  # llama.cpp stores Gemma norms with +1
        arrays[name] = a
        if name == "blk.0.ffn_up.weight":  # one quantised tensor: Q8_0
            q = gguf.quants.quantize(a, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return arrays


def test_tensor_names_map_onto_mlx_lm_gemma3():
    assert mlx_name("blk.3.ffn_norm.weight") == "model.layers.3.pre_feedforward_layernorm.weight"
    assert mlx_name("blk.0.post_ffw_norm.weight") == "model.layers.0.post_feedforward_layernorm.weight"
    assert mlx_name("blk.1.attn_q.weight") == "model.layers.1.self_attn.q_proj.weight"
    assert mlx_name("token_embd.weight") == "model.embed_tokens.weight"
    assert mlx_name("output_norm.weight") == "model.norm.weight"
    with pytest.raises(ConversionError, match="unknown GGUF tensor"):
        mlx_name("blk.0.mystery.weight")


def test_conversion_shifts_norms_dequantises_and_loads(tmp_path):
    import mlx_lm

    arrays = write_gguf(tmp_path / "tiny.gguf", np.random.default_rng(0))
    out = convert(tmp_path / "tiny.gguf", tmp_path / "model")
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "gemma3_text" and config["num_hidden_layers"] == LAYERS
    assert (config["head_dim"], config["num_key_value_heads"], config["sliding_window"]) == (HD, KV, 4)
    weights = mx.load(str(out / "model.safetensors"))
    norm = np.array(weights["model.layers.1.pre_feedforward_layernorm.weight"])
    np.testing.assert_allclose(norm, arrays["blk.1.ffn_norm.weight"] - 1.0, atol=1e-6)
    np.testing.assert_allclose(
        np.array(weights["model.layers.0.self_attn.q_proj.weight"]), arrays["blk.0.attn_q.weight"]
    )
    q8 = np.array(weights["model.layers.0.mlp.up_proj.weight"])
    assert np.abs(q8 - arrays["blk.0.ffn_up.weight"]).max() < 0.01  # Q8_0 round trip
    assert weights["model.embed_tokens.weight"].dtype == mx.float32
    model, tok = mlx_lm.load(str(out))
    ids = tok.encode("the the")
    assert ids[0] == 2 and tok.decode(ids[1:]) == "the the"
    logits = model(mx.array(ids)[None])
    assert logits.shape == (1, len(ids), len(TOKENS)) and not mx.isnan(logits).any().item()


def test_wrong_architecture_is_rejected(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "llama.gguf"), "llama")
    w.add_token_list(["a"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ConversionError, match="expected a gemma3 GGUF file, got architecture 'llama'"):
        convert(tmp_path / "llama.gguf", tmp_path / "out")
