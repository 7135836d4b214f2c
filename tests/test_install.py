"""Separately installable distributions: fresh virtual environments, real pip installs, entry points.

``pip install kvpolicy-h2o`` must bring kvpolicy-core with it and make ``method="h2o"`` available
with nothing else to configure; the example third-party plugin installs next to kvpolicy-core only,
is discovered through entry points and passes the test kit. kvpolicy-core is not on PyPI yet, so it
comes from a locally built wheel (``--find-links``); everything else from the package index.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]


def sh(*cmd, **kw):
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    env.pop("PYTHONPATH", None)
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, env=env, **kw)
    assert proc.returncode == 0, f"{cmd}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


@pytest.fixture(scope="module")
def wheels(tmp_path_factory):
    out = tmp_path_factory.mktemp("wheels")
    for dist in ("kvpolicy_core", "kvpolicy_h2o", "kvpolicy_cam", "examples/kvpolicy-streaming"):
        sh(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", out, ROOT / dist)
    return out


def methods_in(python):
    code = "from kvpolicy_core import get_registry; print(','.join(sorted(get_registry().methods())))"
    return sh(python, "-c", code).strip()


def test_each_distribution_installs_alone_and_registers_through_entry_points(tmp_path, wheels):
    venv = tmp_path / "venv"
    sh(sys.executable, "-m", "venv", venv)
    py = venv / "bin" / "python"
    pip = [py, "-m", "pip", "install", "-q", "--find-links", wheels]
    sh(*pip, "kvpolicy-h2o")  # brings kvpolicy-core (and mlx, mlx-lm, pluggy, pydantic) with it
    assert methods_in(py) == "h2o,random"  # random: the floor, shipped by core
    sh(*pip, "kvpolicy-streaming", "pytest")
    assert methods_in(py) == "h2o,random,streamingllm,streamingmerge,tova"
    tests = ROOT / "examples" / "kvpolicy-streaming" / "tests"
    out = sh(py, "-m", "pytest", "-q", "-p", "no:cacheprovider", tests, cwd=tmp_path)
    assert "passed" in out and "failed" not in out
    sh(*pip, "kvpolicy-cam")
    assert methods_in(py) == "cam,h2o,random,streamingllm,streamingmerge,tova"
