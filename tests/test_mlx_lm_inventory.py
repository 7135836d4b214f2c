"""The private mlx-lm names kvpolicy touches are exactly those listed (kvpolicy_core.integration.mlx_lm_private),
the installed mlx-lm has them, the architecture page's table lists them, and the recorded version is the installed
one (else the test says what differs)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import mlx_lm

from kvpolicy_core.integration import mlx_lm_private as inventory

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ["kvpolicy_core/src", "kvpolicy_h2o/src", "kvpolicy_cam/src", "examples"]
#: kvpolicy's own private attributes whose names mlx-lm happens to use too (each defined by kvpolicy, asserted below)
OWN_NAMES = {"_counters", "_step", "_values"}
SECTION = "## What kvpolicy changes in mlx-lm"


def _files(dirs):
    for d in dirs:
        yield from sorted(Path(d).rglob("*.py"))


def _touched(files) -> dict:
    """Private names (``_x``, not dunders) read or set as attributes, or defined as methods, -> the files."""
    out: dict = {}
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = []
            if isinstance(node, ast.Attribute):
                names.append(node.attr)
            elif isinstance(node, ast.ClassDef):
                names += [f.name for f in node.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))]
            for name in names:
                if name.startswith("_") and not name.startswith("__"):
                    out.setdefault(name, set()).add(str(path))
    return out


def _defined(files) -> set:
    """Private names a package defines: functions, classes, assigned names and attributes."""
    out = set()
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                out.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                out.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                out.add(node.id)
    return {n for n in out if n.startswith("_") and not n.startswith("__")}


def test_the_code_touches_exactly_the_listed_private_mlx_lm_names():
    ours = list(_files(ROOT / d for d in SOURCES))
    mlx_lm_names = _defined(_files([Path(mlx_lm.__file__).parent]))
    touched = _touched(ours)
    shared = set(touched) & mlx_lm_names
    listed = {name for _, name in inventory.PRIVATE}
    assert OWN_NAMES <= _defined(ours)
    unlisted = {n: sorted(touched[n]) for n in shared - listed - OWN_NAMES}
    assert not unlisted, f"private mlx-lm names used but not in mlx_lm_private.PRIVATE: {unlisted}"
    assert listed <= shared, f"listed but no longer used: {sorted(listed - shared)}"


def test_the_installed_mlx_lm_has_every_listed_name():
    assert inventory.missing() == [], inventory.missing_message()


def test_the_architecture_page_lists_exactly_these_names_and_the_version():
    text = (ROOT / "docs/architecture.md").read_text()
    assert SECTION in text
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")][2:]  # past the header and its rule
    named = set()
    for row in rows:  # the "What" column names mlx-lm's class and private name: `Class._name`
        named |= set(re.findall(r"`(\w+)\.(_[a-z]\w*)`", row.split("|")[1]))
    want = {(owner.rpartition(".")[2], name) for owner, name in inventory.PRIVATE}
    assert named == want, f"table: {sorted(named - want)} extra, {sorted(want - named)} missing"
    assert f"mlx-lm {inventory.CHECKED_WITH}" in section


def test_the_recorded_mlx_lm_version_is_the_installed_one():
    installed = inventory.installed_version()
    if installed != inventory.CHECKED_WITH:
        gone = inventory.missing()
        raise AssertionError(
            f"mlx-lm {installed} is installed, the inventory was checked against {inventory.CHECKED_WITH}: "
            + (f"{', '.join(gone)} are gone" if gone else "every listed private name is still there")
            + "; re-read them in the new release, then update CHECKED_WITH and docs/architecture.md"
        )


def test_a_name_mlx_lm_no_longer_has_is_named_with_both_versions(monkeypatch):
    gone = ("mlx_lm.server.ResponseGenerator", "_renamed_in_a_later_release")
    monkeypatch.setattr(inventory, "PRIVATE", (*inventory.PRIVATE, gone))
    message = inventory.missing_message(("mlx_lm.server.ResponseGenerator",))
    assert "ResponseGenerator._renamed_in_a_later_release" in message
    assert f"checked against mlx-lm {inventory.CHECKED_WITH}" in message
    assert inventory.missing_message(("mlx_lm.server.APIHandler",)) is None
