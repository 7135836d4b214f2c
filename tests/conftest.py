"""Shared fixtures: tiny random-weight mlx-lm models and random K/V streams (helpers live in helpers.py)."""

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
