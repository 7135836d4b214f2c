"""The manual holds together: every relative link in README.md and docs/ names a file that exists, and no page
ships an unfilled placeholder."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").rglob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
PLACEHOLDER = re.compile(r"^[A-Z][A-Z_]{3,}$|\b(PLACEHOLDER|TODO|TBD|XXX)\b|\b[A-Z]+_TIME\b")


def _code_free(text: str) -> str:
    """The page without fenced code blocks (code may hold anything)."""
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    missing = []
    for target in LINK.findall(_code_free(page.read_text())):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        path = target.split("#", 1)[0]
        if path and not (page.parent / path).exists():
            missing.append(target)
    assert not missing, f"{page.relative_to(ROOT)} links to missing files: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_unfilled_placeholders(page):
    found = [line for line in _code_free(page.read_text()).splitlines() if PLACEHOLDER.search(line.strip())]
    assert not found, f"{page.relative_to(ROOT)} has placeholders: {found}"
