"""Interoperation with mlx-lm's own cache files.

mlx-lm's ``load_prompt_cache`` looks cache classes up by name in ``mlx_lm.models.cache``;
:func:`register_with_mlx_lm` makes ``PolicyCache`` and ``BatchPolicyCache`` two of those names
(done when :mod:`kvpolicy_core.cache.policy_cache` is imported, so any process that can have saved a policy
cache can load one). The classes' ``from_state`` restores everything a cache needs in a new
process, the attention hook included (:mod:`kvpolicy_core.cache.state`).
"""

from __future__ import annotations

import mlx_lm.models.cache as mlx_cache


def register_with_mlx_lm(cls: type) -> None:
    """Make ``cls`` loadable by ``mlx_lm.models.cache.load_prompt_cache`` (idempotent)."""
    if getattr(mlx_cache, cls.__name__, None) is not cls:
        setattr(mlx_cache, cls.__name__, cls)
