"""kvpolicy-h2o's own tests, shipped with the distribution: ``h2o`` is registered through the distribution's
entry point and passes kvpolicy's public conformance kit (the equations are tested in the repository's tests/)."""

from importlib.metadata import entry_points

from kvpolicy_core import get_registry
from kvpolicy_core.testing.conformance import PolicyConformance


def test_h2o_is_registered_through_its_entry_point():
    (point,) = [e for e in entry_points(group="kvpolicy") if e.name == "h2o"]
    assert point.value == "kvpolicy_h2o.plugin"
    entry = get_registry().methods()["h2o"]
    assert (entry.dist, entry.plugin) == ("kvpolicy-h2o", "h2o")
    assert entry.obj.config_class.__module__ == "kvpolicy_h2o.config"


class TestH2O(PolicyConformance):  # the default: the model's queries (the attention hook), cut at the prompt's end
    method = "h2o:budget=16,n_sink=2"


class TestH2OProxy(PolicyConformance):  # each new key as the query, evicting as it streams
    method = "h2o:budget=16,n_sink=2,signal=proxy,when=stream"
