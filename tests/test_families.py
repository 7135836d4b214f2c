"""Every mlx-lm family users run: works with default H2O, CaM (observed signal) and the proxy signal, or is refused
with kvpolicy's own error; the support table in docs/cache.md is this test's result."""

import json
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.models.cache import CacheList, KVCache

from kvpolicy_core import KVCacheBuilder, ModelError, detach
from kvpolicy_core.testing.conformance import tiny_llama
from kvpolicy_core.testing.tiny_models import REFUSED_FAMILIES, support_matrix, support_table, tiny_model

DOC = Path(__file__).resolve().parents[1] / "docs" / "cache.md"


def test_family_matrix_matches_the_support_table_in_the_docs():
    matrix = support_matrix()  # run_family raises on anything but a ModelError refusal
    for family, row in matrix.items():
        for config, result in row.items():
            assert result == "works" or result.startswith("refused: "), (family, config, result)
    # the families users run all work with the proxy signal (no attention hook needed)
    assert all(
        row["h2o:budget=16,n_sink=2,signal=proxy"] == "works"
        and row["cam:budget=16,n_sink=2,merge=mass_blend,signal=proxy"] == "works"
        for row in matrix.values()
    )
    # default H2O/CaM (observed signal) work on every family whose attention kvpolicy can observe; the others
    # (hand-written attention: gemma2) are refused with the reason, never run wrong
    for family, row in matrix.items():
        for config in ("h2o:budget=16,n_sink=2", "cam:budget=16,n_sink=2"):
            assert row[config] == "works" or "cannot observe its attention" in row[config], (
                family,
                config,
                row[config],
            )
    assert [f for f, row in matrix.items() if row["h2o:budget=16,n_sink=2"] != "works"] == ["gemma2"]
    table = support_table(matrix)
    assert table in DOC.read_text(), (
        f"docs/cache.md is stale; regenerate with python -m kvpolicy_core.testing.tiny_models:\n{table}"
    )


@pytest.mark.parametrize(
    "family, reason",
    [
        ("gemma3n", "makes 2 caches for 4 layers"),
        ("deepseek_v3", "latent attention"),
        ("llama4", "ChunkedKVCache"),
        ("qwen3_next", "ArraysCache"),
    ],
)
def test_models_kvpolicy_cannot_serve_are_refused_with_the_reason(family, reason):
    assert family in REFUSED_FAMILIES
    model = tiny_model(family)
    with pytest.raises(ModelError, match=reason):
        KVCacheBuilder.for_model(model, "h2o:budget=16")


def test_hybrid_cache_list_layers_are_refused():
    model = tiny_llama()
    object.__setattr__(model, "make_cache", lambda: [CacheList(KVCache(), KVCache()), KVCache()])
    with pytest.raises(ModelError, match="layer 0 uses CacheList"):
        KVCacheBuilder.for_model(model, "h2o:budget=16")


def test_the_attention_hook_is_installed_only_when_needed():
    from kvpolicy_core.attention import hook as attention

    refs = lambda name: attention._patched.get(name, (None, 0))[1]  # noqa: E731  installs per module
    model = tiny_llama(seed=4)
    before = refs("mlx_lm.models.llama")
    KVCacheBuilder.for_model(model, "h2o:budget=16,signal=proxy")  # proxy signal, global layers: no hook
    assert "_kvpolicy_attention_hook" not in model.__dict__ and refs("mlx_lm.models.llama") == before
    caches = KVCacheBuilder.for_model(model, "h2o:budget=16")  # the default (observed) needs the real queries
    assert refs("mlx_lm.models.llama") == before + 1 and caches[0].attention_hook.active
    del caches  # the install lives as long as the caches that need it
    assert refs("mlx_lm.models.llama") == before
    gemma = tiny_model("gemma3_text")
    before = refs("mlx_lm.models.gemma3_text")
    caches = KVCacheBuilder.for_model(
        gemma, "h2o:budget=16,signal=proxy"
    )  # sliding-window layers need the per-layer mask
    assert refs("mlx_lm.models.gemma3_text") == before + 1
    detach(gemma)  # nothing attached: the caches keep their hook
    assert refs("mlx_lm.models.gemma3_text") == before + 1
    del caches
    assert refs("mlx_lm.models.gemma3_text") == before


def test_readme_first_example_generate_with_prompt_cache(tiny_model_dir):
    import mlx_lm

    from kvpolicy_core import KVCacheConfig

    model, tokenizer = mlx_lm.load(str(tiny_model_dir))
    caches = KVCacheBuilder.for_model(model, KVCacheConfig(method="cam", head_dim=16, cam_budget=16, cam_n_sink=4))
    text = mlx_lm.generate(model, tokenizer, "Once upon a time, far away", max_tokens=20, prompt_cache=caches)
    assert isinstance(text, str) and len(text) > 0
    cache = caches[0]
    assert cache.tokens_kept == 16 and cache.offset >= 26 and cache.compression_ratio > 1
    assert (cache.merge_mode, cache.merge_gate) == ("mass", False) and cache.merges > 0 and cache.gate_draws == 0


def test_a_saved_tiny_llama_directory_holds_the_in_memory_weights(tmp_path):
    """The same seed gives the same weights whether a test builds the model or loads its directory."""
    import numpy as np
    from mlx.utils import tree_flatten

    from kvpolicy_core.testing.tiny_models import write_tiny_llama_dir

    path = write_tiny_llama_dir(tmp_path / "m", seed=3)
    saved = mx.load(str(path / "model.safetensors"))
    built = dict(tree_flatten(tiny_llama(seed=3).parameters()))
    assert set(saved) == set(built) and all(np.array_equal(np.array(saved[k]), np.array(built[k])) for k in built)
    assert json.loads((path / "config.json").read_text())["vocab_size"] == 97
