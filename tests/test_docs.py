"""docs/plugins/hooks.md documents every hook spec with its exact signature, and nothing else."""

import inspect
import re
from pathlib import Path

from kvpolicy_core.plugin import hookspecs

DOC = Path(__file__).resolve().parents[1] / "docs" / "plugins" / "hooks.md"


def specs():
    return {
        name: f"{name}{inspect.signature(fn)}"
        for name, fn in vars(hookspecs).items()
        if callable(fn) and hasattr(fn, "kvpolicy_spec")
    }


def documented():
    """{hook name: documented signature} from the `## `name(args)`` headings."""
    return {m[2]: m[1] for m in re.finditer(r"^## `((\w+)\(.*\))`", DOC.read_text(), flags=re.M)}


def test_every_hook_spec_is_documented_with_its_signature():
    docs = documented()
    assert len(specs()) == 5
    for name, signature in specs().items():
        assert name in docs, f"hook {name} is not documented in {DOC}"
        assert docs[name] == signature, f"{DOC} documents {docs[name]!r}, the spec is {signature!r}"


def test_no_documented_hook_is_missing():
    assert set(documented()) == set(specs()), "hooks.md documents hooks that no longer exist"


def test_versions_table_accounts_for_every_hook():
    """The release of each hook is in hooks.md's versions table (not in the spec's docstring): the 0.1.0 row's
    "four registration hooks" and the later rows, which name theirs."""
    rows = dict(re.findall(r"^\| (\d+\.\d+\.\d+) \| (.*) \|$", DOC.read_text(), flags=re.M))
    later = {name for name in specs() if any(f"`{name}`" in row for v, row in rows.items() if v != "0.1.0")}
    assert "four registration hooks" in rows["0.1.0"]
    assert len(specs()) - len(later) == 4, later
