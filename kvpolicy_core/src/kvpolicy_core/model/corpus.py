"""The default evaluation corpus: CPython's ``pydoc_data.topics``, on every machine, no download."""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Optional


def default_corpus() -> str:
    """All pydoc topics (~465 KB of English reference prose), sorted by name, joined deterministically."""
    from pydoc_data.topics import topics

    return "\n\n".join(f"{name}\n\n{topics[name].strip()}" for name in sorted(topics))


def load_corpus(paths: Optional[Iterable[str]] = None) -> str:
    """The default corpus, or the named text files joined by blank lines (in the given order)."""
    paths = list(paths or [])
    if not paths:
        return default_corpus()
    texts = []
    for p in paths:
        path = Path(p)
        if not path.is_file():
            raise FileNotFoundError(f"corpus file not found: {p}")
        texts.append(path.read_text(encoding="utf-8", errors="replace"))
    return "\n\n".join(texts)
