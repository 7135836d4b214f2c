"""Every distribution carries the contract's version (the CHANGELOG's newest), and every pin on kvpolicy-core, the
shipped ones and the docs' examples, admits it: a plugin can pin the contract it needs."""

import re
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).parents[1]
DISTRIBUTIONS = {
    "kvpolicy_core": "kvpolicy_core",
    "kvpolicy_h2o": "kvpolicy_h2o",
    "kvpolicy_cam": "kvpolicy_cam",
    "examples/kvpolicy-streaming": "kvpolicy_streaming",
    "examples/kvpolicy-table": "kvpolicy_table",
}


def contract_version() -> str:
    return re.search(r"^## (\d+\.\d+\.\d+)", (ROOT / "CHANGELOG.md").read_text(), re.M).group(1)


def core_pins(text: str):
    return [Requirement(d) for d in re.findall(r'"(kvpolicy-core[^"\[]*)"', text) if any(c in d for c in "<>=")]


@pytest.mark.parametrize("folder, package", sorted(DISTRIBUTIONS.items()))
def test_each_distribution_has_the_contracts_version_and_admits_its_core(folder, package):
    version = contract_version()
    pyproject = (ROOT / folder / "pyproject.toml").read_text()
    assert re.search(r'^version = "(.*)"', pyproject, re.M).group(1) == version
    init = (ROOT / folder / "src" / package / "__init__.py").read_text()
    assert re.search(r'^__version__ = "(.*)"', init, re.M).group(1) == version
    for pin in core_pins(pyproject.split("[project.optional-dependencies]")[0]):
        assert pin.specifier.contains(version), f"{folder} pins {pin}, which excludes {version}"


@pytest.mark.parametrize("page", ["docs/plugins/tutorial.md", "docs/plugins/minimal.md"])
def test_the_docs_example_pins_admit_the_contracts_version(page):
    pins = core_pins((ROOT / page).read_text())
    assert pins and all(pin.specifier.contains(contract_version()) for pin in pins)
