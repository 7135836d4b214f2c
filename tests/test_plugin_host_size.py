"""The plugin host stays small enough to read in one sitting (issue 50): its modules are at most 300 lines.

``builtin.py`` is not counted: it is kvpolicy-core's own plugin (its parts and the ``random`` method), not the host;
it stays in ``plugin/`` only because tests/test_layers.py has no layer for it outside the plugin host.
"""

from pathlib import Path

PLUGIN = Path(__file__).resolve().parents[1] / "kvpolicy_core" / "src" / "kvpolicy_core" / "plugin"


def test_the_plugin_host_is_at_most_300_lines():
    sizes = {p.name: len(p.read_text().splitlines()) for p in sorted(PLUGIN.glob("*.py")) if p.name != "builtin.py"}
    assert sum(sizes.values()) <= 300, sizes
