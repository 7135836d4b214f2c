"""Real models: the GGUF -> mlx-lm converter, the embedded default model, the default corpus.

Importing this package silences one message of transformers (:func:`quiet_transformers`): kvpolicy runs
models with MLX and uses transformers only for tokenizers, so its "PyTorch was not found" advice (printed when
mlx-lm's loader or the converter imports transformers) only misleads.
"""

import logging

#: the start of transformers' advice at import when PyTorch is not installed
NO_TORCH = "PyTorch was not found"


class _NoTorchAdvice(logging.Filter):
    """Drops transformers' "PyTorch was not found" record; every other record passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (isinstance(record.msg, str) and record.msg.startswith(NO_TORCH))


def quiet_transformers() -> None:
    """Filter that one message out of the ``transformers`` logger (idempotent; works before or after
    transformers is imported; its other warnings are kept)."""
    logger = logging.getLogger("transformers")
    if not any(isinstance(f, _NoTorchAdvice) for f in logger.filters):
        logger.addFilter(_NoTorchAdvice())


quiet_transformers()
