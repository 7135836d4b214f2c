"""The manual teaches first: guides stay at docs/, measurements live under docs/results/, one topic a page. Every
results page is at most 300 lines (split along its sections past that; history belongs in CHANGELOG.md and git),
every one is listed on docs/results/index.md, and the README stays at most 150 lines."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"
PAGES = sorted(RESULTS.rglob("*.md"))
MOVED = ["long-context.md", "leaderboard.md", "benchmarks.md", "peers.md", "held-out-qa.md"]


def test_results_exist():
    assert (RESULTS / "index.md").is_file()
    assert len(PAGES) > 1


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_results_page_at_most_300_lines(page):
    n = len(page.read_text(encoding="utf-8").splitlines())
    assert n <= 300, f"{page.relative_to(ROOT)} has {n} lines (at most 300: split it along its sections)"


def test_readme_at_most_150_lines():
    n = len((ROOT / "README.md").read_text(encoding="utf-8").splitlines())
    assert n <= 150, f"README.md has {n} lines (at most 150)"


def test_index_lists_every_results_page():
    listed = set(re.findall(r"\]\(([^)#\s]+)", (RESULTS / "index.md").read_text(encoding="utf-8")))
    missing = [p.relative_to(RESULTS).as_posix() for p in PAGES if p.name != "index.md"]
    missing = [p for p in missing if p not in listed]
    assert not missing, f"docs/results/index.md does not list {missing}"


@pytest.mark.parametrize("name", MOVED)
def test_measurement_reports_are_not_guides(name):
    """The reports moved to docs/results/ (speed.md stays a guide: the BLAS set-up)."""
    assert not (ROOT / "docs" / name).exists(), f"docs/{name} is a results page: it lives under docs/results/"
