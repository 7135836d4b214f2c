"""kvpolicy-cam's own tests, shipped with the distribution: ``cam`` is registered through the distribution's entry
point, passes kvpolicy's public conformance kit, and ``cam:merge=drop`` is ``h2o`` bit for bit (the public
equivalence kit; the merge rules are tested in the repository's tests/)."""

from importlib.metadata import entry_points

from kvpolicy_core import get_registry
from kvpolicy_core.testing.conformance import PolicyConformance
from kvpolicy_core.testing.equivalence import assert_equivalent


def test_cam_is_registered_through_its_entry_point():
    (point,) = [e for e in entry_points(group="kvpolicy") if e.name == "cam"]
    assert point.value == "kvpolicy_cam.plugin"
    entry = get_registry().methods()["cam"]
    assert (entry.dist, entry.plugin) == ("kvpolicy-cam", "cam")
    assert entry.obj.config_class.__module__ == "kvpolicy_cam.config"
    assert entry.obj.part_names(entry.obj.config_class())["disposition"] == "mass_merge"


class TestCam(PolicyConformance):  # the default: mass merges, the model's queries
    method = "cam:budget=16,n_sink=2"


class TestCamSpecification(PolicyConformance):  # the specification's CaM: similarity-weighted, gated, proxy signal
    method = "cam:budget=16,n_sink=2,merge=sim_weighted,signal=proxy"


def test_cam_with_drop_is_h2o_bit_for_bit():
    assert_equivalent("cam:budget=12,n_sink=2,merge=drop", "h2o:budget=12,n_sink=2")
