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
    assert (p.signal, p.when, p.obs_window_rows, p.pool_width) == ("observed", "prompt_end", 32, 31)
    assert parse_config("cam:when=stream").policy.pool_width == 15  # streaming chunks pool as measured before
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
        parse_config("nosuchkv:budget=3")
    msg = str(e.value)
    assert "'nosuchkv'" in msg and "cam" in msg and "h2o" in msg and "pip install kvpolicy-nosuchkv" in msg


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


# ----------------------------------------------------------------------------- refused field values
def test_the_same_field_twice_is_an_error_not_last_wins():
    from kvpolicy_core import ConfigError, parse_config

    for bad in ("cam:budget=8,cam_budget=9", {"method": "cam", "budget": 8, "cam_budget": 9}):
        with pytest.raises(ConfigError, match="given twice"):
            parse_config(bad)


def test_a_bool_is_not_an_integer_field():
    from kvpolicy_core import ConfigError, parse_config

    for bad, field in (
        ({"method": "h2o", "budget": True}, "budget"),
        ({"method": "h2o", "n_sink": False}, "n_sink"),
        ({"method": "h2o", "seed": True}, "seed"),
        ({"method": "cam", "cam_m": True}, "cam_m"),
    ):
        with pytest.raises(ConfigError, match=f"{field}.*bool"):
            parse_config(bad)


def test_seeds_outside_64_bits_are_rejected_naming_the_range():
    from kvpolicy_core import ConfigError, parse_config

    assert parse_config({"method": "h2o", "seed": 2**64 - 1}).seed == 2**64 - 1
    for bad in (2**64, 2**70, -1, "h2o:seed=18446744073709551616"):
        spec = bad if isinstance(bad, str) else {"method": "h2o", "seed": bad}
        with pytest.raises(ConfigError, match=r"seed: .*(18446744073709551615|0)"):
            parse_config(spec)


def test_alias_mixing_names_the_fields_the_user_wrote():
    from kvpolicy_core import ConfigError, parse_config

    with pytest.raises(ConfigError, match=r"^merge_gate: the field 'merge_gate' is given twice \(as 'gate'"):
        parse_config("cam:gate=false,merge_gate=true")
    with pytest.raises(ConfigError, match=r"^gate: .*given twice"):
        parse_config({"method": "cam", "merge_gate": False, "gate": True})
    with pytest.raises(ConfigError, match=r"^cam_gate: Input should be a valid boolean"):
        parse_config("cam:gate=maybe")


def test_a_huge_integer_is_a_range_error_not_inf():
    from kvpolicy_core import ConfigError, parse_config

    with pytest.raises(ConfigError, match=r"budget: .*5000 digits\) is out of range") as e:
        parse_config("h2o:budget=" + "9" * 5000)
    assert "inf" not in str(e.value)
    with pytest.raises(ConfigError, match=r"h2o_budget: must be an integer in \[") as e:
        parse_config({"method": "h2o", "budget": 10**5000})
    assert "inf" not in str(e.value)


def test_a_zero_head_dim_in_the_config_is_refused():
    with pytest.raises(ConfigError, match=r"^head_dim: .*greater than or equal to 1"):
        parse_config("h2o:head_dim=0")


# ----------------------------------------------------------------------------- CaM's similarity threshold
@pytest.mark.parametrize("value", ["2", "1.5", "-1.01", "-3"])
def test_min_sim_outside_the_cosine_range_is_refused(value):
    with pytest.raises(ConfigError, match=r"^cam_min_sim: .*\[-1, 1\].*merge=drop") as e:
        parse_config(f"cam:min_sim={value}")
    assert value in str(e.value)


@pytest.mark.parametrize("value", [-1.0, 0.0, 0.85, 1.0])
def test_min_sim_inside_the_cosine_range_is_accepted(value):
    assert parse_config({"method": "cam", "merge_min_sim": value}).policy.merge_min_sim == value


# ----------------------------------------------------------------------------- numbers in config strings
@pytest.mark.parametrize(
    "text, field",
    [
        ("h2o:budget=１６", "budget"),
        ("cam:min_sim=０.５", "min_sim"),
        ("h2o:budget=16,n_sink=٣", "n_sink"),
        ("h2o:head_dim=１２８", "head_dim"),
        ({"method": "h2o", "budget": "１６"}, "budget"),
    ],
)
def test_config_strings_accept_only_ascii_digits(text, field):
    with pytest.raises(ConfigError, match=rf"^({field}, i\.e\. )?(\w+_)?{field}: .*ASCII digits 0-9"):
        parse_config(text)


def test_ascii_numbers_in_config_strings_still_parse():
    config = parse_config("cam:budget=+16,n_sink=2,min_sim=-0.5,cap=1e1,head_dim=16")
    assert (config.policy.budget, config.policy.merge_min_sim, config.policy.merge_cap, config.head_dim) == (
        16,
        -0.5,
        10.0,
        16,
    )


# ----------------------------------------------------------------------------- bounds of the numeric fields
@pytest.mark.parametrize(
    "spec, field, bound",
    [
        ("h2o:score=keydiff,pool=100001", "h2o_pool", "255"),  # segfaulted at the first compiled decode step
        ("cam:score=expected_attention,pool=10001", "cam_pool", "255"),  # ~13 s a decode step
        ("h2o:pool=257", "h2o_pool", "255"),
        ("cam:score=expected_attention,n_future=1000000000", "cam_n_future", "65536"),  # segfaulted
        ("h2o:obs_window=9223372036854775807", "h2o_obs_window", "2147483647"),
        ("h2o:score=keydiff,rescore_every=3000000000", "h2o_rescore_every", "2147483647"),
        ("cam:merge=paper,m=9223372036854775807", "cam_m", "2147483647"),
        ("h2o:budget=4294967296,n_sink=4294967000", "h2o_budget", "2147483647"),
        ("cam:budget=4611686018427387904", "cam_budget", "2147483647"),
        ("h2o:head_dim=100000", "head_dim", "65536"),
    ],
)
def test_numeric_fields_beyond_what_the_machine_can_do_are_refused_naming_the_field(spec, field, bound):
    with pytest.raises(ConfigError, match=rf"^(\w+, i\.e\. )?{field}: .*{bound}"):
        parse_config(spec)


def test_the_bounds_themselves_are_accepted():
    from kvpolicy_core.config.attention_config import MAX_TOKENS, N_FUTURE_MAX, POOL_MAX

    assert parse_config(f"h2o:score=keydiff,pool={POOL_MAX}").policy.pool_width == POOL_MAX
    assert parse_config(f"cam:score=expected_attention,n_future={N_FUTURE_MAX}").policy.future_positions == 65536
    assert parse_config(f"h2o:budget={MAX_TOKENS},obs_window={MAX_TOKENS}").policy.budget == MAX_TOKENS
    assert parse_config(f"cam:merge=paper,m={MAX_TOKENS}").policy.merge_window == MAX_TOKENS


def test_rope_frequencies_must_be_finite():
    with pytest.raises(ConfigError, match=r"rope_freqs: .*finite"):
        parse_config({"method": "h2o", "score": "expected_attention", "rope_freqs": [1.0, float("nan")]})
