"""Token ids of task text, built piece by piece so each piece's positions are known (no mlx imported)."""

from __future__ import annotations

from typing import List


def encode(tokenizer, text: str) -> List[int]:
    """``text``'s token ids without the tokenizer's special tokens (no BOS)."""
    return list(tokenizer.encode(text, add_special_tokens=False))


def bos_ids(tokenizer) -> List[int]:
    """The ids the tokenizer puts before a text (Gemma's ``<bos>``; none for SmolLM2)."""
    with_special = list(tokenizer.encode("a"))
    plain = encode(tokenizer, "a")
    return with_special[: len(with_special) - len(plain)]
