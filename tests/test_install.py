"""Separately installable distributions: fresh virtual environments, real installs, entry points.

``pip install kvpolicy-h2o`` must bring kvpolicy-core with it and make ``method="h2o"`` available
with nothing else to configure; the example third-party plugin installs next to kvpolicy-core only,
is discovered through entry points and passes the test kit. kvpolicy-core is not on PyPI yet, so it
comes from a locally built wheel (``--find-links``); everything else from the package index.

The wheels are built and installed with uv: it reads the same standard metadata as pip (dependencies,
entry points), and installs mlx, mlx-lm and their dependencies from its cache in about a second where
pip takes a minute, which keeps this guarantee inside the test suite's time budget.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
UV = [sys.executable, "-m", "uv"]


def sh(*cmd, **kw):
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1", "UV_NO_PROGRESS": "1"}
    env.pop("PYTHONPATH", None)
    env.pop("VIRTUAL_ENV", None)
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, env=env, **kw)
    assert proc.returncode == 0, f"{cmd}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


@pytest.fixture(scope="module")
def wheels(tmp_path_factory):
    out = tmp_path_factory.mktemp("wheels")
    for dist in ("kvpolicy_core", "kvpolicy_h2o", "kvpolicy_cam", "examples/kvpolicy-streaming"):
        sh(*UV, "build", "-q", "--out-dir", out, ROOT / dist)  # the sdist, then the wheel from it: what PyPI gets
    assert len(list(out.glob("*.whl"))) == len(list(out.glob("*.tar.gz"))) == 4
    return out


def methods_in(python):
    code = "from kvpolicy_core import get_registry; print(','.join(sorted(get_registry().methods())))"
    return sh(python, "-c", code).strip()


def test_each_distribution_installs_alone_and_registers_through_entry_points(tmp_path, wheels):
    venv = tmp_path / "venv"
    sh(*UV, "venv", "-q", "--python", sys.executable, venv)
    py = venv / "bin" / "python"
    install = [*UV, "pip", "install", "-q", "--python", py, "--find-links", wheels]
    sh(*install, "kvpolicy-h2o")  # brings kvpolicy-core (and mlx, mlx-lm, pluggy, pydantic) with it
    assert methods_in(py) == "h2o,random"  # random: the floor, shipped by core
    sh(*install, "kvpolicy-streaming", "pytest")
    assert methods_in(py) == "h2o,random,streamingllm,streamingmerge,tova"
    tests = ROOT / "examples" / "kvpolicy-streaming" / "tests"
    out = sh(py, "-m", "pytest", "-q", "-p", "no:cacheprovider", tests, cwd=tmp_path)
    assert "passed" in out and "failed" not in out
    sh(*install, "kvpolicy-cam")
    assert methods_in(py) == "cam,h2o,random,streamingllm,streamingmerge,tova"
