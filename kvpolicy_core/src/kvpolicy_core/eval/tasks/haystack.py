"""Haystack texts that every machine has, no download: two different sources.

- ``pydoc``: CPython's ``pydoc_data.topics`` (the default corpus, reference prose).
- ``stdlib``: the docstrings of a fixed list of standard-library modules and of their
  public classes and functions (API prose of another kind, written by other authors).
- ``license``: CPython's ``LICENSE.txt`` where the installation ships it.
- any other value is read as a path to a UTF-8 text file.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import sys
import warnings
from pathlib import Path
from typing import List

STDLIB_MODULES = (
    "argparse",
    "calendar",
    "collections",
    "contextlib",
    "csv",
    "dataclasses",
    "datetime",
    "decimal",
    "difflib",
    "email.message",
    "enum",
    "fractions",
    "functools",
    "heapq",
    "http.client",
    "inspect",
    "ipaddress",
    "itertools",
    "json",
    "logging",
    "operator",
    "pathlib",
    "pickle",
    "queue",
    "random",
    "re",
    "sched",
    "selectors",
    "shutil",
    "socket",
    "statistics",
    "string",
    "subprocess",
    "tarfile",
    "textwrap",
    "threading",
    "typing",
    "unittest.case",
    "urllib.parse",
    "zipfile",
)
SOURCES = ("pydoc", "stdlib", "license")


@functools.lru_cache(maxsize=None)
def stdlib_docstrings() -> str:
    """Docstrings of :data:`STDLIB_MODULES` and their public classes/functions, in a fixed order."""
    parts: List[str] = []
    for name in STDLIB_MODULES:
        mod = importlib.import_module(name)
        doc = inspect.getdoc(mod)
        if doc:
            parts.append(doc)
        for attr, obj in sorted(vars(mod).items()):
            if attr.startswith("_") or getattr(obj, "__module__", None) != mod.__name__:
                continue
            if inspect.isclass(obj) or inspect.isfunction(obj):
                with warnings.catch_warnings():  # typing.io / typing.re warn when read
                    warnings.simplefilter("ignore", DeprecationWarning)
                    doc = inspect.getdoc(obj)
                if doc and len(doc) > 80:
                    parts.append(doc)
    text = "\n\n".join(parts)
    if len(text) < 20000:
        raise RuntimeError("the stdlib haystack needs docstrings; this Python was run with -OO (docstrings stripped)")
    return text


def license_text() -> str:
    for base in (sys.base_prefix, sys.prefix):
        for p in sorted(Path(base).glob("lib/python3*/LICENSE.txt")) + [Path(base) / "LICENSE.txt"]:
            if p.is_file():
                return p.read_text(encoding="utf-8", errors="replace")
    raise FileNotFoundError("haystack 'license': this Python installation ships no LICENSE.txt; use pydoc or stdlib")


def haystack_text(source: str) -> str:
    """The text of a haystack source (see the module docstring)."""
    if source == "pydoc":
        from ...model.corpus import default_corpus

        return default_corpus()
    if source == "stdlib":
        return stdlib_docstrings()
    if source == "license":
        return license_text()
    path = Path(source)
    if not path.is_file():
        raise FileNotFoundError(f"haystack {source!r}: not one of {', '.join(SOURCES)} and not a file")
    return path.read_text(encoding="utf-8", errors="replace")
