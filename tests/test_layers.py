"""kvpolicy-core's layers: which subpackage may import which (imports inside functions count too).

From the bottom: ``errors``; ``runtime`` (the machine); ``parts`` (the part interfaces and core's parts) and
``attention`` (attention arithmetic); ``plugin`` (hooks, discovery, registry, base configs); ``config`` (parsing,
composing a policy); ``cache`` (the per-layer engine); ``integration`` (hook, builder, persistence); ``eval``,
``model`` and ``testing``; ``apps`` (CLI, server) on top.
"""

import pytest
from test_import_graph import graph

PKG = "kvpolicy_core"

#: layer -> the layers (and itself) its modules may import
ALLOWED = {
    "errors": {"errors"},
    "runtime": {"runtime", "errors"},
    "parts": {"parts", "errors"},
    "attention": {"attention", "parts", "errors"},
    "plugin": {"plugin", "parts", "errors"},
    "config": {"config", "plugin", "parts", "errors"},
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
#: modules of the package root that are plumbing, not a layer (lazy exports)
ROOT_PLUMBING = {"_lazy"}


def layer_of(module: str) -> str:
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
            if dst not in ALLOWED[src]:
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
    ],
)
def test_the_rules_forbid_the_upward_edges(edge):
    src, dst = edge
    g = {f"{PKG}.{src}.a": [f"{PKG}.{dst}.b"], f"{PKG}.{dst}.b": []}
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
