"""Interoperation with mlx-lm's own cache files.

mlx-lm's ``load_prompt_cache`` looks cache classes up by name in ``mlx_lm.models.cache``'s globals;
:func:`register_with_mlx_lm` makes ``PolicyCache`` and ``BatchPolicyCache`` two of those names. It runs when
:mod:`kvpolicy_core.cache.policy_cache` and :mod:`kvpolicy_core.cache.batch` are imported, and
``import kvpolicy_core`` imports those two as soon as ``mlx_lm.models.cache`` is imported too (in either
order), so any process that imports the package can load a policy cache with mlx-lm's own loader. The
classes' ``from_state`` restores everything a cache needs in a new process, the attention hook included
(:mod:`kvpolicy_core.cache.state`).
"""

from __future__ import annotations


def register_with_mlx_lm(cls: type) -> None:
    """Make ``cls`` loadable by ``mlx_lm.models.cache.load_prompt_cache`` (idempotent)."""
    # imported here, not at the top: importing mlx-lm's module runs the package's registration
    # (kvpolicy_core/__init__.py), which imports the modules that import this one
    import mlx_lm.models.cache as mlx_cache

    if getattr(mlx_cache, cls.__name__, None) is not cls:
        setattr(mlx_cache, cls.__name__, cls)
