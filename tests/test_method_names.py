"""A method name that is not installed: another case or a typo gets "did you mean" the installed method (never a
``pip install`` of a plugin that does not exist, nor "installed but did not register"); an error in a method field
names it as the user wrote it."""

import pytest

from kvpolicy_core.config.parse import parse_config
from kvpolicy_core.errors import ConfigError, UnknownMethodError


@pytest.mark.parametrize("name", ["H2O", "h20", "Cam", "snapvk"])
def test_a_near_miss_method_name_gets_did_you_mean(name):
    with pytest.raises(UnknownMethodError) as info:
        parse_config(f"{name}:budget=8")
    message = str(info.value)
    want = {"H2O": "h2o", "h20": "h2o", "Cam": "cam", "snapvk": "snapkv"}[name]
    assert f"did you mean {want!r}" in message, message
    assert "pip install" not in message and "did not register" not in message


def test_a_name_close_to_nothing_keeps_the_install_hint():
    with pytest.raises(UnknownMethodError, match="pip install kvpolicy-quuxfrob"):
        parse_config("quuxfrob:budget=8")


@pytest.mark.parametrize("written", ["budget", "cam_budget"])
def test_a_field_error_names_the_field_as_written(written):
    with pytest.raises(ConfigError) as info:
        parse_config({"method": "cam", written: 0})
    want = "budget, i.e. cam_budget:" if written == "budget" else "cam_budget:"
    assert str(info.value).startswith(want), info.value
    with pytest.raises(ConfigError, match=r"^budget, i.e. cam_budget:"):
        parse_config("cam:budget=0")
