"""The plugin host stays small enough to read in one sitting (issue 50): ``plugin/`` is at most 300 lines.

kvpolicy-core's own plugin (its shared parts and the ``random`` method) is not the host: it lives in
``kvpolicy_core/default_plugin.py``, which the host imports by name, as llm loads its default plugins.
"""

from pathlib import Path

PLUGIN = Path(__file__).resolve().parents[1] / "kvpolicy_core" / "src" / "kvpolicy_core" / "plugin"


def test_the_plugin_host_is_at_most_300_lines():
    sizes = {p.name: len(p.read_text().splitlines()) for p in sorted(PLUGIN.glob("*.py"))}
    assert sum(sizes.values()) <= 300, sizes
