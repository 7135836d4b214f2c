"""Small random-weight model directories for distributed runs: the names of :mod:`kvpolicy_core.tiny_models`.

:func:`write_model_dir` writes what ``mlx_lm.load`` and ``mlx_lm.utils.sharded_load`` read; see
:mod:`kvpolicy_core.tiny_models` for the configs, the models and the tokenizer.
"""

from __future__ import annotations

from ..tiny_models import ARCHITECTURES, SPECIALS, build_model, model_config, write_model_dir, write_tokenizer

__all__ = ["ARCHITECTURES", "SPECIALS", "build_model", "model_config", "write_model_dir", "write_tokenizer"]
