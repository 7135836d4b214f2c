"""Module paths of kvpolicy-core 0.2 that moved into subpackages: still importable, with a DeprecationWarning.

``import kvpolicy_core.slots`` gives the very module ``kvpolicy_core.cache.slots`` (one module object, so a
patch through either name is seen by both). Submodules of a moved package (``kvpolicy_core.tasks.needle``)
follow their package.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

MOVED = {
    "kvpolicy_core.model.tiny": "kvpolicy_core.testing.tiny_models",
    "kvpolicy_core.attention_bias": "kvpolicy_core.attention.bias",
    "kvpolicy_core.attention_config": "kvpolicy_core.plugin.attention_config",
    "kvpolicy_core.attention_weights": "kvpolicy_core.attention.weights",
    "kvpolicy_core.batch_cache": "kvpolicy_core.cache.batch",
    "kvpolicy_core.batch_rows": "kvpolicy_core.cache.batch_rows",
    "kvpolicy_core.blas": "kvpolicy_core.runtime.blas",
    "kvpolicy_core.blas_check": "kvpolicy_core.runtime.blas_check",
    "kvpolicy_core.blas_elf": "kvpolicy_core.runtime.blas_elf",
    "kvpolicy_core.builder": "kvpolicy_core.integration.builder",
    "kvpolicy_core.builtin": "kvpolicy_core.plugin.builtin",
    "kvpolicy_core.cache_diagnostics": "kvpolicy_core.cache.diagnostics",
    "kvpolicy_core.cache_state": "kvpolicy_core.cache.state",
    "kvpolicy_core.cli": "kvpolicy_core.apps.cli",
    "kvpolicy_core.compiled_parts": "kvpolicy_core.cache.compiled",
    "kvpolicy_core.distributed": "kvpolicy_core.runtime.distributed",
    "kvpolicy_core.evaluation": "kvpolicy_core.eval.perplexity",
    "kvpolicy_core.hookspecs": "kvpolicy_core.plugin.hookspecs",
    "kvpolicy_core.interop": "kvpolicy_core.cache.interop",
    "kvpolicy_core.persistence": "kvpolicy_core.integration.persistence",
    "kvpolicy_core.plugins": "kvpolicy_core.plugin.discovery",
    "kvpolicy_core.policy": "kvpolicy_core.config.policy",
    "kvpolicy_core.policy_config": "kvpolicy_core.plugin.policy_config",
    "kvpolicy_core.policy_step": "kvpolicy_core.cache.step",
    "kvpolicy_core.prompt_file": "kvpolicy_core.apps.prompt_file",
    "kvpolicy_core.registry": "kvpolicy_core.plugin.registry",
    "kvpolicy_core.restore_checks": "kvpolicy_core.cache.restore_checks",
    "kvpolicy_core.serve": "kvpolicy_core.apps.serve",
    "kvpolicy_core.serve_requests": "kvpolicy_core.apps.serve_requests",
    "kvpolicy_core.sharding": "kvpolicy_core.runtime.sharding",
    "kvpolicy_core.shipped_parts": "kvpolicy_core.parts.shipped",
    "kvpolicy_core.slots": "kvpolicy_core.cache.slots",
    "kvpolicy_core.tasks": "kvpolicy_core.eval.tasks",
    "kvpolicy_core.textfile": "kvpolicy_core.apps.textfile",
    "kvpolicy_core.tiny_models": "kvpolicy_core.testing.tiny_models",
    "kvpolicy_core.value_checks": "kvpolicy_core.cache.checks",
    "kvpolicy_core.window": "kvpolicy_core.attention.window",
    "kvpolicy_core.with_mlx_lm": "kvpolicy_core.apps.with_mlx_lm",
}


def new_name(old: str):
    """The module an old path now names, or None."""
    for prefix, new in MOVED.items():
        if old == prefix or old.startswith(prefix + "."):
            return new + old[len(prefix) :]
    return None


class _Alias(importlib.abc.Loader):
    def __init__(self, new: str) -> None:
        self.new = new

    def create_module(self, spec):
        warnings.warn(
            f"{spec.name} is deprecated: import {self.new} (the module moved)", DeprecationWarning, stacklevel=4
        )
        module = importlib.import_module(self.new)
        self._spec = module.__spec__
        return module

    def exec_module(self, module) -> None:
        module.__spec__ = self._spec  # the import system set the alias's spec on the real module: put it back


class _MovedFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if not fullname.startswith("kvpolicy_core."):
            return None
        new = new_name(fullname)
        return None if new is None else importlib.util.spec_from_loader(fullname, _Alias(new))


def install() -> None:
    if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
        sys.meta_path.append(_MovedFinder())
