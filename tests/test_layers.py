"""kvpolicy-core's layers: which subpackage may import which (imports inside functions count too).

From the bottom: ``errors``; ``runtime`` (the machine); ``models`` (the config models, :data:`MODELS`: they know
no registry); ``parts`` (the part interfaces and core's parts) and ``attention`` (attention arithmetic); ``plugin``
(hooks, discovery, registry); ``config`` (resolving a config once, composing a policy); ``cache`` (the per-layer
engine); ``integration`` (hook, builder, persistence); ``eval``, ``model`` and ``testing``; ``apps`` (CLI, server)
on top.
"""

import pytest
from test_import_graph import graph

PKG = "kvpolicy_core"

#: layer -> the layers (and itself) its modules may import
ALLOWED = {
    "errors": {"errors"},
    "runtime": {"runtime", "errors"},
    "models": {"models", "errors"},
    "parts": {"parts", "errors"},
    "attention": {"attention", "parts", "errors"},
    "plugin": {"plugin", "models", "parts", "errors"},
    "config": {"config", "models", "plugin", "parts", "errors"},
    "default_plugin": {"default_plugin", "plugin", "models", "parts", "errors"},
    "cache": {"cache", "attention", "parts", "plugin", "config", "runtime", "errors"},
    "integration": {"integration", "cache", "attention", "parts", "plugin", "config", "runtime", "errors"},
    "model": {"model", "errors"},
    "eval": {"eval", "integration", "cache", "attention", "parts", "plugin", "config", "runtime", "model", "errors"},
    "testing": {
        "testing",
        "integration",
        "cache",
        "attention",
        "parts",
        "plugin",
        "config",
        "runtime",
        "model",
        "errors",
    },
    "apps": {
        "apps",
        "eval",
        "integration",
        "cache",
        "attention",
        "parts",
        "plugin",
        "config",
        "runtime",
        "model",
        "errors",
    },
}
for _above in (a for a in ALLOWED.values() if "plugin" in a):  # every layer above the plugin host: the models too
    _above.add("models")
#: modules of the package root that are plumbing, not a layer (lazy exports)
ROOT_PLUMBING = {"_lazy"}
#: the config models, one module each, in ``config/`` but a layer of their own below the plugin host (the registry
#: checks a method's config class against ``PolicyConfig``; resolving a config string needs the registry)
MODELS = {f"{PKG}.config.{m}" for m in ("policy_config", "attention_config", "cache_config")}
#: the one edge up from the models, inside a function: the specification's flat ``KVCacheConfig(method="cam",
#: cam_budget=...)`` (README's quick start) is a config dict, resolved by ``config.resolve`` as ``parse_config``
#: resolves one; a typed ``KVCacheConfig(method=..., policy=...)`` never takes it
EXCEPTIONS = {(f"{PKG}.config.cache_config", f"{PKG}.config.resolve")}


def layer_of(module: str) -> str:
    if module in MODELS:
        return "models"
    rest = module[len(PKG) + 1 :] if module != PKG else ""
    return rest.split(".")[0] if rest else ""


def violations(g):
    out = []
    for module, targets in g.items():
        src = layer_of(module)
        if src in ("", *ROOT_PLUMBING):
            continue
        for t in targets:
            dst = layer_of(t)
            if dst in ("", *ROOT_PLUMBING):
                continue
            if dst not in ALLOWED[src] and (module, t) not in EXCEPTIONS:
                out.append(f"{module} -> {t} ({src} may not import {dst})")
    return sorted(out)


def test_every_module_belongs_to_a_layer():
    unknown = {layer_of(m) for m in graph()} - set(ALLOWED) - {"", *ROOT_PLUMBING}
    assert not unknown, f"modules outside any layer: {sorted(unknown)}"


def test_no_import_goes_up_a_layer():
    assert violations(graph()) == []


@pytest.mark.parametrize(
    "edge",
    [
        ("cache", "integration"),
        ("parts", "cache"),
        ("cache", "apps"),
        ("attention", "cache"),
        ("runtime", "cache"),
        ("integration", "apps"),
        ("models", "plugin"),
        ("models", "config"),
    ],
)
def test_the_rules_forbid_the_upward_edges(edge):
    src, dst = edge
    name = lambda layer, m: next(iter(sorted(MODELS))) if layer == "models" else f"{PKG}.{layer}.{m}"  # noqa: E731
    g = {name(src, "a"): [name(dst, "b")], name(dst, "b"): []}
    assert violations(g), f"{src} -> {dst} should be refused"


def test_the_blas_loader_imports_no_mlx_when_imported():
    import ast
    from pathlib import Path

    import kvpolicy_core

    for name in ("blas.py", "blas_check.py"):
        tree = ast.parse((Path(kvpolicy_core.__file__).parent / "runtime" / name).read_text())
        top = tree.body  # module level only: measuring MLX's speed imports it on purpose, inside a function
        imported = {a.name for n in top if isinstance(n, ast.Import) for a in n.names}
        imported |= {n.module or "" for n in top if isinstance(n, ast.ImportFrom)}
        assert not any(m == "mlx" or m.startswith("mlx.") or m.startswith("mlx_lm") for m in imported), name


def test_at_most_twelve_modules_at_the_top_of_the_package():
    from pathlib import Path

    import kvpolicy_core

    top = [p.name for p in Path(kvpolicy_core.__file__).parent.glob("*.py")]
    assert len(top) <= 12, sorted(top)
