"""Interoperation with mlx-lm's own cache files.

mlx-lm's ``load_prompt_cache`` looks cache classes up by name in ``mlx_lm.models.cache``;
:func:`register_with_mlx_lm` makes ``PolicyCache`` one of those names (done when
:mod:`kvpolicy_core.cache` is imported, so any process that can have saved a policy cache
can load one).
"""

from __future__ import annotations

import mlx_lm.models.cache as mlx_cache


def register_with_mlx_lm(cls: type) -> None:
    """Make ``cls`` loadable by ``mlx_lm.models.cache.load_prompt_cache`` (idempotent)."""
    if getattr(mlx_cache, cls.__name__, None) is not cls:
        setattr(mlx_cache, cls.__name__, cls)
