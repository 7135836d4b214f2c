"""kvpolicy-table's own tests, shipped with the distribution: each method is registered by its own entry point,
passes kvpolicy's public conformance kit, and equals H2O bit for bit where the specification says it does (the
public equivalence kit)."""

import pytest

from kvpolicy_core import get_registry
from kvpolicy_core.testing.conformance import PolicyConformance
from kvpolicy_core.testing.equivalence import assert_equivalent

TABLE = ["snapkv", "pyramidkv", "chunkkv", "squeeze"]


def test_every_method_of_the_table_is_registered_by_its_own_entry_point():
    methods = get_registry().methods()
    for name in TABLE:
        assert methods[name].dist == "kvpolicy-table" and methods[name].plugin == name


@pytest.mark.parametrize(
    "a, b",
    [
        ("chunkkv:budget=12,n_sink=2,chunk_size=1", "h2o:budget=12,n_sink=2"),
        ("pyramidkv:budget=12,n_sink=2,pyramid_beta=1", "h2o:budget=12,n_sink=2"),
        ("snapkv:budget=12,n_sink=2", "h2o:budget=12,n_sink=2,when=prompt_end,obs_window=32,pool=7"),
        ("squeeze:budget=12,n_sink=2,strength=0", "h2o:budget=12,n_sink=2,when=prompt_end"),
    ],
    ids=["chunk_size=1 is h2o", "a flat pyramid is h2o", "snapkv is h2o's prompt-end cut", "strength=0 is h2o"],
)
def test_the_specifications_equivalences_hold_bit_for_bit(a, b):
    assert_equivalent(a, b)


@pytest.fixture(params=[f"{m}:budget=16,n_sink=2" for m in TABLE] + ["chunkkv:budget=16,n_sink=2,chunk_size=3"])
def _method(request):
    return request.param


class TestTableConformance(PolicyConformance):
    @pytest.fixture(autouse=True)
    def _use(self, _method):
        self.method = _method
