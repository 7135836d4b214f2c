"""Hook registration and entry-point discovery, including broken and conflicting plugins."""

import subprocess
import sys
import textwrap
import warnings

import pytest

from kvpolicy_core import MethodSpec, PluginError, PolicyCache, PolicyConfig, get_registry, hookimpl, reset_registry
from kvpolicy_core.plugin.discovery import register_plugin, unregister_plugin


def make_dist(root, name, modules, entry_points):
    """Write an installed distribution (dist-info + modules) under ``root``."""
    info = root / f"{name}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    lines = "\n".join(f"{ep} = {target}" for ep, target in entry_points.items())
    (info / "entry_points.txt").write_text(f"[kvpolicy]\n{lines}\n")
    for mod, source in modules.items():
        (root / f"{mod}.py").write_text(textwrap.dedent(source))


GOOD = """
    from kvpolicy_core import MethodSpec, PolicyConfig, hookimpl

    class OldestConfig(PolicyConfig):
        pass

    @hookimpl
    def register_methods(register):
        register(MethodSpec("oldest", OldestConfig, "cumulative_attention", "lowest_score", "drop"))
"""


@pytest.fixture
def site(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("KVPOLICY_STRICT_PLUGINS", raising=False)
    monkeypatch.delenv("KVPOLICY_BLOCK_PLUGINS", raising=False)
    reset_registry()
    yield tmp_path
    reset_registry()


def test_shipped_plugins_are_discovered_with_their_distributions():
    reg = get_registry()
    methods = reg.methods()
    assert methods["h2o"].dist == "kvpolicy-h2o" and methods["cam"].dist == "kvpolicy-cam"
    assert methods["h2o"].version
    assert set(reg.parts["dispositions"]) >= {"drop", "gated_merge", "paper_merge"}
    assert reg.parts["scorers"]["cumulative_attention"].plugin == "kvpolicy_core"


def test_entry_point_from_an_installed_distribution(site):
    make_dist(site, "kvpolicy_oldest", {"kvp_oldest": GOOD}, {"oldest": "kvp_oldest"})
    reset_registry()
    spec = get_registry().methods()["oldest"]
    assert spec.plugin == "oldest" and spec.dist == "kvpolicy_oldest" and spec.version == "0.1"
    from kvpolicy_core import parse_config

    assert parse_config("oldest:budget=9").policy.budget == 9


def test_broken_plugin_is_reported_and_skipped(site):
    make_dist(
        site, "kvpolicy_broken", {"kvp_broken": "raise ImportError('no numpy for you')"}, {"broken": "kvp_broken"}
    )
    make_dist(site, "kvpolicy_oldest", {"kvp_oldest": GOOD}, {"oldest": "kvp_oldest"})
    reset_registry()
    with pytest.warns(RuntimeWarning, match=r"skipping plugin 'broken' \(kvp_broken, from kvpolicy_broken\).*no numpy"):
        reg = get_registry()
    assert "oldest" in reg.methods() and "cam" in reg.methods()
    assert any("broken" in f for f in reg.failures)


def test_strict_mode_makes_a_broken_plugin_an_error(site, monkeypatch):
    make_dist(site, "kvpolicy_broken", {"kvp_broken2": "1/0"}, {"broken2": "kvp_broken2"})
    monkeypatch.setenv("KVPOLICY_STRICT_PLUGINS", "1")
    reset_registry()
    with pytest.raises(PluginError, match="broken2.*ZeroDivisionError"):
        get_registry()


def test_blocked_plugins_are_not_loaded(site, monkeypatch):
    make_dist(site, "kvpolicy_broken", {"kvp_broken3": "raise SystemError('boom')"}, {"broken3": "kvp_broken3"})
    monkeypatch.setenv("KVPOLICY_BLOCK_PLUGINS", "broken3, cam")
    reset_registry()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        reg = get_registry()
    assert "cam" not in reg.methods() and "h2o" in reg.methods()


def test_duplicate_method_names_both_plugins(site):
    make_dist(site, "kvpolicy_fakecam", {"kvp_fakecam": GOOD.replace('"oldest"', '"cam"')}, {"fakecam": "kvp_fakecam"})
    reset_registry()
    with pytest.warns(RuntimeWarning, match="registered twice: plugin 'fakecam'") as w:
        reg = get_registry()
    assert "'cam'" in str(w[0].message)
    assert reg.methods()["cam"].plugin == "cam"  # the shipped plugin keeps its name
    assert reg.method("cam").config_class.__name__ == "CamConfig"
    assert "h2o" in reg.methods()  # the others carry on


def test_invalid_config_class_and_raising_hook_are_reported(site):
    class NotAConfig:
        pass

    class Plugin:
        from kvpolicy_core import hookimpl

        @hookimpl
        def register_methods(self, register):
            from kvpolicy_core import MethodSpec

            register(MethodSpec("weird", NotAConfig, "cumulative_attention", "lowest_score", "drop"))

    class Raiser:
        from kvpolicy_core import hookimpl

        @hookimpl
        def register_scorers(self, register):
            register("half", object)
            raise RuntimeError("oops in register")

    register_plugin(Plugin(), "weird")
    register_plugin(Raiser(), "raiser")
    try:
        with pytest.warns(RuntimeWarning) as record:
            reg = get_registry()
        text = " ".join(str(w.message) for w in record)
        assert "'weird'" in text and "not a subclass of kvpolicy_core.PolicyConfig" in text
        assert "'raiser'" in text and "oops in register" in text
        assert "weird" not in reg.methods() and "half" not in reg.parts["scorers"]  # rolled back
    finally:
        unregister_plugin("weird")
        unregister_plugin("raiser")


def test_registry_is_lazy_and_pluggy_is_not_on_the_decode_path(llama_model, monkeypatch):
    import kvpolicy_core.plugin.discovery as plugins
    from kvpolicy_core import KVCacheBuilder

    caches = KVCacheBuilder.for_model(llama_model, "cam:budget=8")
    monkeypatch.setattr(plugins, "get_registry", lambda: (_ for _ in ()).throw(AssertionError("registry used")))
    import mlx.core as mx

    llama_model(mx.zeros((1, 20), dtype=mx.int32), cache=caches)
    for _ in range(3):
        llama_model(mx.zeros((1, 1), dtype=mx.int32), cache=caches)


# ----------------------------------------------------------------------------- identity by distribution
def method_plugin(*methods):
    """A plugin module registering the ``methods`` (scored, selected and disposed by core's parts)."""
    line = '\n        register(MethodSpec("{}", OldestConfig, "cumulative_attention", "lowest_score", "drop"))'
    calls = "".join(line.format(m) for m in methods)
    return GOOD.split("    @hookimpl")[0] + "    @hookimpl\n    def register_methods(register):" + calls + "\n"


def test_a_third_party_entry_point_named_like_a_shipped_one_does_not_hide_it(site):
    make_dist(site, "other_pkg", {"other_oldest": GOOD}, {"h2o": "other_oldest"})
    reset_registry()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        reg = get_registry()
    methods = reg.methods()
    assert methods["h2o"].dist == "kvpolicy-h2o" and methods["oldest"].dist == "other_pkg"
    from kvpolicy_core import parse_config

    assert parse_config("h2o:budget=9").policy.budget == 9


@pytest.mark.parametrize("strict", [False, True])
def test_a_third_party_method_with_a_shipped_name_is_reported_and_the_shipped_one_kept(site, monkeypatch, strict):
    make_dist(site, "other_pkg", {"other_clash": method_plugin("h2o", "other")}, {"h2o": "other_clash"})
    if strict:  # the clashing name is refused; every other name of both plugins stays usable
        monkeypatch.setenv("KVPOLICY_STRICT_PLUGINS", "1")
        reset_registry()
        with pytest.warns(RuntimeWarning, match="registered twice"):
            reg = get_registry()
        with pytest.raises(PluginError, match=r"'h2o' is registered twice.*other_pkg.*kvpolicy-h2o.*STRICT"):
            reg.method("h2o")
        assert reg.methods()["other"].dist == "other_pkg" and reg.method("cam").name == "cam"
        return
    reset_registry()
    with pytest.warns(RuntimeWarning, match=r"'h2o' is registered twice.*other_pkg.*kvpolicy-h2o") as w:
        reg = get_registry()
    assert len(w) == 1 and "shipped" in str(w[0].message)
    assert reg.methods()["h2o"].dist == "kvpolicy-h2o"
    assert reg.method("h2o").config_class.__name__ == "H2OConfig"
    assert reg.methods()["other"].dist == "other_pkg"  # only the clashing registration is skipped
    (conflict,) = reg.conflicts
    assert (conflict.kind, conflict.name, conflict.kept, conflict.skipped) == (
        "methods",
        "h2o",
        "kvpolicy-h2o:h2o",
        "other_pkg:h2o",
    )
    assert conflict.message in " ".join(reg.failures)  # `kvpolicy methods` shows the failures


def test_a_third_party_entry_point_loading_a_shipped_module_does_not_take_its_methods(site):
    make_dist(site, "other_pkg", {}, {"mine": "kvpolicy_h2o.plugin"})
    reset_registry()
    with pytest.warns(
        RuntimeWarning, match=r"'mine' \(kvpolicy_h2o.plugin, from other_pkg\).*'kvpolicy-h2o:h2o' already"
    ):
        reg = get_registry()
    assert reg.methods()["h2o"].dist == "kvpolicy-h2o" and reg.methods()["h2o"].plugin == "h2o"


@pytest.mark.parametrize("alpha_first", [True, False])
def test_a_clash_between_two_third_party_plugins_is_won_by_the_first_distribution_name(
    site, tmp_path_factory, monkeypatch, alpha_first
):
    """The winner does not depend on sys.path order: distributions load in name order (shipped ones first)."""
    other = tmp_path_factory.mktemp("other_site")
    first, second = (site, other) if alpha_first else (other, site)
    make_dist(first, "kvp_alpha", {"kvp_alpha_mod": method_plugin("oldest")}, {"oldest": "kvp_alpha_mod"})
    make_dist(second, "kvp_beta", {"kvp_beta_mod": method_plugin("oldest")}, {"oldest": "kvp_beta_mod"})
    monkeypatch.syspath_prepend(str(other))
    reset_registry()
    with pytest.warns(RuntimeWarning, match="'oldest' is registered twice: plugin 'oldest' .from kvp_beta.") as w:
        reg = get_registry()
    assert "kvp_alpha" in str(w[0].message) and "keeps it" in str(w[0].message)
    assert reg.methods()["oldest"].dist == "kvp_alpha"
    assert [(c.kept, c.skipped) for c in reg.conflicts] == [("kvp_alpha:oldest", "kvp_beta:oldest")]


@pytest.mark.parametrize(
    "block, left",
    [
        ("other-pkg", {"h2o": "kvpolicy-h2o"}),
        ("Other_Pkg:h2o", {"h2o": "kvpolicy-h2o"}),
        ("kvpolicy-h2o", {"h2o": "other_pkg"}),
        ("kvpolicy-h2o:h2o, other_pkg", {}),
        ("h2o", {}),
    ],
)  # a bare entry-point name: every entry point so named
def test_blocking_names_a_distribution_or_one_of_its_entry_points(site, monkeypatch, block, left):
    make_dist(site, "other_pkg", {"other_h2o": method_plugin("h2o")}, {"h2o": "other_h2o"})
    monkeypatch.setenv("KVPOLICY_BLOCK_PLUGINS", block)
    reset_registry()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        reg = get_registry()
    methods = reg.methods()
    assert {m: methods[m].dist for m in methods if m == "h2o"} == left
    assert "cam" in methods and "random" in methods


def test_a_blocked_shipped_method_says_it_is_installed_and_blocked(site, monkeypatch):
    from kvpolicy_core import UnknownMethodError, parse_config

    monkeypatch.setenv("KVPOLICY_BLOCK_PLUGINS", "kvpolicy-h2o")
    reset_registry()
    with pytest.raises(UnknownMethodError, match=r"kvpolicy-h2o is installed.*BLOCK_PLUGINS.*kvpolicy-h2o:h2o") as e:
        parse_config("h2o")
    assert "pip install" not in str(e.value)


def test_a_plugin_that_exits_at_import_is_reported_and_skipped(site):
    make_dist(site, "kvp_exits", {"kvp_exits_mod": "import sys\nsys.exit(3)\n"}, {"exits": "kvp_exits_mod"})
    make_dist(site, "kvpolicy_oldest", {"kvp_oldest": GOOD}, {"oldest": "kvp_oldest"})
    reset_registry()
    with pytest.warns(RuntimeWarning, match=r"skipping plugin 'exits' .*SystemExit: 3"):
        reg = get_registry()
    assert "oldest" in reg.methods() and "h2o" in reg.methods()
    assert any("SystemExit" in f for f in reg.failures)


def test_a_plugin_that_exits_in_a_hook_is_reported_and_rolled_back(site):
    class Exiter:
        from kvpolicy_core import hookimpl

        @hookimpl
        def register_scorers(self, register):
            register("half", object)
            raise SystemExit(4)

    register_plugin(Exiter(), "exiter")
    try:
        with pytest.warns(RuntimeWarning, match=r"'exiter' failed in register_scorers: SystemExit: 4"):
            reg = get_registry()
        assert "half" not in reg.parts["scorers"] and "h2o" in reg.methods()
    finally:
        unregister_plugin("exiter")


def test_ctrl_c_while_a_plugin_imports_is_not_swallowed(site):
    make_dist(
        site,
        "kvp_interrupted",
        {"kvp_interrupted_mod": "raise KeyboardInterrupt\n"},
        {"interrupted": "kvp_interrupted_mod"},
    )
    reset_registry()
    with pytest.raises(KeyboardInterrupt):
        get_registry()


# ----------------------------------------------------------------------------- a plugin taking a shipped name
class Intruder:
    @hookimpl
    def register_methods(self, register):
        register(MethodSpec("mine", PolicyConfig, "cumulative_attention", "lowest_score", "drop"))
        register(MethodSpec(Intruder.name, PolicyConfig, "cumulative_attention", "lowest_score", "drop"))


@pytest.mark.parametrize("taken, owner", [("h2o", "h2o"), ("random", "kvpolicy_core")])
def test_a_plugin_taking_a_shipped_name_is_the_one_reported_and_skipped(taken, owner):
    import importlib

    from kvpolicy_core import default_plugin as builtin
    from kvpolicy_core.plugin.discovery import PluginManager
    from kvpolicy_core.plugin.registry import Registry, fill

    Intruder.name = taken
    pm = PluginManager()  # the intruder's entry point is loaded before the shipped h2o plugin
    pm.register_from(builtin, "kvpolicy_core", "kvpolicy-core")
    pm.register_from(Intruder(), "intruder", "kvpolicy-intruder")
    pm.register_from(importlib.import_module("kvpolicy_h2o.plugin"), "h2o", "kvpolicy-h2o")
    registry = Registry()
    with pytest.warns(RuntimeWarning, match=f"'{taken}' is registered twice: plugin 'intruder'") as w:
        fill(registry, pm, strict=False)
    assert "'intruder'" in str(w[0].message) and f"plugin {owner!r}" in str(w[0].message)
    methods = registry.methods()
    assert methods[taken].plugin == owner and methods["h2o"].plugin == "h2o"  # the rightful owners
    assert methods["mine"].plugin == "intruder"  # only the intruder's clashing registration is skipped
    assert registry.method(taken) is methods[taken].obj


def test_kvpolicy_methods_lists_the_rightful_owner(capsys):
    from kvpolicy_core.apps.cli import main

    Intruder.name = "h2o"
    register_plugin(Intruder(), "intruder")
    try:
        with pytest.warns(RuntimeWarning, match="plugin 'intruder' tried to take the name"):
            main(["methods"])
        out = capsys.readouterr().out
        line = next(x for x in out.splitlines() if x.split() and x.split()[0] == "h2o")
        assert "intruder" not in line and "kvpolicy-h2o" in out
        from kvpolicy_core.plugin.discovery import get_registry

        assert get_registry().methods()["h2o"].plugin == "h2o"
        assert PolicyCache("h2o:budget=8").budget == 8
    finally:
        unregister_plugin("intruder")


def test_strict_mode_does_not_say_skipping_while_it_raises(tmp_path, monkeypatch):
    code = (
        "import sys; sys.path.insert(0, %r)\nfrom kvpolicy_core.plugin.discovery import get_registry\nget_registry()\n"
    ) % str(tmp_path)
    dist = tmp_path / "kvp_broken-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: kvp-broken\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[kvpolicy]\nbroken = kvp_broken_mod\n")
    (tmp_path / "kvp_broken_mod.py").write_text("raise ImportError('boom')\n")
    env = {"KVPOLICY_STRICT_PLUGINS": "1", "PYTHONPATH": str(tmp_path)}
    import os

    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, **env})
    assert r.returncode != 0 and "PluginError" in r.stderr and "boom" in r.stderr
    assert "skipping" not in r.stderr
