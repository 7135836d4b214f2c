"""kvpolicy-core's import graph has no cycle, counting imports inside functions too (none may hide one)."""

import ast
from pathlib import Path

import kvpolicy_core

ROOT = Path(kvpolicy_core.__file__).parent


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, name: str, top_only: bool = False):
    """kvpolicy_core modules ``path`` imports anywhere in its body (top level or inside functions; ``top_only``:
    at the top level)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    tree = ast.parse(path.read_text())
    for node in tree.body if top_only else ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = package
            for _ in range(node.level - 1):
                base = base.rpartition(".")[0]
            target = f"{base}.{node.module}" if node.level and node.module else (base if node.level else node.module)
            out.add(target)
            out.update(f"{target}.{a.name}" for a in node.names)  # "from . import builtin"
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return out


def graph():
    files = {module_name(p): p for p in ROOT.rglob("*.py")}
    return {name: sorted(t for t in imports_of(p, name) if t in files and t != name) for name, p in files.items()}


def find_cycle(g):
    state, stack = {}, []

    def visit(n):
        state[n] = 1
        stack.append(n)
        for m in g[n]:
            if state.get(m) == 1:
                return stack[stack.index(m) :] + [m]
            if m not in state:
                found = visit(m)
                if found:
                    return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(g):
        if n not in state:
            found = visit(n)
            if found:
                return found
    return None


def test_core_has_no_import_cycle():
    g = graph()
    assert "kvpolicy_core.config.resolve" in g and "kvpolicy_core.plugin.discovery" in g["kvpolicy_core.config.resolve"]
    cycle = find_cycle(g)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_checker_finds_a_cycle():
    assert find_cycle({"a": ["b"], "b": ["c"], "c": ["a"]}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": ["b"], "b": []}) is None


def test_the_config_models_know_no_registry():
    """The config models import nothing of the plugin host, directly or through other modules (only the flat form
    of ``KVCacheConfig(...)`` reaches :mod:`kvpolicy_core.config.resolve`, inside its constructor)."""
    g = graph()
    top = {
        name: [
            t
            for t in imports_of(ROOT / (name.split(".", 1)[1].replace(".", "/") + ".py"), name, top_only=True)
            if t in g and t != name
        ]
        for name in (
            "kvpolicy_core.config.policy_config",
            "kvpolicy_core.config.attention_config",
            "kvpolicy_core.config.cache_config",
        )
    }
    for model, direct in top.items():
        seen, todo = set(), list(direct)
        while todo:
            m = todo.pop()
            if m not in seen:
                seen.add(m)
                todo.extend(g[m])
        assert not any(m.startswith("kvpolicy_core.plugin") or m == "kvpolicy_core.config.resolve" for m in seen), (
            model,
            sorted(seen),
        )


def test_a_config_with_a_typed_policy_needs_no_registry(monkeypatch):
    import kvpolicy_core.config.resolve as resolve_module
    from kvpolicy_core.config.cache_config import KVCacheConfig
    from kvpolicy_core.config.parse import parse_config
    from kvpolicy_h2o import H2OConfig

    def no_registry():
        raise AssertionError("plugin discovery was used")

    monkeypatch.setattr(resolve_module, "get_registry", no_registry)
    cfg = KVCacheConfig(method="h2o", seed=3, policy=H2OConfig(budget=32))
    assert cfg.policy.budget == 32 and cfg.h2o_budget == 32 and cfg.seed == 3
    # a typed config passed onward is not parsed again: overrides go through the method's own config class
    assert parse_config(cfg) is cfg
    smaller = parse_config(cfg, budget=16, h2o_n_sink=2, seed=5)
    assert (smaller.policy.budget, smaller.policy.n_sink, smaller.seed) == (16, 2, 5)
    assert type(smaller.policy) is H2OConfig and smaller == cfg.replace(budget=16, n_sink=2, seed=5)
