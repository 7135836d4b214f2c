"""docs/plugins/minimal.md runs as written (its plugin, its pyproject, its run and its conformance kit), its
contract tables list the whole part API, and the tutorial's plugin passes the conformance kit."""

from __future__ import annotations

import re
import sys
import types
from dataclasses import fields
from pathlib import Path

import pytest
import tomllib

from kvpolicy_core import MergeUpdate, Needs
from kvpolicy_core.parts.base import CacheView
from kvpolicy_core.plugin import hookspecs
from kvpolicy_core.plugin.discovery import register_plugin, unregister_plugin
from kvpolicy_core.testing.conformance import run_conformance

DOCS = Path(__file__).resolve().parents[1] / "docs"
MINIMAL = DOCS / "plugins" / "minimal.md"


def blocks(lang: str):
    return re.findall(rf"^```{lang}\n(.*?)^```", MINIMAL.read_text(), flags=re.M | re.S)


@pytest.fixture
def minimal_plugin():
    """The page's plugin module, imported under the name its header and its entry point give it."""
    code = next(b for b in blocks("python") if "@hookimpl" in b)
    path = re.match(r"# src/(\S+)\.py", code)[1]
    name = path.replace("/", ".")
    module = types.ModuleType(name)
    exec(compile(code, str(MINIMAL), "exec"), module.__dict__)
    sys.modules[name] = module
    register_plugin(module, "minimal-doc")
    yield name
    unregister_plugin("minimal-doc")
    sys.modules.pop(name, None)


def test_the_minimal_plugin_runs_as_written_and_passes_the_conformance_kit(minimal_plugin, tiny_model_dir):
    plugin, run, kit = blocks("python")
    assert "@hookimpl" in plugin and len(plugin.strip().splitlines()) <= 26  # a scorer in about 20 lines
    project = tomllib.loads(blocks("toml")[0])
    assert project["project"]["entry-points"]["kvpolicy"] == {"keynorm": minimal_plugin}
    import mlx_lm

    from kvpolicy_core import detach

    model_name = re.search(r'mlx_lm\.load\("([^"]+)"\)', run)[1]
    scope: dict = {}
    exec(compile(run.replace(model_name, str(tiny_model_dir)), str(MINIMAL), "exec"), scope)
    try:
        caches = scope["model"].make_cache()
        assert {type(c.policy.scorer).__name__ for c in caches} == {"KeyNormScorer"}
        assert all(c.budget == 64 for c in caches)
        assert isinstance(mlx_lm.generate(scope["model"], scope["tokenizer"], "a b c", max_tokens=4), str)
    finally:
        detach(scope["model"])
    exec(compile(kit, str(MINIMAL), "exec"), {})
    assert run_conformance("keynorm:budget=16,n_sink=2")


def test_the_contract_tables_name_every_hook_part_field_and_need():
    text = MINIMAL.read_text()
    hooks = [n for n, fn in vars(hookspecs).items() if callable(fn) and hasattr(fn, "kvpolicy_spec")]
    names = set(re.findall(r"`(\w+)", text))
    assert len(hooks) == 5 and set(hooks) <= names
    assert {
        "Scorer",
        "Selector",
        "Disposition",
        "Allocation",
        "AttentionScorer",
        "on_append",
        "on_attention",
        "rank",
        "evict_count",
        "dispose",
        "budgets",
        "when",
        "allocation",
    } <= names
    assert set(CacheView._fields) <= names
    assert set(MergeUpdate._fields) <= names
    assert {f.name for f in fields(Needs)} <= names


def test_the_merge_update_fields_are_documented_in_their_real_order():
    """A 0.1 positional call read its counters as later fields: the documented order is the constructor's."""
    text = MINIMAL.read_text()
    assert f"MergeUpdate({', '.join(MergeUpdate._fields)})" in text
    table = text.split("**`MergeUpdate(")[1].split("\n\n")[1]  # its field table, in order
    documented = [f.strip(" `") for line in table.splitlines()[2:] for f in line.split("|")[1].split(",")]
    assert documented == list(MergeUpdate._fields)


def test_the_contract_stays_short():
    """minimal.md + hooks.md, the whole part contract: at most 250 lines, and hooks.md opens
    with the list of concepts an author meets (at most 12)."""
    hooks_md = (DOCS / "plugins" / "hooks.md").read_text()
    assert len(MINIMAL.read_text().splitlines()) + len(hooks_md.splitlines()) <= 250
    box = hooks_md.split("\n\n")[1]
    assert box.startswith("> **What a plugin author meets: 12 concepts.**") and "(12)" in box and "(13)" not in box


def test_the_minimal_page_is_linked_from_the_index_and_the_tutorial():
    assert "plugins/minimal.md" in (DOCS / "index.md").read_text()
    assert "minimal.md" in (DOCS / "plugins" / "tutorial.md").read_text()


@pytest.mark.parametrize("method", ["streamingllm", "streamingmerge", "tova", "tova:signal=proxy,recent=1"])
def test_the_tutorials_plugin_passes_the_conformance_kit(method):
    """The tutorial walks through examples/kvpolicy-streaming: each of its methods passes the kit."""
    tutorial = (DOCS / "plugins" / "tutorial.md").read_text()
    assert method.split(":")[0] in tutorial
    fields_ = "budget=16,n_sink=2"
    assert run_conformance(f"{method},{fields_}" if ":" in method else f"{method}:{fields_}")


# ------------------------------------------------------------------ the contract is as small as it says, and exported
HOOKS = DOCS / "plugins" / "hooks.md"
#: names the contract pages use that belong to other libraries (mlx-lm's cache, typing) or stand for the author's
#: own class (``ScorerClass``, ``PartClass``: any name ending in "Class")
FOREIGN = {"KVCache", "Literal", "None", "True", "False"}


def _concepts():
    """(stated number, [item text]) from hooks.md's opening box: "What a plugin author meets: N concepts. (1) ..."."""
    box = " ".join(line.lstrip("> ") for line in HOOKS.read_text().split("\n\n")[1].splitlines())
    stated = int(re.search(r"What a plugin author meets: (\d+) concepts", box)[1])
    listed = re.split(r"\((\d+)\) ", box.split("Everything else")[0])
    numbers, items = [int(n) for n in listed[1::2]], listed[2::2]
    assert numbers == list(range(1, len(items) + 1)), f"hooks.md's concepts are numbered {numbers}"
    return stated, items


def _prose(path: Path) -> str:
    return re.sub(r"^```.*?^```", "", path.read_text(), flags=re.M | re.S)


def test_the_concept_count_in_hooks_md_is_the_length_of_its_list():
    stated, items = _concepts()
    assert stated == len(items), f"hooks.md says {stated} concepts and lists {len(items)}"


def test_every_concept_is_exported_from_the_package_root():
    """Each name a concept gives is a root export of kvpolicy_core, a field or method of one given in the same
    item (`rank` of `Selector`, `budget` of `PolicyConfig`), or (`register_*`) a pattern of the hook specs."""
    import kvpolicy_core

    hooks = [n for n, fn in vars(hookspecs).items() if callable(fn) and hasattr(fn, "kvpolicy_spec")]
    for item in _concepts()[1]:
        names = re.findall(r"`([\w*]+)`", item)
        assert names, f"the concept {item!r} names nothing"
        owners = [getattr(kvpolicy_core, n) for n in names if n in kvpolicy_core.__all__]
        for name in names:
            if "*" in name:
                assert any(re.fullmatch(name.replace("*", r"\w+"), h) for h in hooks), name
            elif name not in kvpolicy_core.__all__:
                assert any(name in getattr(o, "model_fields", {}) or hasattr(o, name) for o in owners), (
                    f"hooks.md's concept {item.strip()!r} names `{name}`, which kvpolicy_core does not export"
                )


@pytest.mark.parametrize("page", ["hooks.md", "minimal.md"])
def test_every_class_the_contract_pages_name_is_exported(page):
    """The two contract pages name the classes an author subclasses, builds or catches: each is a root export
    of kvpolicy_core (nothing an author needs sits in an internal module, and no internal class is named)."""
    import kvpolicy_core

    text = _prose(DOCS / "plugins" / page)
    spans = re.findall(r"`([^`]+)`", text)
    named = {n for span in spans for n in re.findall(r"(?<![\w.])([A-Z][a-z]\w*)\b", span)}
    classes = {n for n in named if n not in FOREIGN and not n.endswith("Class") and len(n) > 3}
    missing = sorted(n for n in classes if n not in kvpolicy_core.__all__)
    assert not missing, f"docs/plugins/{page} names {missing}, not exported from kvpolicy_core"


@pytest.mark.parametrize("page", sorted(p.name for p in (DOCS / "plugins").glob("*.md")))
def test_every_dotted_kvpolicy_path_on_the_plugin_pages_resolves(page):
    """`kvpolicy_core.x.y` on a plugin page (a helper, a module) imports as written."""
    import importlib

    bad = []
    for path in sorted(set(re.findall(r"\bkvpolicy_core(?:\.\w+)+", (DOCS / "plugins" / page).read_text()))):
        parts = path.split(".")
        for cut in range(len(parts), 0, -1):
            try:
                obj = importlib.import_module(".".join(parts[:cut]))
                break
            except ImportError:
                continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr, None)
        if obj is None:
            bad.append(path)
    assert not bad, f"docs/plugins/{page} names paths that do not resolve: {bad}"
