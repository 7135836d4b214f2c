"""What a plugin author subclasses or reads is importable from the package root, and the docs state each shipped
method's real defaults."""

import importlib
import re
from pathlib import Path

import pytest

import kvpolicy_core
from kvpolicy_core.config.parse import parse_config
from kvpolicy_core.parts import allocation
from kvpolicy_core.plugin import hookspecs

DOCS = Path(__file__).parents[1] / "docs"


@pytest.mark.parametrize("name", ["Allocation", "LayerInfo", "LayerStats"])
def test_the_allocation_contract_is_exported_from_the_package(name):
    assert getattr(kvpolicy_core, name) is getattr(allocation, name) and name in kvpolicy_core.__all__


def test_the_allocation_contract_imports_by_name():
    from kvpolicy_core import Allocation, LayerInfo, LayerStats

    assert (Allocation, LayerInfo, LayerStats) == (allocation.Allocation, allocation.LayerInfo, allocation.LayerStats)


@pytest.mark.parametrize("module", ["kvpolicy_core", "kvpolicy_core.testing", "kvpolicy_core.testing.equivalence"])
def test_every_public_name_resolves(module):
    """Each name a public module lists in ``__all__`` imports (a stale entry would fail ``import *``)."""
    mod = importlib.import_module(module)
    missing = [name for name in mod.__all__ if not hasattr(mod, name)]
    assert not missing, f"{module}.__all__ lists names it does not have: {missing}"


def test_the_contract_page_names_every_part_class_it_exports():
    """minimal.md's part table: each class in it, and the allocation's LayerInfo/LayerStats, is a root export."""
    text = (DOCS / "plugins" / "minimal.md").read_text()
    table = text.split("**Parts**")[1].split("\n\n")[1]
    classes = [line.split("`")[1] for line in table.splitlines()[2:]]
    assert "Allocation" in classes
    for name in [*classes, "LayerInfo", "LayerStats"]:
        assert name in kvpolicy_core.__all__ and f"`{name}" in text


def test_the_allocation_hookspec_names_the_real_default():
    default = parse_config("h2o").policy.allocation
    assert f"``{default}`` (the default)" in hookspecs.register_allocations.__doc__


@pytest.mark.parametrize("method", ["pyramidkv", "chunkkv"])
def test_the_method_pages_state_the_default_schedule(method):
    when = parse_config(method).policy.when
    text = (DOCS / "methods" / f"{method}.md").read_text()
    assert re.search(rf'^\| `when` \| `"{when}"` \|', text, re.M)
    assert "streams by default" not in " ".join(text.split())
