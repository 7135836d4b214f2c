"""Converting or loading a model prints no "[transformers] PyTorch was not found" advice (kvpolicy runs models with
MLX; transformers only builds tokenizers): the conversion's import path, in a new process, says nothing of
PyTorch, while transformers' other warnings still show."""

from __future__ import annotations

import os
import subprocess
import sys

CODE = """
import logging
import kvpolicy_core.model.gguf_convert  # the conversion's module (kvpolicy convert, the default model)
import kvpolicy_core.model.default
import transformers, mlx_lm.utils  # what the converter and mlx-lm's loader import
logging.getLogger("transformers").warning("another transformers warning")
"""


def test_the_conversion_import_path_prints_no_pytorch_advice():
    # mlx_lm's import sets this for its own process (this one's, inherited): the converter imports transformers first
    env = {k: v for k, v in os.environ.items() if k != "TRANSFORMERS_NO_ADVISORY_WARNINGS"}
    proc = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "PyTorch was not found" not in proc.stderr, proc.stderr
    assert "another transformers warning" in proc.stderr, proc.stderr
