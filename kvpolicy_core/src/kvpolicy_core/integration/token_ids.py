"""Token ids checked against the model's vocabulary where they enter (JSONL contexts, ``compress_context``, the
server's prompts): an id past the embedding's rows is an out-of-bounds read (``10**9`` segfaulted; ``5000`` with a
vocabulary of 97 ran silently on whatever memory it read).

No mlx is imported: :func:`model_vocab_size` reads the model's config and its token embedding's shape.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional, Type

from ..errors import KVPolicyError

#: Names of the token embedding in mlx-lm's models (``model.embed_tokens``, GPT-2's ``wte``, ...).
EMBEDDING_NAMES = ("embed_tokens", "wte", "tok_embeddings", "word_embeddings", "embedding")


class TokenIdError(KVPolicyError, ValueError):
    """A token id outside the model's vocabulary (or not a non-negative integer); the message names its source."""


def model_vocab_size(model: Any) -> Optional[int]:
    """The ids ``model`` can embed: the smallest of its config's ``vocab_size`` (or its text config's) and its token
    embedding's rows; None when neither is found."""
    found = []
    args = getattr(model, "args", None)
    for source in (args, getattr(args, "text_config", None)):
        n = source.get("vocab_size") if isinstance(source, dict) else getattr(source, "vocab_size", None)
        if isinstance(n, int) and not isinstance(n, bool) and n > 0:
            found.append(n)
    rows = _embedding_rows(model)
    if rows:
        found.append(rows)
    return min(found) if found else None


def _embedding_rows(model: Any) -> Optional[int]:
    named = getattr(model, "named_modules", None)
    if named is None:
        return None
    try:
        modules = named()
    except (TypeError, AttributeError, ValueError):  # not an mlx module tree: the config's vocab_size is all there is
        return None
    for name, module in modules:
        if name.rpartition(".")[2] not in EMBEDDING_NAMES:
            continue
        n = getattr(module, "num_embeddings", None)  # QuantizedEmbedding keeps it (its weight is packed)
        if n is None and getattr(module, "weight", None) is not None and len(module.weight.shape) == 2:
            n = module.weight.shape[0]
        if isinstance(n, int) and n > 0:
            return n
    return None


def check_token_ids(
    ids: Iterable[int], vocab_size: Optional[int], where: str, error: Type[Exception] = TokenIdError
) -> None:
    """Every id an integer in ``[0, vocab_size)`` (``vocab_size`` None: only non-negative), else ``error`` naming
    ``where`` (the ids' source, e.g. ``"file.jsonl:3.context_ids"``), the first bad id and the allowed range.

    ``ids``: a sequence of ints, or an array with ``min``/``max`` (NumPy, MLX: read once each, no copy)."""
    span = f"0 to {vocab_size - 1}" if vocab_size else "non-negative"
    if hasattr(ids, "shape") and hasattr(ids, "max") and not isinstance(ids, (list, tuple)):
        if getattr(ids, "size", 1) == 0:
            return
        kind = str(getattr(ids, "dtype", ""))
        if "int" not in kind:
            raise error(f"{where}: token ids must be integers (got an array of {kind})")
        lo, hi = int(ids.min().item()), int(ids.max().item())
        bad = lo if lo < 0 else (hi if vocab_size is not None and hi >= vocab_size else None)
        if bad is not None:
            raise error(f"{where}: token id {bad} is outside the model's vocabulary ({span})")
        return
    for i, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, int):
            if type(t).__name__.startswith(("int", "uint")) and hasattr(t, "item"):  # a NumPy/MLX integer scalar
                t = int(t.item())
            else:
                raise error(f"{where}: token id {t!r} at index {i} is not an integer")
        if t < 0 or (vocab_size is not None and t >= vocab_size):
            raise error(f"{where}: token id {t} at index {i} is outside the model's vocabulary ({span})")


def check_model_token_ids(model: Any, ids: Iterable[int], where: str, error: Type[Exception] = TokenIdError) -> None:
    """:func:`check_token_ids` against ``model``'s vocabulary (:func:`model_vocab_size`)."""
    check_token_ids(ids, model_vocab_size(model), where, error)
