"""kvpolicy-core's import graph has no cycle, counting imports inside functions too (none may hide one)."""

import ast
from pathlib import Path

import kvpolicy_core

ROOT = Path(kvpolicy_core.__file__).parent


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, name: str):
    """kvpolicy_core modules ``path`` imports anywhere in its body (top level or inside functions)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
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
    assert "kvpolicy_core.config.parse" in g and "kvpolicy_core.plugin.discovery" in g["kvpolicy_core.config.parse"]
    cycle = find_cycle(g)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_checker_finds_a_cycle():
    assert find_cycle({"a": ["b"], "b": ["c"], "c": ["a"]}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": ["b"], "b": []}) is None


def test_a_config_with_a_typed_policy_needs_no_registry(monkeypatch):
    import kvpolicy_core.config.parse as config_module
    from kvpolicy_h2o import H2OConfig

    def no_registry():
        raise AssertionError("plugin discovery was used")

    monkeypatch.setattr(config_module, "get_registry", no_registry)
    cfg = config_module.KVCacheConfig(method="h2o", seed=3, policy=H2OConfig(budget=32))
    assert cfg.policy.budget == 32 and cfg.h2o_budget == 32 and cfg.seed == 3
