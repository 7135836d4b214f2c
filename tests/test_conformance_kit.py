"""What the conformance kit promises: an allocation that does not keep its stated mean fails it, and budgets past
the kit's documented maximum are refused before any work."""

import time

import pytest

from kvpolicy_core import hookimpl
from kvpolicy_core.parts.allocation import Allocation
from kvpolicy_core.plugin.discovery import register_plugin, unregister_plugin
from kvpolicy_core.testing.conformance import KIT_MAX_BUDGET, PolicyConformance, run_conformance


class Triple(Allocation):
    """Every layer three times the budget: the mean is not ``budget``."""

    def budgets(self, budget, layers, stats=None):
        return [3 * budget] * len(layers)


class Half(Allocation):
    def budgets(self, budget, layers, stats=None):
        return [max(budget // 2, 1)] * len(layers)


class Allocations:
    @hookimpl
    def register_allocations(self, register):
        register("triple", Triple)
        register("half", Half)


@pytest.fixture
def allocations():
    register_plugin(Allocations(), "allocs")
    yield
    unregister_plugin("allocs")


@pytest.mark.parametrize("allocation", ["triple", "half"])
def test_an_allocation_that_breaks_its_mean_fails_the_kit(allocations, allocation):
    suite = type("Suite", (PolicyConformance,), {"method": f"h2o:budget=16,n_sink=2,allocation={allocation}"})()
    with pytest.raises(AssertionError, match=rf"allocation '{allocation}' of plugin 'allocs': budgets"):
        suite.test_the_allocation_keeps_its_stated_mean()


@pytest.mark.parametrize("allocation", ["reach", "uniform", "pyramid"])
def test_the_shipped_allocations_keep_their_mean(allocation):
    suite = type("Suite", (PolicyConformance,), {"method": f"h2o:budget=16,n_sink=2,allocation={allocation}"})()
    suite.test_the_allocation_keeps_its_stated_mean()


@pytest.mark.parametrize("budget", [KIT_MAX_BUDGET + 1, 2**30, 2**31 - 1])
def test_budgets_past_the_kits_maximum_are_refused_at_once(budget):
    start = time.monotonic()
    with pytest.raises(ValueError, match=rf"budget {budget} is above the conformance kit's maximum of 4096"):
        run_conformance(f"h2o:budget={budget},n_sink=2")
    assert time.monotonic() - start < 30


def test_a_layer_allocated_past_the_maximum_is_refused(allocations):
    suite = type("Suite", (PolicyConformance,), {"method": f"h2o:budget={KIT_MAX_BUDGET},n_sink=2,allocation=triple"})()
    with pytest.raises(ValueError, match=rf"budget {3 * KIT_MAX_BUDGET} is above"):
        suite.test_each_layer_gets_its_allocated_budget_and_keeps_it()
