"""The config-string grammar writes list values (``key=[a,b]``), and a config with a list or tuple field round-trips
config -> string -> config (what ``generate --json`` writes as the method)."""

import pytest

from kvpolicy_core import ConfigError
from kvpolicy_core.config.parse import parse_config, parse_config_string


def test_a_list_value_parses_with_its_commas_inside_the_brackets():
    got = parse_config_string("m:a=[1,2.5,none,x],b=[],c=3")
    assert got == {"method": "m", "a": [1, 2.5, None, "x"], "b": [], "c": 3}


@pytest.mark.parametrize(
    "spec",
    [
        "h2o:budget=16,score=expected_attention,rope_freqs=[1.0,0.5,0.1]",
        "h2o:budget=16,score=expected_attention,rope_freqs=[0.3333333333333333,1e-05,2.0],rope_traditional=true",
        "h2o:budget=16,score=expected_attention,rope_freqs=[]",
    ],
)
def test_a_tuple_field_round_trips_through_its_string(spec):
    config = parse_config(spec)
    text = config.to_string()
    assert "rope_freqs=[" in text and "(" not in text
    assert parse_config(text) == config


@pytest.mark.parametrize(
    "spec, needle",
    [
        ("m:a=[1,[2]]", "is not a list of values"),
        ("m:a=[1,2", "a '\\[' list is not closed"),
        ("m:a=1]", "a ']' closes no list"),
        ("m:a=[1,,2]", "has an empty list element"),
    ],
)
def test_a_malformed_list_is_a_clear_error(spec, needle):
    with pytest.raises(ConfigError, match=needle):
        parse_config_string(spec)
