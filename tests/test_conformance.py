"""The test kit's conformance suite over every method this repository ships: one shared matrix."""

import pytest
from helpers import SHIPPED_METHODS, with_fields

from kvpolicy_core.testing.conformance import PolicyConformance, run_conformance

#: the schedule's variants (kvpolicy_core.parts.allocation, when=prompt_end) on the shipped methods
SCHEDULES = ["h2o:when=prompt_end", "cam:when=prompt_end,allocation=pyramid", "h2o:signal=proxy,allocation=pyramid"]
SHIPPED = [with_fields(m, "budget=16,n_sink=2") for m in SHIPPED_METHODS + SCHEDULES]


@pytest.fixture(params=SHIPPED, ids=lambda m: m.replace(":", "-"))
def _method(request):
    return request.param


class TestShippedMethods(PolicyConformance):
    @pytest.fixture(autouse=True)
    def _use(self, _method):
        self.method = _method


def test_run_conformance_helper_runs_every_check():
    names = run_conformance("h2o:budget=12,n_sink=2")
    assert "test_budget_held_and_sinks_kept" in names and len(names) >= 6
