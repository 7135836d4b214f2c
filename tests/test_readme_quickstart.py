"""README.md's quick start runs as written on the default model and shows compression; its commands are found.

The Python block under "## Quick start" is executed as it stands, in this process, with one shortcut: its
``mlx_lm.load`` of the default model returns the session's already loaded default model (the ``default_gemma``
fixture, the same directory), so the test costs the generation alone (~15 s on 2 cores).
"""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def quick_start_block() -> str:
    text = README.read_text()
    section = text[text.index("## Quick start") :]
    return re.search(r"```python\n(.*?)```", section, flags=re.S)[1]


def shell_blocks():
    return re.findall(r"```bash\n(.*?)```", README.read_text(), flags=re.S)


def test_the_quick_start_block_is_found_and_uses_the_default_model():
    code = quick_start_block()
    compile(code, "README.md quick start", "exec")
    assert "ensure_default_model()" in code and "load_optimized_blas()" in code
    assert "head_dim=" not in code  # a head_dim of another model stops it (the default model's is 256)


def test_every_readme_command_line_of_kvpolicy_runs_from_the_venv():
    """A bare ``kvpolicy`` is on PATH only inside the activated environment: every block that calls it activates
    it first, or calls ``.venv/bin/kvpolicy``."""
    for block in shell_blocks():
        lines = [ln.strip() for ln in block.splitlines()]
        bare = [ln for ln in lines if ln.startswith("kvpolicy ")]
        if bare:
            assert lines[0].startswith("source .venv/bin/activate"), block


@pytest.mark.integration
@pytest.mark.slow
def test_the_quick_start_runs_as_written_on_the_default_model_and_compresses(default_gemma, monkeypatch):
    import mlx_lm

    from kvpolicy_core.model.default import ensure_default_model

    default_dir = str(ensure_default_model())

    def load(path, *args, **kwargs):
        assert path == default_dir and not args and not kwargs, (path, args, kwargs)
        return default_gemma

    monkeypatch.setattr(mlx_lm, "load", load)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(quick_start_block(), "README.md quick start", "exec"), {"__name__": "__main__"})
    printed = out.getvalue()
    m = re.search(r"kept (\d+) of (\d+) tokens: x([\d.]+)", printed)
    assert m, printed
    kept, seen, ratio = int(m[1]), int(m[2]), float(m[3])
    assert kept == 32 and seen > 64 and ratio >= 2.0, printed  # compression a newcomer sees (not x1.0)
    assert len(printed.split("kept ")[0].split()) >= 20, printed  # the generated text
    assert "mass False" in printed and "'merges': " in printed, printed
