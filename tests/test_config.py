"""Configuration: every accepted form gives the same config; every bad input a clear error."""

import pytest

from kvpolicy_core import ConfigError, KVCacheConfig, UnknownMethodError, parse_config


def test_spec_api_works_as_written():
    c = KVCacheConfig(method="cam", head_dim=128, cam_budget=512, cam_n_sink=4, cam_merge="sim_weighted")
    assert (c.cam_budget, c.cam_n_sink, c.cam_merge, c.cam_merge_gate, c.cam_merge_keys) == (
        512,
        4,
        "sim_weighted",
        True,
        False,
    )
    h = KVCacheConfig(method="h2o", h2o_budget=256, h2o_n_sink=2)
    assert (h.h2o_budget, h.h2o_n_sink, h.seed) == (256, 2, 0)


def test_all_forms_give_the_same_config():
    want = KVCacheConfig(method="cam", cam_budget=256, cam_merge="mean", cam_merge_gate=False, seed=3)
    forms = [
        "cam:budget=256,merge=mean,gate=false,seed=3",
        " cam : budget = 256 , merge = mean , merge_gate = False , seed = 3 ",
        {"method": "cam", "budget": 256, "merge": "mean", "gate": False, "seed": 3},
        {"method": "cam", "cam_budget": 256, "cam_merge": "mean", "cam_merge_gate": False, "seed": 3},
        '{"method": "cam", "budget": 256, "merge": "mean", "merge_gate": false, "seed": 3}',
        want,
    ]
    for form in forms:
        assert parse_config(form) == want, form
    assert parse_config(want.to_string()) == want


def test_defaults_match_the_specification_except_the_measured_scorer_and_merge():
    c = parse_config("cam")
    p = c.policy
    assert (p.budget, p.n_sink, p.merge, p.merge_gate, p.merge_keys, p.merge_min_sim) == (
        512,
        4,
        "mass",
        False,
        True,
        0.85,
    )
    assert p.recent_tokens == 256
    # scorer defaults chosen by measurement (docs/methods/h2o.md); signal=proxy is the specification's
    assert (p.signal, p.obs_window_rows, p.pool_width) == ("observed", 32, 15)
    assert parse_config("cam:signal=proxy").policy.obs_window_rows == 0
    spec = parse_config("cam:merge=sim_weighted,signal=proxy").policy  # the specification's, gate on
    assert (spec.merge, spec.merge_gate, spec.merge_keys) == ("sim_weighted", True, False)
    assert parse_config("cam:merge=mass,gate=true").policy.merge_gate
    # the mass merge's measured defaults (keys blended, min_sim) are its own: other merges keep the specification's
    assert p.merge_prompt is False  # the default merges at decode steps only
    blend = parse_config("cam:merge=mass_blend").policy
    assert (blend.merge_keys, blend.merge_min_sim, blend.merge_prompt) == (False, -1.0, True)
    with pytest.raises(ConfigError, match="prompt=false applies to the mass merges"):
        parse_config("cam:merge=sim_weighted,prompt=false")
    assert (p.merge_cap, blend.merge_cap) == (8.0, None)  # the cap bounds log-weights: mass only
    for spec in (
        "cam:keys=false",
        "cam:min_sim=-1",
        "cam:budget=64,min_sim=0.7,gate=true",
        "cam:cap=none",
        "cam:cap=4",
    ):
        c = parse_config(spec)
        assert parse_config(c.to_string()) == c  # labels give the config back, implied defaults included


def test_unknown_method_lists_installed_and_names_package():
    with pytest.raises(UnknownMethodError) as e:
        parse_config("snapkv:budget=3")
    msg = str(e.value)
    assert "'snapkv'" in msg and "cam" in msg and "h2o" in msg and "pip install kvpolicy-snapkv" in msg


@pytest.mark.parametrize(
    "spec, needles",
    [
        ("cam:merge=avg", ["cam_merge", "'sim_weighted'", "'mean'", "'drop'", "'paper'", "'avg'"]),
        ("cam:budget=-5", ["cam_budget", "greater than or equal to 1", "-5"]),
        ("cam:budget=0", ["cam_budget", "0"]),
        ("h2o:budget=8,n_sink=4,recent=4", ["budget must be greater than n_sink + recent", "budget=8"]),
        ("h2o:n_sink=-1", ["h2o_n_sink", "-1"]),
        ("h2o:recent=-2", ["h2o_recent"]),
        ("h2o:signal=magic", ["h2o_signal", "'proxy'", "'observed'"]),
        ("cam:gate=maybe", ["cam_gate", "valid boolean", "maybe"]),
        ("cam:budget=12.5", ["cam_budget", "12.5"]),
        ("cam:budget=inf", ["cam_budget", "finite", "inf"]),
        ("cam:budget=nan", ["cam_budget", "finite"]),
        ("cam:colour=red", ["colour", "unknown field", "cam_budget"]),
        ("cam:layers=some", ["layers", "'all'", "'unbounded'"]),
        ("cam:head_dim=0", ["head_dim", "0"]),
        ("cam:seed=abc", ["seed", "abc"]),
    ],
)
def test_bad_fields_name_field_value_and_accepted(spec, needles):
    with pytest.raises(ConfigError) as e:
        parse_config(spec)
    for needle in needles:
        assert needle in str(e.value), (needle, str(e.value))


@pytest.mark.parametrize(
    "spec, needle",
    [
        ("", "empty"),
        ("cam:", "nothing after ':'"),
        ("cam:budget", "item 1 'budget' is not key=value"),
        ("cam:budget=4,,merge=mean", "item 2 '' is not key=value"),
        ("cam:budget=4,budget=5", "'budget' is given twice"),
        ("c-am", "is not a method name"),
        ("{not json", "config JSON is malformed"),
        ("[1, 2]", "is not a method name"),
    ],
)
def test_malformed_config_strings_point_at_the_part(spec, needle):
    with pytest.raises(ConfigError) as e:
        parse_config(spec)
    assert needle in str(e.value)


def test_wrong_types_are_clear():
    with pytest.raises(ConfigError, match="expected a KVCacheConfig"):
        parse_config(42)
    with pytest.raises(ConfigError, match="method: a method name is required"):
        parse_config({"budget": 3})
    with pytest.raises(ConfigError, match="cam_budget"):
        KVCacheConfig(method="cam", cam_budget="lots")


def test_configs_are_frozen():
    c = parse_config("h2o")
    with pytest.raises(Exception):
        c.seed = 5


def test_json_round_trip_keeps_method_fields():
    c = parse_config("cam:budget=64,merge=paper,m=8,gate=false,seed=2")
    dumped = c.model_dump_json()
    assert '"merge":"paper"' in dumped and '"merge_window":8' in dumped
    data = c.model_dump()
    assert parse_config({**{k: v for k, v in data.items() if k != "policy"}, **data["policy"]}) == c


@pytest.mark.parametrize(
    "text, want",
    [
        ("cam:budget=32", "cam:budget=32"),  # the gate off is implied by the mass merge: not written
        ("cam:budget=32,gate=true", "cam:budget=32,merge_gate=true"),  # the gate's own default is True
        ("cam:budget=32,merge=sim_weighted", "cam:budget=32,merge=sim_weighted"),
        ("cam:budget=32,merge=sim_weighted,gate=false", "cam:budget=32,merge=sim_weighted,merge_gate=false"),
    ],
)
def test_to_string_writes_exactly_what_gives_the_config_back(text, want):
    """A default that depends on another field (CaM's gate) is written only when it differs from
    what the other fields imply: labels stay short and always parse back to the same config."""
    config = parse_config(text)
    assert config.to_string() == want and parse_config(want) == config
