"""Tiny random-weight mlx-lm models for tests, benchmarks, docs and the distributed launcher.

One path, three layers, nothing downloaded:

- config: :data:`BASE` + :data:`FAMILIES` (hidden 64, 2-4 layers, one :data:`VOCAB`) for
  :func:`tiny_model`; :func:`model_config` for a model directory of :data:`ARCHITECTURES`;
- model: :func:`build_model` (config -> the family's own mlx-lm ``Model``, seeded random weights,
  evaluated), so a test exercises the family's real attention code, cache layout and RoPE;
  :func:`tiny_model` (a family) and :func:`tiny_llama` (the llama most tests use) call it;
- model directory: :func:`write_model_dir` writes what ``mlx_lm.load`` and
  ``mlx_lm.utils.sharded_load`` read (``config.json``, ``model.safetensors`` with its index, a
  character-level tokenizer from :func:`write_tokenizer`); :func:`save_model_dir` saves a model
  built here next to a tokenizer of the caller's.

The same seed gives the same weights through every entry point.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict

import mlx.core as mx
from mlx_lm.utils import _get_classes

from ..cache.policy_cache import PolicyCache
from ..config.parse import parse_config
from ..errors import ModelError
from ..integration.builder import KVCacheBuilder, detach, native_caches

#: The vocabulary of every tiny model (the character tokenizer: 94 printable characters + 3 specials).
VOCAB = 97
SPECIALS = ("<pad>", "<s>", "</s>")

# -- configs ---------------------------------------------------------------------------------------------------

#: Config fields every family gets (unknown fields are ignored by mlx-lm's ModelArgs).
BASE: Dict[str, Any] = dict(
    hidden_size=64,
    num_hidden_layers=2,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=VOCAB,
    rms_norm_eps=1e-5,
    layer_norm_eps=1e-5,
    norm_epsilon=1e-5,
    max_position_embeddings=2048,
    rope_theta=10000.0,
    tie_word_embeddings=True,
)

#: Family -> the fields it needs beyond :data:`BASE`. llama also covers Mistral and SmolLM.
FAMILIES: Dict[str, Dict[str, Any]] = {
    "llama": {},
    "qwen2": {},
    "qwen3": {},
    "qwen3_moe": dict(
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        moe_intermediate_size=32,
        norm_topk_prob=True,
    ),
    "phi3": {},
    "gemma2": dict(query_pre_attn_scalar=16, attn_logit_softcapping=50.0, final_logit_softcapping=30.0),
    "gemma3_text": dict(num_hidden_layers=4, sliding_window=8, sliding_window_pattern=2, query_pre_attn_scalar=16),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "olmo2": {},
    "starcoder2": dict(use_bias=True),
    "cohere": dict(logit_scale=0.0625, use_qk_norm=False),
    "granite": dict(
        logits_scaling=1.0,
        attention_multiplier=0.25,
        embedding_multiplier=1.0,
        residual_multiplier=1.0,
        attention_bias=False,
        mlp_bias=False,
    ),
}

_GEMMA3N_TEXT = dict(
    model_type="gemma3n_text",
    hidden_size=64,
    num_hidden_layers=4,
    intermediate_size=128,
    num_attention_heads=4,
    head_dim=16,
    rms_norm_eps=1e-6,
    vocab_size=VOCAB,
    num_key_value_heads=2,
    num_kv_shared_layers=2,
    vocab_size_per_layer_input=VOCAB,
    sliding_window=8,
    max_position_embeddings=2048,
    rope_local_base_freq=1e4,
    rope_theta=1e6,
    final_logit_softcapping=30.0,
    layer_types=["sliding_attention", "full_attention"] * 2,
    activation_sparsity_pattern=[0.0] * 4,
    hidden_size_per_layer_input=8,
    altup_num_inputs=2,
    altup_coef_clip=120.0,
    altup_correct_scale=True,
    altup_active_idx=0,
    laurel_rank=8,
)
_LLAMA4_TEXT = dict(
    BASE,
    model_type="llama4_text",
    num_hidden_layers=4,
    attention_chunk_size=8,
    num_local_experts=2,
    num_experts_per_tok=1,
    intermediate_size_mlp=128,
    interleave_moe_layer_step=1,
    use_qk_norm=True,
    attention_bias=False,
    rope_scaling=None,
    no_rope_layers=[1, 1, 1, 1],
)

#: Families kvpolicy refuses (with a :class:`ModelError` naming the reason), and their tiny configs.
REFUSED_FAMILIES: Dict[str, Dict[str, Any]] = {
    "gemma3n": dict(text_config=_GEMMA3N_TEXT),  # shared-KV layers: fewer caches than layers
    "deepseek_v3": dict(  # multi-head latent attention: the cache holds latents
        kv_lora_rank=16,
        q_lora_rank=None,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        n_shared_experts=1,
        first_k_dense_replace=1,
        moe_layer_freq=1,
        n_group=1,
        topk_group=1,
        routed_scaling_factor=1.0,
        topk_method="noaux_tc",
        scoring_func="sigmoid",
        norm_topk_prob=True,
    ),
    "llama4": dict(text_config=_LLAMA4_TEXT),  # ChunkedKVCache
    "qwen3_next": dict(  # hybrid: linear-attention layers hold an ArraysCache
        linear_num_value_heads=2,
        linear_num_key_heads=2,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        num_experts=2,
        num_experts_per_tok=1,
        decoder_sparse_step=1,
        shared_expert_intermediate_size=32,
        mlp_only_layers=[],
        moe_intermediate_size=32,
        full_attention_interval=2,
        partial_rotary_factor=0.5,
        norm_topk_prob=True,
    ),
}


#: Model-directory architectures: ``llama`` and ``qwen3`` (tensor parallel), ``qwen2`` (tensor and pipeline
#: parallel), ``gemma3_text`` (neither).
ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3_text")


def model_config(
    model_type: str,
    *,
    hidden: int = 64,
    layers: int = 4,
    heads: int = 8,
    kv_heads: int = 4,
    intermediate: int = 128,
    vocab: int = VOCAB,
) -> Dict[str, Any]:
    """The ``config.json`` of a small ``model_type`` model directory (head_dim = hidden / heads)."""
    if model_type not in ARCHITECTURES:
        raise ValueError(f"model_type must be one of {', '.join(ARCHITECTURES)} (got {model_type!r})")
    if hidden % heads or heads % kv_heads:
        raise ValueError(f"hidden ({hidden}) must divide by heads ({heads}) and heads by kv_heads ({kv_heads})")
    config = {
        "model_type": model_type,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": intermediate,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "rms_norm_eps": 1e-5,
        "vocab_size": vocab,
        "tie_word_embeddings": True,
        "rope_theta": 10000.0,
        "max_position_embeddings": 4096,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    if model_type in ("qwen3", "gemma3_text"):
        config["head_dim"] = hidden // heads
    if model_type == "gemma3_text":
        config.update(sliding_window=8, sliding_window_pattern=3, query_pre_attn_scalar=hidden // heads)
    return config


def llama_config(n_kv_heads: int = 2, n_heads: int = 4, layers: int = 2, vocab: int = VOCAB) -> Dict[str, Any]:
    """The config of :func:`tiny_llama` (hidden 64, head_dim 64 / n_heads), as ``config.json`` would hold it."""
    return model_config("llama", hidden=64, layers=layers, heads=n_heads, kv_heads=n_kv_heads, vocab=vocab)


# -- models ----------------------------------------------------------------------------------------------------


def build_model(config: Dict[str, Any], seed: int = 0, weight_scale: float = 1.0):
    """The mlx-lm model for ``config`` with random weights drawn from ``seed``, evaluated.

    The projection weights (``*_proj``) are multiplied by ``weight_scale``: at mlx-lm's default
    initialisation (scale 1) greedy decoding repeats one token whatever the cache holds; at 3
    the text varies and depends on which tokens a policy keeps (what :func:`write_model_dir` uses).
    """
    from mlx.utils import tree_map_with_path

    model_cls, args_cls = _get_classes(config)
    args = args_cls.from_dict(config)
    mx.random.seed(seed)
    model = model_cls(args)
    if weight_scale != 1.0:
        model.update(tree_map_with_path(lambda p, w: w * weight_scale if "_proj." in p else w, model.parameters()))
    mx.eval(model.parameters())
    return model


def tiny_model(family: str, seed: int = 0, **overrides: Any):
    """A tiny random-weight mlx-lm model of ``family`` (a key of :data:`FAMILIES` or any
    mlx-lm ``model_type`` that accepts :data:`BASE`), evaluated and ready."""
    known = {**FAMILIES, **REFUSED_FAMILIES}.get(family, {})
    return build_model({**BASE, **known, **overrides, "model_type": family}, seed)


def tiny_llama(n_kv_heads: int = 2, n_heads: int = 4, layers: int = 2, vocab: int = VOCAB, seed: int = 0):
    """A tiny random-weight mlx-lm llama (hidden 64), evaluated and ready."""
    return build_model(llama_config(n_kv_heads, n_heads, layers, vocab), seed)


# -- model directories -----------------------------------------------------------------------------------------


def write_tokenizer(path: Path, vocab: int = VOCAB) -> None:
    """A character-level tokenizer over ``vocab - 3`` printable characters plus <pad>, <s>, </s>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    chars = [chr(c) for c in range(32, 32 + vocab - len(SPECIALS))]
    table = {**{s: i for i, s in enumerate(SPECIALS)}, **{ch: i + len(SPECIALS) for i, ch in enumerate(chars)}}
    tok = Tokenizer(models.WordLevel(table, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()
    tok.save(str(Path(path) / "tokenizer.json"))
    (Path(path) / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "pad_token": "<pad>",
            }
        )
    )


def save_model_dir(path, model, config: Dict[str, Any], tokenizer: bool = True) -> Path:
    """Save ``model`` (built from ``config``) as a loadable directory at ``path``: weights with their index and
    ``config.json``, plus the character tokenizer of :func:`write_tokenizer` unless ``tokenizer`` is False
    (the caller writes its own)."""
    from mlx_lm.utils import save_config, save_model

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_model(path, model)
    save_config(dict(config), path / "config.json")
    if tokenizer:
        write_tokenizer(path, config["vocab_size"])
    return path


def write_model_dir(path, model_type: str = "llama", seed: int = 0, weight_scale: float = 3.0, **sizes: Any) -> Path:
    """Write a loadable mlx-lm model directory at ``path``; ``sizes`` go to :func:`model_config`."""
    config = model_config(model_type, **sizes)
    return save_model_dir(path, build_model(config, seed, weight_scale), config)


def write_tiny_llama_dir(path, seed: int = 0, vocab: int = VOCAB, tokenizer: bool = True, **extra: Any) -> Path:
    """:func:`tiny_llama` ``(seed=seed)`` saved as a model directory (unscaled weights, the weights the tests'
    in-memory llama has); ``extra`` fields go into ``config.json`` (e.g. ``eos_token_id``)."""
    config: Dict[str, Any] = {**llama_config(vocab=vocab), **extra}
    return save_model_dir(path, tiny_llama(vocab=vocab, seed=seed), config, tokenizer)


#: The configs of the support matrix: default H2O and CaM (small budget; the observed signal with
#: the observation window, which needs the attention hook) and both with the proxy signal (no hook).
MATRIX_CONFIGS = (
    "h2o:budget=16,n_sink=2",
    "cam:budget=16,n_sink=2",
    "h2o:budget=16,n_sink=2,signal=proxy",
    "cam:budget=16,n_sink=2,merge=mass_blend,signal=proxy",
)


def run_family(family: str, config: str) -> str:
    """ "works" if ``config`` runs on the tiny ``family`` model correctly, else "refused: <kvpolicy's error>".

    Works means: with a budget above the length the logits equal mlx-lm's own caches'
    (allclose 1e-4), and with the small budget a chunked prefill plus decode keeps
    exactly its layer's budget on every policy layer with finite logits.
    """
    model = tiny_model(family)
    tokens = mx.random.randint(0, VOCAB, (1, 40), key=mx.random.key(1))
    try:
        big = KVCacheBuilder.for_model(model, parse_config(config, budget=128))
        small = KVCacheBuilder.for_model(model, config)
    except ModelError as exc:
        detach(model)
        return f"refused: {exc}"
    try:
        outs = []
        for caches in (big, native_caches(model)):
            run = [model(tokens[:, :24], cache=caches)] + [
                model(tokens[:, t : t + 1], cache=caches) for t in range(24, 40)
            ]
            outs.append(mx.concatenate(run, axis=1))
        assert mx.allclose(outs[0], outs[1], rtol=1e-4, atol=1e-4).item(), "budget > length differs from mlx-lm"
        out = mx.concatenate(
            [model(tokens[:, :24], cache=small)] + [model(tokens[:, t : t + 1], cache=small) for t in range(24, 40)],
            axis=1,
        )
        assert mx.isfinite(out).all().item(), "non-finite logits"
        for c in small:
            if isinstance(c, PolicyCache):
                # its own budget: the default allocation (reach) caps a sliding layer at its window
                assert c.tokens_kept == min(c.budget, 40) and c.offset == 40, f"layer {c.layer}: kept {c.tokens_kept}"
        return "works"
    finally:
        detach(model)


def support_matrix(families=tuple(FAMILIES), configs=MATRIX_CONFIGS) -> Dict[str, Dict[str, str]]:
    """family -> config -> result of :func:`run_family`."""
    return {f: {c: run_family(f, c) for c in configs} for f in families}


def support_table(matrix: Dict[str, Dict[str, str]]) -> str:
    """The markdown table of docs/cache.md ("works" / "refused" with the reason below)."""
    configs = list(next(iter(matrix.values())))
    lines = ["| family | " + " | ".join(f"`{c}`" for c in configs) + " |", "|---" * (len(configs) + 1) + "|"]
    reasons = []
    for fam, row in matrix.items():
        cells = []
        for c in configs:
            if row[c] == "works":
                cells.append("works")
            else:
                if row[c] not in reasons:
                    reasons.append(row[c])
                cells.append(f"refused ({reasons.index(row[c]) + 1})")
        lines.append(f"| {fam} | " + " | ".join(cells) + " |")
    lines += [""] + [f"({i}) {r.removeprefix('refused: ')}" for i, r in enumerate(reasons, 1)]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":  # python -m kvpolicy_core.testing.tiny_models  -> the table for docs/cache.md
    print(support_table(support_matrix()), end="")
