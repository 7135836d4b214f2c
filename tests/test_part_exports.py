"""What a plugin author subclasses or reads is importable from the package root, and the docs state each shipped
method's real defaults."""

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


def test_the_allocation_hookspec_names_the_real_default():
    default = parse_config("h2o").policy.allocation
    assert f"``{default}`` (the default)" in hookspecs.register_allocations.__doc__


@pytest.mark.parametrize("method", ["pyramidkv", "chunkkv"])
def test_the_method_pages_state_the_default_schedule(method):
    when = parse_config(method).policy.when
    text = (DOCS / "methods" / f"{method}.md").read_text()
    assert re.search(rf'^\| `when` \| `"{when}"` \|', text, re.M)
    assert "streams by default" not in " ".join(text.split())
