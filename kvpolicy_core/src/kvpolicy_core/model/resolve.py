"""Which model a ``--model`` argument names: a local mlx-lm directory, ``"smollm2"`` or (None) the default.

Kept apart from :mod:`.default` and :mod:`.smollm2` (which imports the default model's constants), so that
the two families do not import each other.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from . import default


def resolve_model_path(model: Optional[str], dtype: str = "float32") -> Path:
    """``model`` if given (a local mlx-lm directory, or ``"smollm2"``), else the default model."""
    if model == "smollm2":
        from .smollm2 import ensure_smollm2

        return ensure_smollm2(dtype)
    return default.resolve_model_path(model, dtype)
