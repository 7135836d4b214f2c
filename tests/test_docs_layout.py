"""The manual teaches first: guides stay at docs/, measurements live under docs/results/, one topic a page. Every
results page is at most 300 lines (split along its sections past that; history belongs in CHANGELOG.md and git),
every one is listed on docs/results/index.md, and the README stays at most 150 lines. The lab notebook stays
tidy: every file under benchmarks/results/ is linked from the page that cites it (a result nothing cites is
superseded: git keeps it, the tree does not), and every benchmarks/results path a page names exists."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"
PAGES = sorted(RESULTS.rglob("*.md"))
DATA = ROOT / "benchmarks" / "results"
#: the pages a result file may be linked from
CITING = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
#: benchmarks/results/local/ is the demo's scratch folder (ignored by git)
DATA_FILES = sorted(p for p in DATA.rglob("*") if p.is_file() and "local" not in p.relative_to(DATA).parts[:1])
NAMED = re.compile(r"benchmarks/results/([A-Za-z0-9_.+-]+\.(?:json|jsonl|png|csv|md))\b")
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


def _linked_data_files() -> set:
    linked = set()
    for page in CITING:
        for target in re.findall(r"\]\(([^)\s#]+)", page.read_text(encoding="utf-8")):
            path = (page.parent / target).resolve()
            if DATA.resolve() in path.parents:
                linked.add(path)
    return linked


def test_every_result_file_is_linked_from_a_page():
    """A kept result is one a page cites for what it states: that page links it (a markdown link with a
    relative path), so a reader goes from the number to its data. A file no page links is a superseded run or a
    smoke leftover: remove it from the tree (git keeps it), or link it where its numbers are quoted."""
    assert DATA_FILES
    linked = _linked_data_files()
    unlinked = [p.relative_to(ROOT).as_posix() for p in DATA_FILES if p.resolve() not in linked]
    assert not unlinked, f"{len(unlinked)} result files no page under docs/ or README.md links: {unlinked}"


def test_every_named_result_path_exists():
    """A page that names benchmarks/results/X (in prose, a code span or a command) names a file that exists."""
    missing = []
    for page in CITING:
        for name in NAMED.findall(page.read_text(encoding="utf-8")):
            if not (DATA / name).is_file():
                missing.append(f"{page.relative_to(ROOT)}: benchmarks/results/{name}")
    assert not missing, f"pages name result files that do not exist: {missing}"


def test_no_smoke_run_among_the_results():
    """Smoke runs check that a program runs; their files are written outside benchmarks/results."""
    smoke = [p.name for p in DATA_FILES if "_smoke" in p.stem]
    assert not smoke, f"smoke-run files in benchmarks/results: {smoke}"
